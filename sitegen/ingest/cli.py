"""`kernelboard import …`: the Click group `import_group` (registered by `kernelboard/cli.py`).

`datasets` (and with it `teich`) is imported only inside `import traces` for a Hub dataset, so the
group's help and the local-folder path need neither.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Protocol

import click

from kernelboard.errors import UsageError


class ImportReport(Protocol):
    """What an import of published boards reports (kbh.KbhReport, mega.MegaReport)."""

    skipped: list[str]
    warnings: list[str]

    def summary(self) -> str: ...

_DIR = click.Path(file_okay=False, path_type=Path)
_EXISTING_DIR = click.Path(exists=True, file_okay=False, path_type=Path)


@click.group("import")
def import_group() -> None:
    """Import agent traces or another grader's results into data/."""


def _progress(items: Iterable, total: int | None, what: str) -> Iterator:
    """Iterate with a rich progress bar on stderr (quiet when it is not a terminal)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    console = Console(stderr=True)
    columns = (TextColumn(f"[bold]{what}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
               TextColumn("{task.fields[name]}"))
    with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task(what, total=total, name="")
        for item in items:
            bar.update(task, advance=1, name=getattr(item, "path", ""))
            yield item


def _hub_revision(dataset: str, revision: str) -> str:
    """The commit a Hub revision names, so trace links stay valid; the name itself when it cannot be resolved."""
    try:
        from huggingface_hub import HfApi

        return HfApi().dataset_info(dataset, revision=revision).sha or revision
    except Exception:  # offline, or no such revision: the loader reports the real problem
        return revision


def _decks(decks: Path, bench: str) -> frozenset[str]:
    folder = decks / bench
    return frozenset(p.name for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else frozenset()


@import_group.command("traces")
@click.argument("source")
@click.option("--bench", default="hard", show_default=True, help="Deck the runs belong to.")
@click.option("--revision", default="main", show_default=True,
              help="Hub revision (branch, tag or commit) to load and to link traces at.")
@click.option("--hub", "hub_id", metavar="OWNER/NAME",
              help="For a local folder: the Hub dataset it is a copy of (enables trace links).")
@click.option("--root-gpu", default="rtx-pro-6000", show_default=True,
              help="GPU of traces at the dataset's root (subfolders name theirs: h100/ -> h100-pcie).")
@click.option("--data", "data_dir", type=_DIR, default=Path("data"), show_default=True,
              help="Data folder; runs go to DATA/submissions/<bench>/<run_id>/.")
@click.option("--decks", "decks_dir", type=_DIR, default=Path("eval/decks"), show_default=True,
              help="Problem decks, to split run ids into model and problem.")
def traces(source: str, bench: str, revision: str, hub_id: str | None, root_gpu: str, data_dir: Path,
           decks_dir: Path) -> None:
    """Import agent traces: SOURCE is a Hub dataset id (OWNER/NAME) or a local folder of JSONL / parquet."""
    from .traces import TraceSource, import_traces, read_dataset, read_folder

    local = Path(source)
    if local.is_dir():
        files = list(read_folder(local))
        label = f"hf:{hub_id}@{revision}" if hub_id else f"traces:{local.resolve().name}"
        where = TraceSource(label, hub_id, revision)
    elif "/" in source and not local.exists():
        try:
            from datasets import load_dataset
        except ImportError:
            raise UsageError("loading a Hub dataset needs the traces extra: pip install 'kernelboard[traces]' "
                             "(datasets and teich)") from None
        commit = revision if len(revision) == 40 else _hub_revision(source, revision)
        dataset = load_dataset(source, revision=commit, split="train")
        files = list(read_dataset(_progress(dataset, len(dataset), "reading"), name=source))
        where = TraceSource(f"hf:{source}@{commit}", source, commit)
    else:
        raise UsageError(f"{source}: neither a local folder nor a Hub dataset id (OWNER/NAME)")
    report = import_traces(_progress(files, len(files), "importing"), data_dir=data_dir, bench=bench,
                           source=where, root_gpu=root_gpu, problems=_decks(decks_dir, bench))
    for line in report.skipped:
        click.echo(f"skipped: {line}", err=True)
    click.echo(report.summary())


@import_group.command("kbh")
@click.argument("path", type=_EXISTING_DIR)
@click.option("--bench", default="hard", show_default=True, help="Bench of the installation to read.")
@click.option("--data", "data_dir", type=_DIR, default=Path("data"), show_default=True,
              help="Data folder: rows go to DATA/results/<gpu>/, audits to DATA/annotations/.")
@click.option("--decks", "decks_dir", type=_DIR, default=Path("eval/decks"), show_default=True,
              help="Problem decks; runs of problems without a deck folder are not imported.")
@click.option("--traces", "traces_dataset", metavar="OWNER/NAME",
              help="Hub dataset holding the runs' traces, for runs the source's model index gives no trace link.")
@click.option("--repo", default="Infatoshi/kernelbench.com", show_default=True,
              help="GitHub repository PATH is a checkout of; source files are linked there.")
@click.option("--revision", metavar="COMMIT",
              help="Commit PATH is at (default: read from its git checkout).")
def kbh(path: Path, bench: str, data_dir: Path, decks_dir: Path, traces_dataset: str | None, repo: str,
        revision: str | None) -> None:
    """Import KernelBench-Hard's published boards (kernelbench.com's repository, or an installation), labelled
    as measured by that grader, with every run's kernel so that it can be regraded."""
    from .kbh import import_kbh

    if bench == "mega":
        raise click.ClickException(f"{path}: KernelBench-Mega's results are read by `kernelboard import mega`, "
                                   "not `import kbh` (its columns, kernels and audits differ)")
    _report(lambda: import_kbh(path, data_dir=data_dir, bench=bench,
                               decks_dir=decks_dir if decks_dir.is_dir() else None,
                               traces_dataset=traces_dataset, repo=repo, revision=revision))


@import_group.command("mega")
@click.argument("path", type=_EXISTING_DIR)
@click.option("--data", "data_dir", type=_DIR, default=Path("data"), show_default=True,
              help="Data folder: rows go to DATA/results/<gpu>/, kernels to DATA/submissions/mega/, audits to "
                   "DATA/annotations/.")
@click.option("--decks", "decks_dir", type=_DIR, default=Path("eval/decks"), show_default=True,
              help="Problem decks; runs of problems without a deck folder are not imported.")
@click.option("--traces", "traces_dataset", metavar="OWNER/NAME",
              help="Hub dataset holding the runs' traces (e.g. Infatoshi/kernelbench-mega-traces), to link them.")
@click.option("--repo", default="Infatoshi/kernelbench.com", show_default=True,
              help="GitHub repository PATH is a checkout of; source files are linked there.")
@click.option("--revision", metavar="COMMIT", help="Commit PATH is at (default: read from its git checkout).")
def mega(path: Path, data_dir: Path, decks_dir: Path, traces_dataset: str | None, repo: str,
         revision: str | None) -> None:
    """Import KernelBench-Mega's published results (results.csv, kernels, audits) from a checkout of
    kernelbench.com's repository, labelled as measured by that grader, with every kernel so that it can be regraded."""
    from .mega import import_mega

    _report(lambda: import_mega(path, data_dir=data_dir, decks_dir=decks_dir if decks_dir.is_dir() else None,
                                repo=repo, revision=revision, traces_dataset=traces_dataset))


def _report(run: Callable[[], ImportReport]) -> None:
    """Run an import of published boards; print what it skipped and warned of, then its summary, or its
    problems as one error (one line each)."""
    from kernelboard.errors import DataError

    try:
        report = run()
    except DataError as exc:
        raise click.ClickException("\n".join(exc.problems)) from None
    for line in report.skipped:
        click.echo(f"skipped: {line}", err=True)
    for line in report.warnings:
        click.echo(f"warning: {line}", err=True)
    click.echo(report.summary())


__all__ = ["import_group"]
