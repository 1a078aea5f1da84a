"""Per-page input keys, so that a rebuild renders only the pages whose inputs changed.

A page's key hashes what it renders from. Every page reads the site's own code and settings (templates,
static/, sitegen/, package versions, --base-url, SOURCE_DATE_EPOCH: the "site" digest of
`fingerprint.digests`) and the footer every page carries (date, versions, provenance). A run page then
reads only its own run: the run and result rows (shapes included), its annotation, its solution and
sidecars, the baselines of its (bench, problem, GPU), its GPU's hardware row, whether its log is
published, and the decks. Every other page — boards, problem, model, GPU, index and meta pages — reads
the tables whole (the "tables" digest: results and logs, annotations, the data README) and the decks, and
never the submissions. So an edited solution re-renders one page, and a regraded run its own page and the
few dozen aggregate pages.

Keys are written into the built site (`MANIFEST`); the next build compares them (`render.build_site`).
Run-page keys hash the loaded rows pickled without the memo (`_flat`): every field is a plain value
(str, float, datetime, tuple, dict in file order), so the same inputs give the same bytes in every
process, and pickling is twice as fast as repr.
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from .board import gpu_label
from .load import SiteData
from .pages import Page

__all__ = ["MANIFEST", "manifest_bytes", "page_keys", "read_manifest"]

#: The file, in the built site, that maps each page's output path to its key.
MANIFEST = ".kernelboard-pages.json"


def _hex(*parts: str | bytes) -> str:
    digest = hashlib.sha256()
    for part in parts:
        data = part.encode("utf-8", "surrogatepass") if isinstance(part, str) else part
        digest.update(f"{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()[:32]  # 128 bits: ten thousand keys in the manifest stay small


def page_keys(pages: Iterable[Page], data: SiteData, digests: Mapping[str, str], site: Mapping[str, Any],
              rows_known: Mapping[str, str] | None = None) -> tuple[dict[str, str], dict[str, str]]:
    """Output path -> key for every page, and run page path -> the digest of the table rows it reads.
    `digests`: the build's `fingerprint.digests`; `site`: what every page's base template reads
    (`render._site`); `rows_known`: row digests of a build whose tables and decks were these very ones
    (kept with the data, `load.remember`), so they need not be computed again (0.4 s at 10,000 runs)."""
    rows_known = {} if rows_known is None else rows_known
    shared = _hex(digests["site"], repr(sorted(site.items())))
    aggregate = _hex(shared, digests["decks"], digests["tables"])
    baselines: dict[tuple[str, str, str], list[bytes]] = defaultdict(list)
    for b in data.baselines:
        baselines[(b.bench, b.problem, b.gpu)].append(_flat(b))
    lines = {k: _hex(*v) for k, v in baselines.items()} if len(rows_known) < len(data.results) else {}
    runs_shared = _hex(shared, digests["decks"])
    keys, row_digests = {}, {}
    for page in pages:
        result = page.result
        if result is None:
            keys[page.path] = _hex(aggregate, page.path)
            continue
        row_digest = rows_known.get(page.path)
        if row_digest is None:
            run = data.runs[result.run_id]
            rows = (run, result, data.hardware.get(result.gpu), gpu_label(data, result.gpu),
                    data.annotations.get(result.run_id), f"data/results/{result.log_path}" in data.table_files)
            row_digest = _hex(lines.get((run.bench, run.problem, result.gpu), ""), _flat(rows))
        row_digests[page.path] = row_digest
        solution = data.solutions.get(result.run_id)
        keys[page.path] = _hex(runs_shared, page.path, row_digest, _flat(data.sidecars.get(result.run_id)),
                               "-" if solution is None else solution)
    return keys, row_digests


def _flat(value: object) -> bytes:
    """`value` pickled without the memo: the bytes depend on the values alone, not on which of them
    happen to be the same object in this process."""
    out = io.BytesIO()
    pickler = pickle.Pickler(out, protocol=5)
    pickler.fast = True
    pickler.dump(value)
    return out.getvalue()


def read_manifest(site_dir: Path) -> dict[str, str]:
    """The keys the site in `site_dir` was built with; empty when it has none (or an unreadable one)."""
    try:
        keys = json.loads((Path(site_dir) / MANIFEST).read_bytes())
    except (OSError, ValueError):
        return {}
    return keys if isinstance(keys, dict) else {}


def manifest_bytes(keys: Mapping[str, str]) -> bytes:
    """The manifest file's bytes: compact, sorted, so equal keys give equal bytes."""
    return json.dumps(dict(sorted(keys.items())), separators=(",", ":")).encode()
