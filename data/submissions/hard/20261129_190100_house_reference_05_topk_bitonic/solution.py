"""The problem's own reference, submitted as a solution: the eager PyTorch floor of the board.

It should pass every check and score about 1× against eager PyTorch by construction.
"""

from reference import Model, get_init_inputs, get_inputs  # noqa: F401
