"""Names shared by the importers: run ids, model slugs and labs, GPU keys of other graders' boards.

Run ids follow `YYYYMMDD_HHMMSS_<harness>_<model>_<NN>_<problem>`; the harness may hold dashes
(`kinetic-claude`, `or-fable`), the model underscores for a provider path
(`anthropic_claude-opus-5`). The model the trace names disambiguates the split.
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass

#: Board folders / suffixes of KernelBench-Hard and its trace datasets -> our GPU keys.
#: Its `h100` board is the PCIe SKU; the root (no folder) is its canonical RTX PRO 6000 board.
BOARD_GPUS: dict[str, str] = {
    "h100": "h100-pcie",
    "h100-pcie": "h100-pcie",
    "h100-sxm": "h100-sxm",
    "b200": "b200",
    "h200": "h200",
    "rtxpro6000": "rtx-pro-6000",
    "rtx-pro-6000": "rtx-pro-6000",
}
ROOT_GPU = "rtx-pro-6000"

#: The UTC offset of the clock kernelbench.com's run ids are written in (`date +%Y%m%d_%H%M%S` in
#: scripts/lib/run_harness.sh, local time). Every start time its runner recorded (`started_at`,
#: `date -Is`, in the result files of Infatoshi/kernelbench.com at c7d92211) is the run id's time at
#: -06:00: 131 runs of May-June 2026. Runs on other hosts or in winter may differ by whole hours.
RUNNER_UTC_OFFSET = dt.timedelta(hours=-6)

#: Model-name prefixes (after any provider path) -> lab. Unknown models get no lab, never a guess.
_LABS: tuple[tuple[str, str], ...] = (
    ("claude", "Anthropic"), ("gpt", "OpenAI"), ("o3", "OpenAI"), ("o4", "OpenAI"), ("codex", "OpenAI"),
    ("gemini", "Google"), ("grok", "xAI"), ("glm", "Z.ai"), ("kimi", "Moonshot AI"), ("deepseek", "DeepSeek"),
    ("qwen", "Alibaba"), ("minimax", "MiniMax"), ("composer", "Cursor"), ("muse", "Meta"),
)
_PROVIDERS = {"anthropic": "Anthropic", "openai": "OpenAI", "google": "Google", "x-ai": "xAI", "z-ai": "Z.ai",
              "moonshotai": "Moonshot AI", "deepseek": "DeepSeek", "qwen": "Alibaba", "minimax": "MiniMax"}
_RUN_ID = re.compile(r"^(\d{8}_\d{6})_(.+?)_(\d{2}_[A-Za-z0-9_]+)$")


@dataclass(frozen=True)
class RunName:
    stamp: str
    harness: str
    model: str  # as written in the run id (provider path with '_')
    problem: str


def split_run_id(run_id: str, model: str | None = None, problems: frozenset[str] = frozenset()) -> RunName | None:
    """Harness, model and problem of a run id; None when it does not follow the pattern."""
    problem = next((p for p in sorted(problems, key=len, reverse=True) if run_id.endswith("_" + p)), None)
    m = _RUN_ID.match(run_id)
    if m is None and problem is None:
        return None
    stamp_rest = run_id[: -len(problem) - 1] if problem else f"{m.group(1)}_{m.group(2)}"  # type: ignore[union-attr]
    problem = problem or m.group(3)  # type: ignore[union-attr]
    stamp, _, head = stamp_rest[:15], stamp_rest[15:16], stamp_rest[16:]
    if not re.fullmatch(r"\d{8}_\d{6}", stamp) or not head:
        return None
    written = model.replace("/", "_") if model else None
    if written and head.endswith("_" + written) and len(head) > len(written) + 1:
        return RunName(stamp, head[: -len(written) - 1], written, problem)
    harness, _, rest = head.partition("_")
    return RunName(stamp, harness, rest or harness, problem) if rest else None


def model_slug(model: str) -> str:
    """Our model key: the name without its provider path, lower-case, URL-safe ('anthropic/Claude-X' -> 'claude-x')."""
    name = model.rsplit("/", 1)[-1].strip().lower().replace("[1m]", "-1m")
    return re.sub(r"[^a-z0-9._-]+", "-", name).strip("-._") or "unknown"


def lab_of(model: str) -> str | None:
    """The lab that makes a model, from its provider path or a well-known name prefix."""
    if "/" in model:
        provider = model.split("/")[-2].lower()
        if provider in _PROVIDERS:
            return _PROVIDERS[provider]
    slug = model_slug(model)
    return next((lab for prefix, lab in _LABS if slug.startswith(prefix)), None)
