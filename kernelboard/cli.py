"""The `kernelboard` command line: thin Click commands that each call one library function.

Heavy imports (torch, plotly, pandas) happen inside command bodies, so `kernelboard --help` is
instant and `kernelboard site` never imports torch.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click

from kernelboard import __version__

_DIR = click.Path(file_okay=False, path_type=Path)
_EXISTING_DIR = click.Path(exists=True, file_okay=False, path_type=Path)
#: The submissions folder of the commands that only read it (compile-ahead, keep-ahead).
_existing_submissions = click.option("--submissions", type=_EXISTING_DIR, default=Path("data/submissions/hard"),
                                     show_default=True,
                                     help="One folder per run: solution.py (+ sidecar files) and run.yaml.")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kernelboard")
def main() -> None:
    """Grade GPU kernels written by coding agents and publish per-GPU leaderboards."""


# ---------------------------------------------------------------------------------------- eval


@contextlib.contextmanager
def _one_line_os_errors() -> Iterator[None]:
    """A file the command cannot read or write (a full disk, a read-only or missing folder) is one line
    naming it, never a traceback; tables are written atomically, so nothing is half-written."""
    from kernelboard.errors import KernelboardError

    try:
        yield
    except OSError as exc:
        where = exc.filename or "?"
        raise KernelboardError(f"{where}: {exc.strerror or exc}") from None


def _os_errors_are_one_line(command: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(command)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with _one_line_os_errors():
            return command(*args, **kwargs)
    return wrapped



@main.group(invoke_without_command=True, context_settings={"ignore_unknown_options": False})
@click.option("--deck", type=_DIR, default=Path("eval/decks/hard"), show_default=True,
              help="Problem deck: one folder per problem with problem.yaml and reference.py.")
@click.option("--submissions", type=_DIR, default=Path("data/submissions/hard"), show_default=True,
              help="One folder per run: solution.py (+ sidecar files) and run.yaml.")
@click.option("--out", type=_DIR, default=Path("data/results"), show_default=True,
              help="Results folder; tables go to OUT/<gpu>/*.parquet, logs to OUT/<gpu>/logs/.")
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default="cuda", show_default=True,
              help="cpu grades the problems' small CPU shapes and labels every timing as CPU.")
@click.option("--only", "only", multiple=True, metavar="GLOB",
              help="Grade only runs whose run_id matches this glob (repeatable: the runs an earlier glob "
                   "matches are graded first, as in a queue from `eval todo`).")
@click.option("--exclude", "exclude", multiple=True, metavar="GLOB",
              help="Leave out runs whose run_id matches this glob (repeatable; after --only): a kernel "
                   "whose first call autotunes past a GPU call's deadline, say.")
@click.option("--resume", is_flag=True,
              help="Skip runs already graded on this GPU with the same solution by a grader whose results "
                   "this one reproduces (settings.RESULTS_COMPARABLE_SINCE up to this version).")
@click.option("--regrade", is_flag=True,
              help="Grade everything selected even with --resume, and measure the baselines again.")
@click.option("--prebuild/--no-prebuild", default=None,
              help="Compile the next solutions' extensions on the CPU while the GPU grades, up to 3 at once "
                   "(one per 4 cores) [default: on with --device cuda].")
@click.option("--build-ahead", "build_ahead", type=click.IntRange(min=1), default=None, metavar="N",
              help="Compile N solutions at once ahead of the GPU instead (each torch extension build runs "
                   "about two compilers; a host whose GPU waits on builds grades faster with more).")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=1), default=900.0, show_default=True,
              help="Seconds one submission may take in all before its process group is killed.")
@click.option("--build-timeout", "build_timeout_s", type=click.FloatRange(min=1), default=600.0, show_default=True,
              help="Seconds for importing solution.py (compiling its extensions) and building its Model.")
@click.option("--check-timeout", "check_timeout_s", type=click.FloatRange(min=1), default=600.0, show_default=True,
              help="Seconds for the correctness checks of one shape.")
@click.option("--timing-timeout", "timing_timeout_s", type=click.FloatRange(min=1), default=600.0,
              show_default=True, help="Seconds for timing one shape.")
@click.option("--baseline-timeout", "baseline_timeout_s", type=click.FloatRange(min=1), default=1800.0,
              show_default=True, help="Seconds the eager and torch.compile baselines of one problem may take.")
@click.option("--skip-baseline", "skip_baselines", multiple=True, metavar="VARIANT",
              type=click.Choice(["compile:max-autotune"]),
              help="Do not measure this baseline variant (max-autotune can take minutes a problem); the "
                   "headline is then the fastest variant measured, and the tables show which one it was.")
@click.option("--unsandboxed", is_flag=True,
              help="Grade without the bubblewrap sandbox where it is not available (each row then says so). "
                   "Only for code you trust: a solution could read or rewrite anything this user can.")
@click.option("--gpus", default=None, metavar="LIST",
              help="Grade on these CUDA devices at once (e.g. 0,1): one grader process per GPU; each "
                   "problem's baselines measured once per GPU model, then the runs spread across the GPUs; "
                   "results merged into --out.")
@click.option("--stop-at", "stop_at", type=float, default=None, metavar="EPOCH",
              help="When this batch will be cut (seconds since the epoch: a GPU call's deadline). A run held back "
                   "after long interrupted gradings is not started where each of them ran longer than what is "
                   "left then, nor any run where the quickest pass of its problem on this GPU took longer.")
@click.option("--baselines-only", is_flag=True,
              help="Measure the baselines of the selected runs' problems (those not cached yet) and grade nothing.")
@click.option("--ray", "ray_address", is_flag=False, flag_value="local", default=None, metavar="[ADDRESS]",
              help="Grade on a Ray cluster (the 'ray' extra): each run a task on one GPU of each model the nodes "
                   "advertise as a gpu_<key> resource, baselines measured once per model first, results merged "
                   "into --out as they arrive. Without ADDRESS: a local instance of this host's GPUs.")
@click.pass_context
@_os_errors_are_one_line
def eval(ctx: click.Context, gpus: str | None, ray_address: str | None, **options: object) -> None:
    """Grade submissions against the deck's references: correctness first, then timing."""
    if ctx.invoked_subcommand is not None:
        return  # `eval merge` and `eval calibrate` need neither a deck nor submissions
    for name in ("deck", "submissions"):  # checked here, not by Click, so that subcommands run anywhere
        if not Path(options[name]).is_dir():  # type: ignore[arg-type]
            raise click.BadParameter(f"Directory '{options[name]}' does not exist.", param_hint=f"'--{name}'")
    from kernelboard.eval.schedule import EvalOptions, run_eval

    if ray_address is not None:
        if gpus is not None:
            raise click.UsageError("--ray and --gpus: choose one (the cluster's nodes advertise their GPUs)")
        from kernelboard.eval.cluster import run_ray

        run_ray(EvalOptions(**options), None if ray_address == "local" else ray_address)  # type: ignore[arg-type]
        return
    if gpus is not None:
        from kernelboard.eval.parallel import run_parallel

        run_parallel(EvalOptions(**options), [d.strip() for d in gpus.split(",")])  # type: ignore[arg-type]
        return
    run_eval(EvalOptions(**options))  # type: ignore[arg-type]


@eval.command("calibrate")
@click.option("--out", type=_DIR, default=Path("data/results"), show_default=True,
              help="Results folder; the measured peaks go to OUT/<gpu>/hardware.parquet.")
def eval_calibrate(out: Path) -> None:
    """Measure this GPU's copy bandwidth and bf16/fp8 GEMM throughput into the hardware table."""
    from kernelboard.eval.schedule import run_calibrate

    row = run_calibrate(out)
    fp8 = row["measured_fp8_tflop_s"]
    click.echo(f"{row['name']}: copy {row['measured_copy_gb_s']:.0f} GB/s (datasheet {row['bandwidth_gb_s']}), "
               f"bf16 {row['measured_bf16_tflop_s']:.0f} TFLOP/s (datasheet {row['peak_tflop_s_bf16']}), "
               f"fp8 {'n/a' if fp8 is None else f'{fp8:.0f}'} TFLOP/s (datasheet {row['peak_tflop_s_fp8']})")


@eval.command("merge")
@click.argument("sources", nargs=-1, required=True, type=_EXISTING_DIR)
@click.option("--into", "into", type=_DIR, default=Path("data/results"), show_default=True,
              help="Results folder to merge into (created if missing).")
@click.option("--skip", "skip", multiple=True, metavar="RUN_ID",
              help="Leave this run's grading out (repeatable): one the grader got wrong, to be graded again.")
@_os_errors_are_one_line
def eval_merge(sources: tuple[Path, ...], into: Path, skip: tuple[str, ...]) -> None:
    """Merge results folders graded elsewhere (another GPU, another machine) into one.

    Where both hold the same run or baseline, the later measurement wins, so the order of the
    sources does not matter and a stale copy never replaces a fresh grading.
    """
    from kernelboard.eval.merge import merge_results, problems_on_boards

    before = problems_on_boards(into)
    for src in sources:
        report = merge_results(src, into, skip=frozenset(skip))
        counts = "; ".join(f"{name} {c['added']} added, {c['replaced']} replaced, {c['kept']} kept"
                           for name, c in report.items() if name != "shapes")
        if report["shapes"]["removed"]:
            counts += f"; {report['shapes']['removed']} shape rows removed (their run's result has none)"
        click.echo(f"{src} -> {into}: {counts}")
        if report["results"]["replaced"]:
            click.echo(f"{report['results']['replaced']} results replaced by later gradings: before committing, "
                       "`bench/regrade_compare.py --gpu GPU --old HEAD --record data/regrades.parquet` says how "
                       "their figures moved and keeps the ones replaced (the methodology page's \"Graded again\")")
    for (gpu, bench, problem), count in sorted(problems_on_boards(into).items()):
        if (gpu, bench, problem) not in before:
            click.echo(f"{gpu}: {problem} joins its {bench} board with {count} result{'s' * (count != 1)}; every AI "
                       f"model with a published run of it not graded there is unranked until it is "
                       f"(`kernelboard eval todo --gpu {gpu}` says how many are left)")


@eval.command("todo")
@click.option("--deck", type=_EXISTING_DIR, default=Path("eval/decks/hard"), show_default=True,
              help="Problem deck: one folder per problem with problem.yaml and reference.py.")
@_existing_submissions
@click.option("--out", type=_EXISTING_DIR, default=Path("data/results"), show_default=True,
              help="The results folder whose GPU boards to read (OUT/<gpu>/).")
@click.option("--gpu", "gpus", multiple=True, required=True, metavar="KEY",
              help="The board, by its results folder's name: h200, h100-sxm … (repeatable).")
@click.option("--only", "only", multiple=True, metavar="GLOB", help="Only runs whose run_id matches (repeatable).")
@click.option("--exclude", "exclude", multiple=True, metavar="GLOB", help="Leave these runs out (repeatable).")
@click.option("--queue", "queue", type=click.Path(dir_okay=False, path_type=Path), default=None, metavar="FILE",
              help="Write what to grade now to FILE, one run_id a line in grading order: the runs left on the "
                   "board's problems, else the next problem's (a '{gpu}' in FILE is each board's key, for "
                   "several --gpu): bench/gpu_session.sh's IDS=FILE.")
@_os_errors_are_one_line
def eval_todo(deck: Path, submissions: Path, out: Path, gpus: tuple[str, ...], only: tuple[str, ...],
              exclude: tuple[str, ...], queue: Path | None) -> None:
    """Say what is left to grade on each --gpu board, with no GPU: each problem's runs graded there (as
    `--resume` counts them), and the runs left in the order that ranks the most models soonest."""
    from kernelboard.eval.schedule import EvalOptions
    from kernelboard.eval.todo import todo

    if queue is not None and len(gpus) > 1 and "{gpu}" not in str(queue):
        raise click.UsageError("--queue with several --gpu needs '{gpu}' in its name (one file a board)")
    for gpu in gpus:
        plan = todo(EvalOptions(deck=deck, submissions=submissions, out=out, only=only, exclude=exclude), gpu)
        click.echo(f"{gpu}: {len(plan.queue)} runs left of {sum(p.total for p in plan.progress)}")
        for p in plan.progress:
            state = ("not started" if not p.on_board else "on the board" if p.measured
                     else "on the board; its baselines to measure again")
            click.echo(f"  {p.problem}: {p.graded} of {p.total} graded, {p.total - p.graded} left ({state})")
        ranked = plan.ranked_after()
        if ranked:
            click.echo(f"  the first {plan.blocking} are AI models' runs with no result the site shows, on the "
                       "board's problems whose baselines are measured; each model's runs there all have one "
                       "once this many are graded: "
                       + ", ".join(f"{model} {n}" for model, n in ranked.items()))
        if queue is not None:
            path = Path(str(queue).replace("{gpu}", gpu))
            path.parent.mkdir(parents=True, exist_ok=True)
            now = plan.now()
            path.write_text("".join(f"{sub.run_id}\n" for sub in now))
            problems = ", ".join(dict.fromkeys(sub.problem for sub in now))
            click.echo(f"  queue → {path}: {len(now)} runs of {problems or 'no problem'}")


@eval.command("compile-ahead")
@click.option("--deck", type=_EXISTING_DIR, default=Path("eval/decks/hard"), show_default=True,
              help="Problem deck: one folder per problem with problem.yaml and reference.py.")
@_existing_submissions
@click.option("--only", "only", multiple=True, metavar="GLOB", help="Only runs whose run_id matches (repeatable).")
@click.option("--exclude", "exclude", multiple=True, metavar="GLOB", help="Leave these runs out (repeatable).")
@click.option("--interrupted", "interrupted", type=_EXISTING_DIR, default=None, metavar="RESULTS",
              help="Also the runs this results folder records as cut off by a call (each GPU's interrupted.json).")
@click.option("--arch", default="9.0", show_default=True,
              help="The grading GPU's compute capability (TORCH_CUDA_ARCH_LIST form): 9.0 for H100 and H200.")
@click.option("--jobs", type=click.IntRange(min=1), default=max(1, (os.cpu_count() or 1)), show_default="the CPUs",
              help="Submissions compiled at once (each Triton compile takes one core).")
@click.option("--limit", "limit_s", type=click.FloatRange(min=1), default=1800.0, show_default=True,
              help="Seconds one submission's warm call may compile (the grader's own prebuild allows 240).")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="The archive to write (.tgz): each solution's triton/ cache under its hash.")
@_os_errors_are_one_line
def eval_compile_ahead(deck: Path, submissions: Path, only: tuple[str, ...], exclude: tuple[str, ...],
                       interrupted: Path | None, arch: str, jobs: int, limit_s: float, out: Path) -> None:
    """Compile submissions' Triton kernels for the grading GPU here, with no GPU, for the GPU host's cache.

    Unpack the archive on the GPU host with `kernelboard eval unpack-ahead` (into KERNELBOARD_CACHE, default
    ~/.cache/kernelboard) before `kernelboard eval`: a kernel whose compile outlasts a GPU call is then graded
    in seconds.
    Torch extensions are not built here (they are bound to the grading host's torch).
    """
    from kernelboard.eval.ahead import compile_ahead, interrupted_runs

    if interrupted is not None:
        cut = sorted(interrupted_runs(interrupted))
        if not (cut or only):  # an empty --only would select every submission
            raise click.UsageError(f"{interrupted} records no run cut off by a call: nothing to compile (name "
                                   "runs with --only)")
        only = (*only, *(glob.escape(run_id) for run_id in cut))
    compile_ahead(deck, submissions, out, only, exclude, arch, jobs, limit_s)


@eval.command("keep-ahead")
@click.option("--results", type=_EXISTING_DIR, default=Path("data/results"), show_default=True,
              help="The results folder whose interrupted runs' caches to keep (each GPU's interrupted.json).")
@_existing_submissions
@click.option("--run", "run_ids", multiple=True, metavar="RUN_ID", help="Keep this run's cache too (repeatable).")
@click.option("--arch", default="9.0", show_default=True,
              help="This host's GPU's compute capability (TORCH_CUDA_ARCH_LIST form), written in the manifest.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="The archive to write (.tgz), for TRITON_AHEAD on the next GPU host.")
@_os_errors_are_one_line
def eval_keep_ahead(results: Path, submissions: Path, run_ids: tuple[str, ...], arch: str, out: Path) -> None:
    """Archive the Triton variants this host compiled for runs a call cut off, for the next GPU host.

    A kernel whose compile outlasts a GPU call starts again on every fresh host; unpacked there
    (`bench/gpu_session.sh` TRITON_AHEAD=), this archive lets its compile go on where the last call stopped.
    """
    from kernelboard.eval.ahead import describe_parts, keep_ahead

    variants, runs, parts = keep_ahead(results, submissions, out, arch, run_ids)
    click.echo(f"{variants} Triton kernel variants of {runs} runs → {describe_parts(parts)}" if runs else
               f"no Triton kernel variant cached for the runs {results} records as interrupted: {out} not written")


@eval.command("check-ahead")
@click.argument("archive", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@_os_errors_are_one_line
def eval_check_ahead(archive: Path) -> None:
    """Say whether a compile-ahead ARCHIVE's Triton cache keys can match this host's (exit 1 if not).

    Triton keys a variant by its own files, its compiled libtriton included, so an archive made by another
    Python ABI or Triton build is found by no grading here; this names the part that differs.
    """
    from kernelboard.eval.ahead import check_archive

    variants, differences = check_archive(archive)
    if differences:
        raise click.ClickException(f"{archive}: none of its {variants} Triton kernel variants would be found here "
                                   f"(their cache keys differ: {'; '.join(differences)})")
    click.echo(f"{archive}: {variants} Triton kernel variants, keyed as this host's Triton keys them")


@eval.command("unpack-ahead")
@click.argument("archives", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--cache", "cache_root", type=_DIR, default=None,
              help="The grader's cache root  [default: $KERNELBOARD_CACHE, else ~/.cache/kernelboard].")
@_os_errors_are_one_line
def eval_unpack_ahead(archives: tuple[Path, ...], cache_root: Path | None) -> None:
    """Unpack compile-ahead or keep-ahead ARCHIVES into the grader's cache, where its gradings find them.

    Each is checked first as check-ahead checks it (one whose cache keys cannot match here is skipped, and
    the command exits 1), then unpacked with each variant's group file pointed at its new folder: Triton
    finds a cached variant only through the absolute paths its group file names.
    """
    from kernelboard.eval.ahead import check_archive, unpack_archive
    from kernelboard.eval.sandbox import cache_root as default_root

    root = cache_root if cache_root is not None else default_root()
    refused = []
    for archive in archives:
        variants, differences = check_archive(archive)
        if differences:
            refused.append(f"{archive}: not unpacked: none of its {variants} Triton kernel variants would be found "
                           f"here (their cache keys differ: {'; '.join(differences)})")
            continue
        found, solutions = unpack_archive(archive, root)
        click.echo(f"{archive}: {found} Triton kernel variants of {solutions} solutions into {root}, each group "
                   "file pointed there")
    if refused:
        raise click.ClickException("\n".join(refused))


# ---------------------------------------------------------------------------------------- site


@main.group()
def site() -> None:
    """Build or serve the static leaderboard site."""


@site.command("build")
@click.option("--data", "data_dir", type=_EXISTING_DIR, default=Path("data"), show_default=True,
              help="The data folder: results/, submissions/ (and annotations/).")
@click.option("--decks", "decks_dir", type=_EXISTING_DIR, default=Path("eval/decks"), show_default=True,
              help="Problem decks, for each problem's README and formulas.")
@click.option("--out", "out_dir", type=_DIR, default=Path("dist"), show_default=True,
              help="Output folder; replaced whole only once the new site is complete.")
@click.option("--base-url", envvar="KERNELBOARD_BASE_URL", default=None, metavar="URL",
              help="The site's absolute address (https://…/), for sitemap.xml and og:url; "
                   "without it no sitemap is written. Env: KERNELBOARD_BASE_URL.")
@click.option("--force", is_flag=True,
              help="Build even when --out already holds a site built from these exact inputs.")
def site_build(data_dir: Path, decks_dir: Path, out_dir: Path, base_url: str | None, force: bool) -> None:
    """Render every page into a fresh folder, then swap it into place (skipped when nothing changed)."""
    from kernelboard.sitegen.render import build_site

    report = build_site(data_dir=data_dir, decks_dir=decks_dir, out_dir=out_dir, base_url=base_url, force=force)
    click.echo(report.summary())
    if not report.unchanged and not (base_url or "").strip():
        click.echo("no --base-url (or KERNELBOARD_BASE_URL): sitemap.xml not written (it needs absolute URLs)")


@site.command("serve")
@click.option("--dir", "site_dir", type=_EXISTING_DIR, default=Path("dist"), show_default=True)
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--bind", default="127.0.0.1", show_default=True)
def site_serve(site_dir: Path, port: int, bind: str) -> None:
    """Serve a built site over HTTP on localhost (Ctrl-C stops)."""
    import contextlib
    import functools
    import http.server

    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site_dir))
    with http.server.ThreadingHTTPServer((bind, port), handler) as httpd:
        click.echo(f"serving {site_dir} at http://{bind}:{port}/")
        with contextlib.suppress(KeyboardInterrupt):
            httpd.serve_forever()


def _register_import() -> None:
    """`kernelboard import …` lives with the importers (sitegen/ingest); its heavy imports
    (`datasets`) happen inside the command bodies."""
    from kernelboard.sitegen.ingest.cli import import_group

    main.add_command(import_group)


_register_import()

if __name__ == "__main__":
    main()
