"""uid mode: another uid, no namespaces (`--sandbox uid`).

For a container where the harness is root but namespaces cannot be made (a Hugging Face job).
The candidate runs as the dedicated uid `sandbox.SANDBOX_UID` through `setpriv` (no
capabilities, no-new-privs, no supplementary groups), in a scratch directory it owns under
/tmp, with the same resource limits and the same data stream as under bubblewrap. Before it
starts, a probe process running as that uid must fail to read the harness (every file its
manifest lists), the data cache and the validation split (root-owned, 0700/0600) and must be
able to write its scratch directory; otherwise the run is refused (`SandboxUnavailable`). It
imports its own copy of prepare.py and its siblings (prepare.FILES). When it exits, every process of that uid is killed:
kill(-1, SIGKILL) sent by a process running as that uid, then a /proc scan (`ProcessesLeft` if
any survives). No process of the uid may exist before the run starts.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import prepare  # the trusted one, next to this file: its FILES are what the candidate imports
import sandbox  # the trusted one, next to this file
from harness_common import BENCH_DIR, Outcome, kill_until_gone


UID_ENV = "AUTOLAB_SANDBOX_UID"  # uid mode's uid, if not sandbox.SANDBOX_UID (tests pick their own)
UID_SCRATCH_ROOT = "/tmp"  # uid mode's scratch directories: a place every uid can traverse


def sandbox_uid() -> int:
    """The uid (and gid) uid mode runs the candidate as."""
    value = os.environ.get(UID_ENV)
    uid = int(value) if value and value.isdigit() else sandbox.SANDBOX_UID
    return uid if uid > 0 else sandbox.SANDBOX_UID


def uid_mode_problem() -> str | None:
    """None if uid mode can work here, else why not."""
    if os.geteuid() != 0:
        return "the harness does not run as root, so it cannot run the candidate under another uid"
    if not (shutil.which("setpriv") or os.path.exists("/usr/bin/setpriv")):
        return "setpriv (util-linux) is not installed"
    return None


def _as_uid(uid: int, argv: list[str]) -> list[str]:
    """argv run as uid/gid `uid`: no supplementary groups, no capabilities, no-new-privs."""
    setpriv = shutil.which("setpriv") or "/usr/bin/setpriv"
    return [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all",
            "--bounding-set=-all", "--no-new-privs", "--", *argv]


def uid_processes(uid: int) -> list[int]:
    """Pids of the living processes (zombies aside) with uid among their real, effective, saved
    or filesystem uids."""
    found = []
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if fields.get("State", "").strip().startswith(("Z", "X")):
            continue
        if str(uid) in fields.get("Uid", "").split():
            found.append(int(entry))
    return found


_PROBE = """
import json, os, sys
hidden, scratch = json.loads(sys.argv[1]), sys.argv[2]
out = {"readable": [], "scratch": False}
for p in hidden:
    try:
        os.close(os.open(p, os.O_RDONLY | os.O_NONBLOCK))
        out["readable"].append(p)
    except OSError:
        pass
try:
    t = os.path.join(scratch, ".autolab-probe")
    os.close(os.open(t, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    os.unlink(t)
    out["scratch"] = True
except OSError:
    pass
print(json.dumps(out))
"""


def _uid_preflight(uid: int, scratch: Path, hidden: list[Path]) -> None:
    """Refuse (SandboxUnavailable) unless uid can run Python, write its scratch directory and
    read none of `hidden`; and unless no process of uid is alive already."""
    already = uid_processes(uid)
    if already:
        raise Outcome("error", "SandboxUnavailable",
                      f"{len(already)} process(es) of uid {uid} are running already (another run, or "
                      "something left over); uid mode kills every process of its uid, so it will not start")
    paths = []
    for p in hidden:
        for q in (str(p), os.path.realpath(p)):
            if q not in paths and os.path.exists(q):
                paths.append(q)
    try:
        done = subprocess.run(_as_uid(uid, [sys.executable, "-I", "-S", "-c", _PROBE, json.dumps(paths),
                                            str(scratch)]),
                              cwd=scratch, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
                              stdin=subprocess.DEVNULL, capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        raise Outcome("error", "SandboxUnavailable", f"cannot start a process as uid {uid}: {e}") from e
    try:
        probe = json.loads(done.stdout.decode().strip().splitlines()[-1])
    except (ValueError, IndexError):
        why = done.stderr.decode(errors="replace").strip().splitlines()
        raise Outcome("error", "SandboxUnavailable",
                      f"uid {uid} cannot run the Python interpreter {sys.executable} "
                      f"({why[-1] if why else f'exit code {done.returncode}'}); the Python installation "
                      "must be readable by every user") from None
    if probe.get("readable"):
        raise Outcome("error", "SandboxUnavailable",
                      f"uid {uid} could read {', '.join(probe['readable'])}: the harness, the data cache and the "
                      "validation split must not be readable by the candidate (root-owned, mode 0700/0600)")
    if not probe.get("scratch"):
        raise Outcome("error", "SandboxUnavailable", f"uid {uid} cannot write its scratch directory {scratch}")


def _uid_workspace(run_dir: Path, scratch: Path, uid: int) -> Path:
    """Make run_dir traversable (not listable), scratch the uid's own; return the directory of
    the candidate's own copy of prepare.py (the module train.py imports) and its siblings."""
    os.chmod(run_dir, 0o711)
    lib = run_dir / "lib"
    lib.mkdir(exist_ok=True)
    for name in prepare.FILES:
        shutil.copyfile(BENCH_DIR / name, lib / name)
        os.chmod(lib / name, 0o644)
    os.chmod(lib, 0o755)
    for sub in ("export", "tmp"):
        (scratch / sub).mkdir(exist_ok=True)
    for p in (scratch, scratch / "export", scratch / "tmp", *scratch.glob("*.py")):
        os.chown(p, uid, uid)
    os.chmod(scratch, 0o700)
    return lib


def sweep_uid(uid: int) -> tuple[int, list[int]]:
    """Kill every process of uid: kill(-1, SIGKILL) from a process running as uid (the kernel
    signals them all at once, forks included), then SIGKILL to whatever a /proc scan still
    finds. Returns (how many there were, the pids still alive after all that)."""
    before = uid_processes(uid)
    pid = os.fork()
    if pid == 0:  # as uid: kill(-1) reaches exactly the processes of this uid, not this one
        try:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            os.kill(-1, signal.SIGKILL)
        except BaseException:
            pass
        os._exit(0)
    os.waitpid(pid, 0)
    return len(before), kill_until_gone(lambda: uid_processes(uid), 2.0)


def _run_dir(mode: str) -> Path:
    # uid mode: the candidate must traverse to its scratch directory, so not under a private $TMPDIR.
    return Path(tempfile.mkdtemp(prefix="autolab-run-", dir=UID_SCRATCH_ROOT if mode == "uid" else None))
