"""Importers: agent-trace datasets and KernelBench-Hard result files -> submissions, tables, annotations.

`kernelboard import traces` rebuilds each run's final solution from its trace (`recover`) and
decides how the run ended (`outcome`); `kernelboard import kbh` reads another grader's board
(`kbh`); `annotations` is the audit-verdict schema the site reads. Nothing here imports torch,
and `datasets` is imported only by the command that loads a Hub dataset.
"""

from .annotations import FLAG_VERDICTS, VERDICTS, Annotation, load_annotations
from .kbh import import_kbh
from .traces import ImportReport, TraceFile, TraceSource, import_traces, read_dataset, read_folder

__all__ = [
    "FLAG_VERDICTS",
    "VERDICTS",
    "Annotation",
    "ImportReport",
    "TraceFile",
    "TraceSource",
    "import_kbh",
    "import_traces",
    "load_annotations",
    "read_dataset",
    "read_folder",
]
