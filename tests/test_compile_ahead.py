"""`kernelboard eval compile-ahead`: Triton kernels compiled here for the grading GPU, carried as an archive.

Run on a published kernel no one here wrote (kimi-k2.7's 07), beside one that builds a torch extension at
import and one with no kernel of its own: only the Triton caches travel, under each solution's hash, as
the grader's cache root holds them."""

from __future__ import annotations

import io
import json
import os
import shutil
import tarfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from kernelboard.cli import main as cli
from kernelboard.eval.ahead import MANIFEST, fingerprint
from kernelboard.eval.submission import discover

ROOT = Path(__file__).resolve().parents[1]
PUBLISHED = ROOT / "data" / "submissions" / "hard" / "20260618_064723_kimi-claude_kimi-k2.7-code_07_w4a16_gemm"

BUILDS_AT_IMPORT = """\
import triton
from torch.utils.cpp_extension import load_inline

_ext = load_inline("never_here", cpp_sources="int f() { return 1; }", functions=["f"])


@triton.jit
def _unused(x):
    pass
"""
REFERENCE = "from reference import Model, get_inputs, get_init_inputs  # noqa: F401\n"


def _beside(subs: Path, name: str, source: str) -> None:
    """A 07 submission `name` of `source` in `subs`, beside the published kernel copied there."""
    (subs / name).mkdir()
    (subs / name / "solution.py").write_text(source)
    (subs / name / "run.yaml").write_text("problem: 07_w4a16_gemm\nmodel: test\nharness: pytest\n"
                                          "agent_outcome: completed\n")


def test_only_triton_caches_travel_under_each_solutions_hash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "12.0")  # this shell's own: --arch wins, and is restored after
    cache_root = os.environ.get("KERNELBOARD_CACHE")
    subs = tmp_path / "subs"
    shutil.copytree(PUBLISHED, subs / PUBLISHED.name)
    for name, source in (("b_builds_at_import", BUILDS_AT_IMPORT), ("c_reference", REFERENCE)):
        _beside(subs, name, source)
    out = tmp_path / "ahead" / "triton.tgz"
    result = CliRunner().invoke(cli, ["eval", "compile-ahead", "--deck", str(ROOT / "eval" / "decks" / "hard"),
                                      "--submissions", str(subs), "--jobs", "2", "--limit", "120", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "2 of 3 selected submissions define Triton kernels" in result.output
    assert "not built here" in result.output  # the extension's build was refused, and said so
    with tarfile.open(out) as tar:
        manifest = json.load(tar.extractfile(MANIFEST))  # type: ignore[arg-type]
        names = [n for n in tar.getnames() if n != MANIFEST]
        metadata = [json.load(tar.extractfile(n)) for n in names  # type: ignore[arg-type]
                    if n.endswith(".json") and not n.split("/")[-1].startswith("__grp__")]
    sha = {s.run_id: s.solution_sha256() for s in discover(subs)[0]}
    assert manifest["runs"] == {PUBLISHED.name: sha[PUBLISHED.name]} and manifest["arch"] == "9.0"
    assert manifest["fingerprint"] == fingerprint("9.0")  # the Triton that compiled them, keyed as this host keys
    checked = CliRunner().invoke(cli, ["eval", "check-ahead", str(out)])
    assert checked.exit_code == 0 and "keyed as this host's Triton keys them" in checked.output, checked.output
    assert {n.split("/")[0] for n in names} == {sha[PUBLISHED.name]}  # nothing of the other two
    assert all(n.split("/")[1] == "triton" for n in names)
    assert sum(n.endswith(".cubin") for n in names) >= 3, names
    assert metadata and {m["target"]["arch"] for m in metadata} == {90}
    assert not list(out.parent.glob(".*.part"))
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "12.0" and os.environ.get("KERNELBOARD_CACHE") == cache_root
    _found_by_triton_once_unpacked(out, tmp_path / "gpu-host", sha[PUBLISHED.name], monkeypatch)


def _found_by_triton_once_unpacked(archive: Path, root: Path, sha: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton's own cache lookup finds every variant of `archive` under the cache root `unpack-ahead` put it in,
    and none where the archive is only untarred: its group files name the folder it was compiled in."""
    from triton.runtime.cache import FileCacheManager

    def found(cache: Path) -> list[bool]:
        monkeypatch.setenv("TRITON_CACHE_DIR", str(cache / sha / "triton"))
        hits = []
        for group in sorted((cache / sha / "triton").glob("*/__grp__*.json")):
            metadata = group.name.removeprefix("__grp__")
            hits.append(metadata in (FileCacheManager(group.parent.name).get_group(metadata) or {}))
        return hits

    with tarfile.open(archive) as tar:
        tar.extractall(root / "untarred", members=[m for m in tar.getmembers() if m.name != MANIFEST], filter="data")
    assert found(root / "untarred") and not any(found(root / "untarred"))  # what every GPU host got before 2026-12-07
    unpacked = CliRunner().invoke(cli, ["eval", "unpack-ahead", str(archive), "--cache", str(root / "unpacked")])
    assert unpacked.exit_code == 0, unpacked.output
    hits = found(root / "unpacked")
    assert hits and all(hits)
    assert f"{len(hits)} Triton kernel variants of 1 solutions into {root / 'unpacked'}" in unpacked.output


def _archive(path: Path, manifest: dict[str, object] | None) -> Path:
    """An archive of one cubin under a made-up hash, with `manifest` (None: none, as before they had one)."""
    with tarfile.open(path, "w:gz") as tar:
        for name, data in ((MANIFEST, json.dumps(manifest).encode() if manifest else None),
                           ("abc123/triton/KEY/kernel.cubin", b"\0" * 8)):
            if data is not None:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path


def test_check_ahead_names_what_keeps_an_archives_keys_from_matching(tmp_path: Path) -> None:
    """An archive compiled by another Python ABI's Triton (the H100 host runs CPython 3.12, this machine 3.11:
    their libtriton differ, and so does every cache key) is refused in one line that names the parts."""
    here = fingerprint("9.0")
    other = {**here, "python": "cp399", "triton_key": "f" * 64}
    runner = CliRunner()
    same = runner.invoke(cli, ["eval", "check-ahead", str(_archive(tmp_path / "same.tgz", {
        "arch": "9.0", "fingerprint": here, "runs": {}}))])
    assert same.exit_code == 0 and "1 Triton kernel variants, keyed as this host's" in same.output, same.output
    moved = runner.invoke(cli, ["eval", "check-ahead", str(_archive(tmp_path / "other.tgz", {
        "arch": "9.0", "fingerprint": other, "runs": {}}))])
    assert moved.exit_code == 1 and len(moved.output.strip().splitlines()) == 1, moved.output
    assert "none of its 1 Triton kernel variants would be found here" in moved.output
    assert f"Python ABI: cp399 there, {here['python']} here" in moved.output
    assert "Triton's own files (libtriton)" in moved.output and "ptxas" not in moved.output
    refused = runner.invoke(cli, ["eval", "unpack-ahead", str(tmp_path / "other.tgz"), str(tmp_path / "same.tgz"),
                                  "--cache", str(tmp_path / "cache")])
    assert refused.exit_code == 1 and "other.tgz: not unpacked: none of its 1 Triton kernel" in refused.output
    assert "same.tgz: 0 Triton kernel variants of 1 solutions into" in refused.output  # the one that matches
    assert (tmp_path / "cache" / "abc123" / "triton" / "KEY" / "kernel.cubin").is_file()
    old = runner.invoke(cli, ["eval", "check-ahead", str(_archive(tmp_path / "old.tgz", None))])
    assert old.exit_code == 1 and "no triton-ahead.json" in old.output
    odd = runner.invoke(cli, ["eval", "check-ahead", str(_archive(tmp_path / "odd.tgz", {"runs": {}}))])
    assert odd.exit_code == 2 and "has no 'arch' and 'fingerprint'" in odd.output and "Traceback" not in odd.output
    (tmp_path / "not.tgz").write_text("not an archive")
    bad = runner.invoke(cli, ["eval", "check-ahead", str(tmp_path / "not.tgz")])
    assert bad.exit_code == 2 and "not a compile-ahead archive" in bad.output and "Traceback" not in bad.output


def test_keep_ahead_carries_what_a_cut_off_call_compiled_to_the_next_host(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A call cut off in a long compile (MiniMax-M3's 07: 297 s for 3 variants on an H100's host) leaves
    its variants in that host's cache; keep-ahead archives the caches of the runs the results folder
    records as interrupted, and only those, with this host's fingerprint, so the next host's check
    passes and its compile goes on from them. With nothing cached, no archive is written."""
    from kernelboard.eval.interrupted import add_interruption, write_records

    monkeypatch.setenv("KERNELBOARD_CACHE", str(tmp_path / "cache"))
    subs = tmp_path / "subs"
    shutil.copytree(PUBLISHED, subs / PUBLISHED.name)
    _beside(subs, "b_graded", REFERENCE)
    found = {s.run_id: s for s in discover(subs)[0]}
    cut, graded = found[PUBLISHED.name], found["b_graded"]
    results = tmp_path / "res"
    runner = CliRunner()
    args = ["eval", "keep-ahead", "--results", str(results), "--submissions", str(subs), "--arch", "9.0"]
    (results / "h100-sxm").mkdir(parents=True)
    write_records(results, "h100-sxm", add_interruption({}, cut.run_id, cut.solution_sha256(), 8.5,
                                                         "correctness", "2026-12-05T13:23:24+00:00"))
    none = runner.invoke(cli, [*args, "--out", str(tmp_path / "none.tgz")])
    assert none.exit_code == 0 and "not written" in none.output, none.output
    assert not (tmp_path / "none.tgz").exists()
    for sub in (cut, graded):  # each has a variant in this host's cache; only the cut one travels
        variant = tmp_path / "cache" / sub.cache_key() / "triton" / "ABCD"
        variant.mkdir(parents=True)
        (variant / "_w4a16_kernel.cubin").write_bytes(b"\x7fELF")
        (variant / "_w4a16_kernel.json").write_text("{}")
        for ir in ("ptx", "llir", "ttgir", "ttir", "source"):  # read by no cache hit: left out
            (variant / f"_w4a16_kernel.{ir}").write_text("lowered")
    (results / "h200").mkdir()
    (results / "h200" / "interrupted.json").write_text("{not json")  # a bad record file is no record
    out = tmp_path / "kept" / "triton-kept.tgz"
    kept = runner.invoke(cli, [*args, "--out", str(out)])
    assert kept.exit_code == 0 and f"1 Triton kernel variants of 1 runs → {out}" in kept.output, kept.output
    with tarfile.open(out) as tar:
        manifest = json.load(tar.extractfile(MANIFEST))  # type: ignore[arg-type]
        names = tar.getnames()
    assert manifest["runs"] == {cut.run_id: cut.cache_key()} and manifest["arch"] == "9.0"
    assert f"{cut.cache_key()}/triton/ABCD/_w4a16_kernel.cubin" in names
    assert f"{cut.cache_key()}/triton/ABCD/_w4a16_kernel.json" in names
    assert not [name for name in names if name.endswith((".ptx", ".llir", ".ttgir", ".ttir", ".source"))]
    assert not any(name.startswith(graded.cache_key()) for name in names)
    check = runner.invoke(cli, ["eval", "check-ahead", str(out)])
    assert check.exit_code == 0 and "1 Triton kernel variants, keyed as this host's" in check.output, check.output
    also = runner.invoke(cli, [*args, "--run", "b_graded", "--out", str(out)])  # --run adds one
    assert also.exit_code == 0 and "2 Triton kernel variants of 2 runs" in also.output, also.output


def test_an_archive_past_its_part_size_goes_in_parts_each_with_the_manifest_and_no_variant_split(
        tmp_path: Path) -> None:
    """A GPU call returns files of 16 MiB at most, and deepseek-v4-pro 02 125550's 1,081 variants kept whole did not
    come back: `_write_archive` starts a new part wherever the one it writes has reached its size, each part
    unpackable alone (the manifest first), a variant never split; a later, smaller archive removes the parts an
    earlier one left beyond its own."""
    from kernelboard.eval.ahead import _write_archive, archive_parts

    cache = tmp_path / "cache" / "abc123"
    for v in range(6):  # six variants of about 300 KB of incompressible bytes each
        variant = cache / "triton" / f"V{v}"
        variant.mkdir(parents=True)
        (variant / "k.cubin").write_bytes(os.urandom(300_000))
        (variant / "k.json").write_text(json.dumps({"name": f"k{v}"}))
    out = tmp_path / "kept" / "triton-kept.tgz"
    manifest = {"arch": "9.0", "fingerprint": {}, "runs": {"r": "abc123"}}
    parts = _write_archive(out, [cache], manifest, part_bytes=500_000)
    assert parts == archive_parts(out) and len(parts) >= 3 and parts[1].name == "triton-kept.2.tgz"
    variants: list[str] = []
    for part in parts:
        with tarfile.open(part) as tar:
            assert tar.getnames()[0] == MANIFEST and json.load(tar.extractfile(MANIFEST)) == manifest  # type: ignore[arg-type]
            files = [n for n in tar.getnames() if n.endswith((".cubin", ".json")) and n != MANIFEST]
        here = sorted({n.split("/")[2] for n in files})
        assert all(f"abc123/triton/{v}/k.cubin" in files and f"abc123/triton/{v}/k.json" in files for v in here)
        variants += here
    assert sorted(variants) == [f"V{v}" for v in range(6)]  # each variant whole, in one part
    assert not list(out.parent.glob(".*.part"))
    one = _write_archive(out, [cache], manifest)  # the default size holds them all: the old parts go
    assert one == [out] and archive_parts(out) == [out]


def test_compile_ahead_takes_the_runs_a_call_cut_off(tmp_path: Path) -> None:
    """`--interrupted RESULTS` selects the runs the results folder records as cut off by a call (MiniMax-M3's 02
    064019 compiled for 1,986 s here, longer than any GPU call): the recorded one is selected, the published
    kernel beside it is not (compiling it would say "1 of 1 … define Triton kernels"). A folder that records
    none refuses in one line rather than select every submission."""
    from kernelboard.eval.interrupted import add_interruption, write_records

    subs = tmp_path / "subs"
    shutil.copytree(PUBLISHED, subs / PUBLISHED.name)
    _beside(subs, "b_cut", REFERENCE)
    results = tmp_path / "res"
    (results / "h200").mkdir(parents=True)
    args = ["eval", "compile-ahead", "--deck", str(ROOT / "eval" / "decks" / "hard"), "--submissions", str(subs),
            "--interrupted", str(results), "--out", str(tmp_path / "ahead.tgz")]
    runner = CliRunner()
    empty = runner.invoke(cli, args)
    assert empty.exit_code == 2 and "records no run cut off by a call" in empty.output, empty.output
    assert "Traceback" not in empty.output and not (tmp_path / "ahead.tgz").exists()
    cut = next(s for s in discover(subs)[0] if s.run_id == "b_cut")
    write_records(results, "h200", add_interruption({}, cut.run_id, cut.solution_sha256(), 546.3, "correctness",
                                                    "2026-12-03T07:21:42+00:00"))
    taken = runner.invoke(cli, args)
    assert taken.exit_code == 0, taken.output
    assert "0 of 1 selected submissions define Triton kernels" in " ".join(taken.output.split()), taken.output
