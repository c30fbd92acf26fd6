"""The sandbox a candidate `train.py` runs in: bubblewrap, another identity, limits.

The candidate is hostile code. Everything it can reach it can change, and
everything it starts may outlive it unless something kills it. So the run
harness starts it through bubblewrap (`bwrap`, Debian's `bubblewrap`), the
sandbox Flatpak uses, with:

* new PID, network, IPC and UTS namespaces: it sees only its own processes,
  has only a loopback interface, and when its first process exits the kernel
  kills every process left in the namespace (`setsid`, double forks and
  daemons included). `--die-with-parent` ends it if the harness dies.
* a root filesystem built from nothing: read-only binds of the operating
  system (`/usr`, `/etc`, `/lib*`, `/bin`, `/sbin`, `/sys`) and the Python
  installation, a fresh `/proc` and a minimal `/dev` (plus the NVIDIA device
  nodes on a GPU slot), the harness read-only at `/harness`, and one writable
  directory, its scratch, at `/scratch` (cwd, `$HOME`, `$TMPDIR`, the export
  directory). The lab, its ledger, the data cache (the validation split),
  other runs, keys and home directories are simply not there.
* another identity: as root the harness drops the candidate to the dedicated
  uid/gid `SANDBOX_UID` with no capabilities and no-new-privs (`setpriv`);
  as an ordinary user bubblewrap puts it in a user namespace.
* resource limits (`setrlimit`, inherited through exec): processes, file
  size, open files, no core dumps, and address space on CPU-only runs (CUDA
  reserves far more address space than it uses, so GPU runs rely on the
  machine's or the container's memory limit instead).

The training data does not appear in the filesystem at all: the harness
streams it over a socket (see run.py), which is also how it times the run.

`available()` says whether this machine can sandbox; `command()` builds the
argv. Nothing here imports torch.
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

SANDBOX_UID = 61000  # the candidate's uid and gid when the harness runs as root; owns nothing else
SCRATCH = "/scratch"  # the candidate's only writable directory, as it sees it
HARNESS = "/harness"  # the pinned harness, read-only, as the candidate sees it
SYSTEM_DIRS = ("/usr", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/bin", "/sbin", "/sys", "/opt")
GIB = 2**30


@dataclass(frozen=True)
class Limits:
    """Per-run resource limits of the candidate's processes (all of them together for nproc)."""

    nproc: int = 4096  # processes and threads of the sandbox uid (torch starts a thread per core)
    fsize: int = 8 * GIB  # largest file it may write (the exported model of the default profile: ~0.2 GiB)
    nofile: int = 4096  # open file descriptors per process
    address_space: int | None = None  # bytes of virtual memory per process; CPU runs only


def bwrap() -> str | None:
    return shutil.which("bwrap")


def available() -> str | None:
    """None if candidates can be sandboxed here, else why not (a sentence with the fix)."""
    exe = bwrap()
    if not exe:
        return ("bubblewrap is not installed (Debian/Ubuntu: `apt-get install bubblewrap`); "
                "candidates cannot be isolated from the lab")
    probe = command(["/bin/true"], scratch=Path("/"), harness=None, gpu=False, probe=True)
    try:
        done = subprocess.run(probe, stdin=subprocess.DEVNULL, capture_output=True, timeout=20)
    except (OSError, subprocess.SubprocessError) as e:
        return f"bubblewrap does not start here ({e})"
    if done.returncode != 0:
        why = done.stderr.decode(errors="replace").strip().splitlines()
        return (f"bubblewrap cannot create namespaces here ({why[-1] if why else done.returncode}); "
                "run as root or enable unprivileged user namespaces")
    return None


def wants_gpu() -> bool:
    """Whether the run gets the NVIDIA devices: there are some, and CUDA_VISIBLE_DEVICES does not
    hide them all (the local backend sets it to "" for a CPU slot)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        return False
    return os.path.exists("/dev/nvidiactl")


def _python_dirs() -> list[Path]:
    """The Python installation the harness runs: prefixes and every directory on sys.path."""
    dirs = {Path(sys.prefix), Path(sys.base_prefix), Path(sys.executable).resolve().parent.parent}
    for entry in sys.path:
        p = Path(entry)
        if entry and p.is_dir() and p.resolve() != Path.cwd().resolve():
            dirs.add(p)
    # Keep only the outermost of nested directories; skip what the system binds already cover.
    out: list[Path] = []
    for d in sorted({d.resolve() for d in dirs}, key=lambda p: len(p.parts)):
        if any(d == Path(s) or Path(s) in d.parents for s in SYSTEM_DIRS):
            continue
        if not any(o == d or o in d.parents for o in out):
            out.append(d)
    return out


def _bind(args: list[str], source: Path, target: str, *, writable: bool = False) -> None:
    """Bind source at target, first creating its parents world-traversable (bwrap as root
    would make them 0700, which the dropped uid could not traverse)."""
    parent = Path(target).parent
    chain = []
    while str(parent) not in ("/", "."):
        chain.append(str(parent))
        parent = parent.parent
    for d in reversed(chain):
        args += ["--perms", "0755", "--dir", d]
    args += ["--bind" if writable else "--ro-bind", str(source), target]


def command(argv: list[str], *, scratch: Path, harness: Path | None, gpu: bool,
            probe: bool = False) -> list[str]:
    """The bwrap argv that runs `argv` in the sandbox (cwd /scratch)."""
    root = os.geteuid() == 0
    args = [bwrap() or "bwrap", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--die-with-parent", "--new-session"]
    if root:  # namespaces without a user namespace; keep only what setpriv needs to drop
        args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        args += ["--unshare-user", "--cap-drop", "ALL"]
    for d in SYSTEM_DIRS:
        if os.path.islink(d):
            args += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            args += ["--ro-bind", d, d]
    for d in _python_dirs():
        _bind(args, d, str(d))
    args += ["--proc", "/proc", "--dev", "/dev"]
    if gpu:
        for node in sorted(Path("/dev").glob("nvidia*")):
            if node.is_char_device():
                args += ["--dev-bind", str(node), str(node)]
            elif node.is_dir():  # /dev/nvidia-caps
                args += ["--dev-bind", str(node), str(node)]
    if harness is not None:
        args += ["--ro-bind", str(harness), HARNESS]
    if not probe:
        args += ["--bind", str(scratch), SCRATCH, "--chdir", SCRATCH]
    args.append("--")
    if root:
        setpriv = shutil.which("setpriv") or "/usr/bin/setpriv"
        args += [setpriv, f"--reuid={SANDBOX_UID}", f"--regid={SANDBOX_UID}", "--clear-groups",
                 "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]
    return args + argv


def prepare_scratch(scratch: Path) -> None:
    """Make the scratch directory the candidate's own (and nothing above it)."""
    scratch.mkdir(parents=True, exist_ok=True)
    for sub in ("export", "tmp"):
        (scratch / sub).mkdir(exist_ok=True)
    if os.geteuid() == 0:
        for p in (scratch, scratch / "export", scratch / "tmp", *scratch.glob("*.py")):
            os.chown(p, SANDBOX_UID, SANDBOX_UID)


def set_limits(limits: Limits) -> None:
    """Apply limits to this process (the sandbox's parent, between fork and exec)."""
    pairs = [(resource.RLIMIT_FSIZE, limits.fsize), (resource.RLIMIT_NOFILE, limits.nofile),
             (resource.RLIMIT_CORE, 0)]
    if os.geteuid() == 0:  # counted per uid: meaningful for the dedicated one only
        pairs.append((resource.RLIMIT_NPROC, limits.nproc))
    if limits.address_space:
        pairs.append((resource.RLIMIT_AS, limits.address_space))
    for what, value in pairs:
        soft, hard = resource.getrlimit(what)
        cap = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(what, (cap, cap))


def namespace_of(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def survivors(namespace: str | None) -> list[int]:
    """Pids of processes still living in the sandbox's PID namespace."""
    if not namespace:
        return []
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and entry != str(os.getpid()) and namespace_of(int(entry)) == namespace:
            found.append(int(entry))
    return found


if __name__ == "__main__":  # `python -I sandbox.py`: exit 0 if candidates can be sandboxed here
    problem = available()
    print(problem or "ok: candidates run in a bubblewrap sandbox")
    sys.exit(1 if problem else 0)
