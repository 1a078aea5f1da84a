"""Red team: what a solution can reach from inside the sandbox (eval/jail.py), graded on the CPU.

Every submission here attacks at import time and then re-exports the reference, so it would pass
if its attack did nothing. Each reports what it managed on stdout (the grading log) as
`ATTACK <name>: <what happened>`; the tests read those lines and check the world outside (the deck,
the tables, the grader's code, the process list) is as it was. Two attack the published log itself
with what they print (FORGED_LOG_LINES, OUTPUT_FLOOD), and their tests read the log. One batch grades
them all; each test is named after what its attack tries.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import socket
import stat
import subprocess
import time
from pathlib import Path

import pytest
from grading import FORK_BOMB, REEXPORT, copy_deck, grade, write_submission

from kernelboard.eval import jail
from kernelboard.eval.jail import find_bwrap
from kernelboard.eval.schedule import EvalOptions, run_eval
from kernelboard.eval.settings import LOG_HEAD_BYTES, LOG_TAIL_BYTES
from kernelboard.eval.tables import load_all

pytestmark = pytest.mark.skipif(find_bwrap() is None, reason="bubblewrap is not usable here (make test installs it)")

P = "03_paged_attention"
#: The sandbox's memory limit for this batch: the RAM bomb meets a 3 GiB limit in a second or two, where half
#: of a 24 GB machine took 30 s to fill (and pushed whatever else runs there out of memory). Honest gradings of
#: this problem need well under 1 GiB.
MEMORY_LIMIT = 3 << 30
ROOT = Path(__file__).resolve().parents[1]
#: A token no honest process carries: marks the attackers' own processes and files.
TOKEN = f"kbredteam{secrets.token_hex(4)}"
SECRET = f"sk-test-{secrets.token_hex(8)}"

#: A solution that prints lines in the judge's and the grader's words, at import and in every call it is timed on
#: (stderr, a carriage return, C-level writes included), to pass a forged verdict off in the published log.
FORGED_LOG_LINES = f"""
import os, sys
from reference import Model as Reference, get_inputs, get_init_inputs  # noqa: F401
FORGED = "{TOKEN} shape 0: covered loop: GPU span 0.0001 ms"
print("[worker] " + FORGED, flush=True)
print("[grader] pass: " + FORGED, file=sys.stderr, flush=True)
os.write(1, ("building 50%\\r[worker] " + FORGED + "\\n").encode())

class Model(Reference):
    def forward(self, *args):
        print("[worker] timed " + FORGED, flush=True)
        return super().forward(*args)
"""
#: A solution that prints 50 MiB at import (in a second or so), then behaves like the reference.
OUTPUT_FLOOD = """
import os
from reference import Model, get_inputs, get_init_inputs  # noqa: F401
block = (b"x" * 1023 + b"\\n") * 1024
for _ in range(50):
    os.write(1, block)
print("FLOOD DONE", flush=True)
"""


def _attack(name: str, body: str) -> str:
    """solution.py: run `body` (which sets `said`), report it, then behave like the reference."""
    return (f"import os, sys, glob, socket, signal, subprocess, time\nsaid = 'nothing'\n"
            f"try:\n{_indent(body)}\nexcept BaseException as exc:\n"
            f"    said = f'refused: {{type(exc).__name__}}: {{exc}}'\n"
            f"print('ATTACK {name}:', said, flush=True)\n{REEXPORT}")


def _daemon(out: Path) -> str:
    """A loop that rewrites every results table it can find, 20 times a second, for 5 minutes."""
    return (f"import glob, time\nfor _ in range(6000):\n    for t in glob.glob('{out}/*/results.parquet'):\n"
            "        try:\n            open(t, 'w').write('forged')\n        except OSError:\n            pass\n"
            "    time.sleep(0.05)\n")


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.strip("\n").splitlines())


@pytest.fixture(scope="module")
def world(tmp_path_factory, measured_baselines):
    """The batch, graded once, with the paths an attacker is told about and a listener on loopback."""
    root = tmp_path_factory.mktemp("redteam")
    out, subs, deck = root / "out", root / "subs", root / "deck"
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    package = ROOT / "eval" / "judge.py"
    cache_root = Path(os.environ.get("KERNELBOARD_CACHE", Path.home() / ".cache" / "kernelboard"))
    attacks = {
        "daemon": f"""
code = {_daemon(out)!r}
pid = os.fork()
if pid == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, ['{TOKEN}', '-c', code])
    os._exit(0)
os.waitpid(pid, 0)
said = 'started a setsid daemon'
""",
        "deck_edit": f"""
done = []
for path in ['{deck}/{P}/problem.yaml', '{ROOT}/eval/decks/hard/{P}/problem.yaml']:
    try:
        with open(path, 'a') as fh:
            fh.write('\\n# tolerance: 1e9\\n')
        done.append(path)
    except OSError as exc:
        done.append(f'{{path}}: {{exc.strerror}}')
said = '; '.join(done)
""",
        "judge_proc": """
seen = []
for pid in os.listdir('/proc'):
    if pid.isdigit():
        try:
            seen.append(pid + '=' + open(f'/proc/{pid}/cmdline', 'rb').read().replace(b'\\0', b' ').decode()[:60])
        except OSError:
            pass
mem = 'unreadable'
try:
    open(f'/proc/{os.getppid()}/mem', 'rb').read(1)
    mem = 'readable'
except OSError:
    pass
said = f'processes visible: {len(seen)} {seen}; parent mem {mem}; jobs {glob.glob("/tmp/*/*.job.json")}'
""",
        "secrets": """
said = 'environment: ' + ' '.join(f'{k}={v}' for k, v in sorted(os.environ.items()))
""",
        "submissions": f"""
said = f'other submissions: {{sorted(glob.glob("{subs}/*"))}} data: {{sorted(glob.glob("{ROOT}/data/*"))}}'
""",
        "network": f"""
got = []
for host, port in (('1.1.1.1', 53), ('127.0.0.1', {port})):
    s = socket.socket()
    s.settimeout(2)
    got.append(f'{{host}}:{{port}}=' + ('connected' if s.connect_ex((host, port)) == 0 else 'unreachable'))
said = ' '.join(got)
""",
        "signals": """
hit = []
mine = {int(t) for t in os.listdir('/proc/self/task')}  # its own threads: stopping one stops itself
for pid in range(1, 70000):
    if pid not in mine:
        try:
            os.kill(pid, signal.SIGSTOP)
            hit.append(pid)
        except (ProcessLookupError, PermissionError):
            pass
        except OSError:
            pass
for pid in hit:
    try:
        os.kill(pid, signal.SIGCONT)
    except OSError:
        pass
said = f'could signal {len(hit)} processes: {hit[:10]}'
""",
        "tables": f"""
done = []
for path in glob.glob('{out}/*/*.parquet') + ['{out}/cpu/runs.parquet']:
    try:
        open(path, 'wb').write(b'garbage')
        done.append('overwrote ' + path)
    except OSError as exc:
        done.append(f'{{path}}: {{exc.strerror}}')
said = '; '.join(done)
""",
        "grader_code": f"""
done = []
for path in ['{package}', '{package.parent}/{TOKEN}.py', '/usr/{TOKEN}', '/etc/{TOKEN}', '{cache_root}/{TOKEN}/x']:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        open(path, 'a').write('# owned by {TOKEN}\\n')
        done.append('wrote ' + path)
    except OSError as exc:
        done.append(f'{{path}}: {{exc.strerror}}')
said = '; '.join(done)
""",
        "fork_bomb": FORK_BOMB,
        "privileges": """
caps = [line.split()[1] for line in open('/proc/self/status') if line.startswith('CapEff')][0]
try:
    os.setuid(0)
    became = 'setuid(0) worked'
except OSError as exc:
    became = f'setuid(0) refused: {exc.strerror}'
said = f'uid {os.getuid()} euid {os.geteuid()} CapEff {caps}; {became}'
""",
        "root_only_file": """
try:
    said = f'read {len(open("/etc/shadow", "rb").read())} bytes of /etc/shadow'
except OSError as exc:
    said = f'/etc/shadow: {exc.strerror}'
""",
        "ram_bomb": """
hoard = []
try:
    for _ in range(4096):
        hoard.append(b'\\x01' * (64 << 20))
    said = f'allocated {len(hoard) * 64} MiB'
except MemoryError:
    said = f'MemoryError after {len(hoard) * 64} MiB'
del hoard
""",
        "big_file": """
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
with open('big.bin', 'wb') as fh:
    fh.seek(16 << 30)
    try:
        fh.write(b'x')
        said = 'wrote a 16 GiB file'
    except OSError as exc:
        said = f'refused: {exc.strerror}'
os.remove('big.bin')
""",
    }
    submissions = {f"attack_{name}": (P, _attack(name, body)) for name, body in attacks.items()}
    submissions["attack_forged_log_lines"] = (P, FORGED_LOG_LINES)
    submissions["attack_output_flood"] = (P, OUTPUT_FLOOD)
    submissions["honest"] = (P, REEXPORT)
    before = {"deck": (ROOT / "eval" / "decks" / "hard" / P / "problem.yaml").read_bytes()}
    os.environ["KB_REDTEAM_SECRET"] = SECRET
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(jail, "MEMORY_SHARE", min(jail.MEMORY_SHARE, MEMORY_LIMIT / ram))
            rows = grade(root, [P], submissions, measured_baselines, timeout_s=180.0)
    finally:
        os.environ.pop("KB_REDTEAM_SECRET", None)
    logs = {run: (out / "cpu" / "logs" / f"{run}.log").read_text(errors="replace") for run in submissions}
    said = {run: _said(text) for run, text in logs.items()}
    yield {"root": root, "out": out, "deck": deck, "rows": rows, "logs": logs, "said": said, "before": before,
           "package": package, "listener": listener}
    listener.close()


def _said(log: str) -> str:
    found = re.findall(r"^ATTACK \w+: (.*)$", log, re.MULTILINE)
    return found[0] if found else "(no report)"


def test_the_honest_control_still_passes(world) -> None:
    assert world["rows"]["honest"]["status"] == "pass"
    assert "bubblewrap" in (world["rows"]["honest"]["sandbox"] or "")


def test_a_setsid_daemon_does_not_outlive_grading(world) -> None:
    time.sleep(1.0)  # it would rewrite files every 50 ms
    alive = subprocess.run(["pgrep", "-f", TOKEN], capture_output=True, text=True).stdout.split()
    assert alive == [], f"processes of the attack still alive: {alive}"
    tables = load_all(world["out"])  # every table still reads and validates
    assert {r["run_id"] for r in tables["results"].to_pylist()} >= {"honest", "attack_daemon"}


def test_the_deck_on_disk_cannot_be_edited(world) -> None:
    assert (ROOT / "eval" / "decks" / "hard" / P / "problem.yaml").read_bytes() == world["before"]["deck"]
    assert "tolerance: 1e9" not in (world["deck"] / P / "problem.yaml").read_text()
    said = world["said"]["attack_deck_edit"]
    tries = dict(part.rsplit(": ", 1) for part in said.split("; "))
    assert set(tries.values()) == {"No such file or directory"}, f"a deck is visible to the candidate: {said}"


def test_the_judge_and_other_processes_are_invisible(world) -> None:
    said = world["said"]["attack_judge_proc"]
    visible = int(re.search(r"processes visible: (\d+)", said).group(1))
    assert visible <= 4, said  # bwrap's init, the runner, maybe its shell: nothing of ours
    assert "kernelboard.eval.worker" not in said and "parent mem unreadable" in said and "jobs []" in said


def test_the_graders_environment_does_not_reach_the_candidate(world) -> None:
    assert SECRET not in world["logs"]["attack_secrets"]
    assert "KB_REDTEAM_SECRET" not in world["said"]["attack_secrets"]
    assert "HOME=/tmp" in world["said"]["attack_secrets"]


def test_other_submissions_and_data_are_invisible(world) -> None:
    assert world["said"]["attack_submissions"] == "other submissions: [] data: []"


def test_there_is_no_network_not_even_the_hosts_loopback(world) -> None:
    said = world["said"]["attack_network"]
    assert "connected" not in said.replace("unreachable", ""), said


def test_the_scheduler_cannot_be_signalled(world) -> None:
    said = world["said"]["attack_signals"]
    assert int(re.search(r"could signal (\d+)", said).group(1)) <= 3, said  # its own namespace only
    assert world["rows"]["honest"]["status"] == "pass"  # graded after it: the batch went on


def test_the_results_tables_cannot_be_overwritten_mid_batch(world) -> None:
    assert "overwrote" not in world["said"]["attack_tables"]
    load_all(world["out"])


def test_the_graders_code_and_other_caches_are_not_writable(world) -> None:
    assert TOKEN not in world["package"].read_text()
    cache_root = Path(os.environ.get("KERNELBOARD_CACHE", Path.home() / ".cache" / "kernelboard"))
    package_dir = world["package"].parent
    for path in (Path("/usr") / TOKEN, Path("/etc") / TOKEN, cache_root / TOKEN, package_dir / f"{TOKEN}.py"):
        assert not path.exists(), f"the attack wrote {path} on the host: {world['said']['attack_grader_code']}"
    assert "Read-only file system" in world["said"]["attack_grader_code"]


def test_a_fork_bomb_is_stopped_by_the_process_limit(world) -> None:
    said = world["said"]["attack_fork_bomb"]
    assert said.startswith("fork refused after"), said
    assert world["rows"]["attack_fork_bomb"]["status"] in ("pass", "runtime_error", "timeout")


def test_candidate_code_holds_no_capability_and_cannot_become_root(world) -> None:
    """A root grader's sandbox drops root (jail.sandbox_uid): root is exempt from RLIMIT_NPROC, and its
    capabilities reach every root-owned file the sandbox shows. Any grader's: no capability at all."""
    said = world["said"]["attack_privileges"]
    uid = int(re.search(r"uid (\d+) euid (\d+)", said).group(1))
    assert "CapEff 0000000000000000" in said and "setuid(0) refused" in said, said
    if os.getuid() == 0:
        assert uid >= jail.SANDBOX_UID_BASE, said
        assert f"runs as uid {uid}, not root" in world["rows"]["attack_privileges"]["sandbox"]


@pytest.mark.skipif(not Path("/etc/shadow").exists() or Path("/etc/shadow").stat().st_mode & 0o004,
                    reason="no root-only /etc/shadow here")
def test_root_only_files_of_the_shown_system_stay_closed(world) -> None:
    """/etc is shown read-only; its root-only files must stay unreadable. Until grader 0.5.20 a root grader's
    sandbox ran candidate code as root in a user namespace that mapped root, with every capability there:
    it read /etc/shadow (checked on a CPU host with the same bwrap command line)."""
    assert world["said"]["attack_root_only_file"] == "/etc/shadow: Permission denied", world["said"]


def test_a_fork_bomb_is_stopped_where_no_cgroup_can_be_made(tmp_path: Path, monkeypatch) -> None:
    """As on the GPU hosts, whose grader is root in a container that makes no cgroup: only RLIMIT_NPROC is
    left, which the kernel does not apply to root, so the tree must run as a uid of its own."""
    monkeypatch.setattr(jail, "make_cgroup", lambda memory_bytes: None)
    cell = jail.make_jail(sandboxed=True, device="cpu", hide=[])
    bomb = f"import os, time\n{FORK_BOMB}\nprint(said)"
    confined = jail.start(cell, ["python3", "-c", bomb], writable=[tmp_path], cwd=tmp_path, env=dict(os.environ),
                          device="cpu", owner=f"bomb-{TOKEN}", stdout=subprocess.PIPE)
    try:
        said = confined.proc.communicate(timeout=120)[0].decode()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(confined.proc.pid, 9)
    assert said.startswith("fork refused after"), said
    assert int(said.split()[3]) <= jail.MAX_PROCESSES, said
    assert "RLIMIT_NPROC" in confined.description and "unlimited" not in confined.description


@pytest.mark.skipif(os.getuid() != 0, reason="only a root grader drops root")
def test_the_gpu_hosts_device_folder_does_not_keep_the_sandbox_root(tmp_path: Path, capfd) -> None:
    """On the H100, `/dev/nvidia*` names /dev/nvidia-caps, a folder (0755), beside device nodes open to all
    (0666): grader 0.5.20's first GPU calls read the folder's mode as a closed device and kept root. Only
    device nodes count; one closed to other users keeps root, and says so."""
    caps = tmp_path / "nvidia-caps"
    caps.mkdir(mode=0o755)
    cell = jail.make_jail(sandboxed=True, device="cpu", hide=[])
    assert jail._root_drop(cell.readonly, cell.hidden, ("/dev/null", str(caps))) is not None
    closed = tmp_path / "nvidia9"
    try:
        os.mknod(closed, 0o660 | stat.S_IFCHR, os.makedev(1, 3))
    except OSError:
        pytest.skip("mknod is not allowed here")
    assert jail._root_drop(cell.readonly, cell.hidden, ("/dev/null", str(closed))) is None
    assert f"keeps root's uid: {closed} not open to other users" in capfd.readouterr().err


@pytest.mark.skipif(os.getuid() != 0, reason="only a root grader hands folders over (jail.hand_over)")
def test_links_in_its_folder_do_not_hand_the_hosts_files_over(tmp_path: Path) -> None:
    """Before a tree that drops root starts, root makes its folders the tree's uid's: a hard link or a
    symbolic link the candidate left there (its prebuild ran first) must not make a file of ours its own."""
    host = tmp_path / "host"
    host.mkdir()
    (host / "hard.txt").write_text("ours\n")
    (host / "soft.txt").write_text("ours\n")
    mine = tmp_path / "scratch"
    (mine / "sub").mkdir(parents=True)
    (mine / "sub" / "own.py").write_text("# the candidate's\n")
    os.link(host / "hard.txt", mine / "hard-link")
    os.symlink(host / "soft.txt", mine / "sub" / "soft-link")
    os.symlink(host, mine / "folder-link")
    uid = jail.sandbox_uid(TOKEN)
    jail.hand_over(mine, uid)
    assert {(host / n).stat().st_uid for n in ("hard.txt", "soft.txt")} == {0} and host.stat().st_uid == 0
    assert (mine / "sub" / "own.py").stat().st_uid == uid and (mine / "sub").stat().st_uid == uid
    assert (mine / "sub" / "soft-link").lstat().st_uid == uid  # the link itself, which is the candidate's


def test_a_ram_bomb_is_stopped_by_the_memory_limit(world) -> None:
    said = world["said"]["attack_ram_bomb"]
    row = world["rows"]["attack_ram_bomb"]
    assert f"memory ≤ {MEMORY_LIMIT >> 30} GiB" in (row["sandbox"] or ""), row["sandbox"]  # the lowered limit held
    assert said.startswith("MemoryError") or row["status"] in ("oom", "runtime_error"), (said, row["message"])


def test_a_huge_file_is_refused_by_the_file_size_limit(world) -> None:
    assert "File too large" in world["said"]["attack_big_file"], world["said"]["attack_big_file"]


def test_lines_printed_in_the_judges_or_the_graders_words_are_marked_in_the_published_log(world) -> None:
    """Until 0.5.22 the runner wrote into the judge's log itself: `[worker] …` from a solution read as the judge's."""
    row = world["rows"]["attack_forged_log_lines"]
    assert row["status"] == "pass", row["message"]  # printing is no failure
    lines = (world["out"] / row["log_path"]).read_text(errors="replace").splitlines()  # every break a reader sees
    forged = [line for line in lines if TOKEN in line]
    assert [line for line in forged if not line.startswith("[runner printed] ")] == [], forged[:5]
    said = {line.removeprefix("[runner printed] ").split(TOKEN)[0] for line in forged}
    assert said == {"[worker] ", "[grader] pass: ", "[worker] timed "}, said  # at import, and in the timed calls
    assert "building 50%" in lines


def test_a_flood_of_output_leaves_the_logs_head_and_tail_and_its_verdict(world) -> None:
    """Until 0.5.22 only the sandbox's file-size limit (8 GiB) bounded what a solution printed into its log."""
    row = world["rows"]["attack_output_flood"]
    assert row["status"] == "pass", row["message"]  # the flood is no failure
    log = world["out"] / row["log_path"]
    text = log.read_text(errors="replace")
    counted = re.search(r"^\[worker\] the runner printed ([\d,]+) bytes \(([\d,]+) lines\) beyond the 1 MiB of its "
                        r"output this log holds above; the last [\d,]+ of those lines follow:$", text, re.MULTILINE)
    assert counted is not None, text[-2000:]
    assert int(counted[1].replace(",", "")) >= 49 << 20 and int(counted[2].replace(",", "")) >= 49 << 10
    assert "FLOOD DONE" in text.split(counted[0])[1]  # in the kept tail
    assert log.stat().st_size <= LOG_HEAD_BYTES + LOG_TAIL_BYTES + (32 << 10)  # and the judge's own lines


def test_a_link_its_prebuild_left_does_not_carry_the_graders_writes_outside(tmp_path: Path,
                                                                            measured_baselines) -> None:
    """Its prebuild runs its code in the copy its grading then takes over (grader 0.5.10, schedule.graded_copy),
    and the grader writes the published files back there: the attack swaps its own published helper.py
    for a link to a file of the host's, for that write to go through. Every link goes first."""
    victim = tmp_path / "victim.txt"
    victim.write_text("the host's file\n")
    body = f"""
helper = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'helper.py')
said = 'a link' if os.path.islink(helper) else 'a plain file: ' + open(helper).read().strip()
os.remove(helper)
os.symlink('{victim}', helper)
said += '; swapped it for a link'
"""
    subs, out = tmp_path / "subs", tmp_path / "out"
    write_submission(subs / "attack_relink", P, _attack("relink", body))
    (subs / "attack_relink" / "helper.py").write_text("# published helper\n")
    measured_baselines.copy_into(out, [P], 20.0)
    rows = run_eval(EvalOptions(deck=copy_deck(tmp_path, [P]), submissions=subs, out=out, device="cpu",
                                rep_ms=20.0, prebuild=True))
    logs = out / "cpu" / "logs"
    said = "ATTACK relink: a plain file: # published helper; swapped it for a link"
    assert said in (logs / "attack_relink.prebuild.log").read_text()  # its prebuild made the link
    assert said in (logs / "attack_relink.log").read_text()  # and its grading found the published file
    assert victim.read_text() == "the host's file\n"
    assert rows[0]["status"] == "pass", rows[0]["message"]
