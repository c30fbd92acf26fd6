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
* a syscall filter (seccomp, inherited through exec and never removable):
  no socket but a Unix one, so no network even where the sandbox shares one
  (uid mode in a Hugging Face job, the train container of a Kubernetes Pod,
  which has the Pod's network); no ptrace, no reading or writing another
  process's memory, no taking its file descriptors (`pidfd_getfd`), no
  io_uring (which can open sockets past the filter), no kernel keyring (a
  uid's keyring outlives its processes: a key left there by one run would be
  there for the next run of that uid, which could count its runs by it).
  Each is refused with EPERM. bubblewrap loads it (`--seccomp`) after it has made its namespaces;
  the other modes load it between fork and exec (`confine`).

The training data does not appear in the filesystem at all: the harness
streams it over a socket (see run.py), which is also how it times the run.

Fitness, checked before the candidate runs, never inferred from its death.
A sandbox can start and still be unfit: its uid cannot read the Python
installation (a clone under a 0700 directory such as /root or `mktemp -d`, an
image whose Python is root's alone), torch is missing from the interpreter, or
the GPU the run was given is not usable inside. The candidate would then die
with `ModuleNotFoundError` and be blamed for the machine's fault. So the
candidate is started through `FITNESS_BOOT`, a few trusted lines that run
first, in the sandbox, as its uid: they import what the benchmark needs
(`BENCHMARK_NEEDS`, and CUDA on a GPU run), report the outcome on a pipe of
the harness's (`fitness_pipe`, `read_fitness`) and close it, and only then run
`train.py` in the same process (no second interpreter, no second torch
import: the check costs nothing). No candidate code has run when the report
is written, so nothing it does can forge it. No report, or an unfit one, is
the harness's `SandboxUnavailable`: an error, never a verdict on the
candidate. `python -I sandbox.py` runs the same check once, up front.
`python -I sandbox.py --quick` is what `autolab run` asks before it starts
anything: the interpreter starts in the sandbox as its uid and finds and reads
each module's file without importing it (a tenth of a second instead of a
torch import). It catches an installation the uid cannot read, not a torch
that is broken inside; each run's boot still checks that, before its candidate.

`available()` says whether this machine can sandbox; `command()` builds the
argv; `fitness_problem()` says whether the sandbox can run the benchmark.
Nothing here imports torch.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
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


# --- the syscall filter ----------------------------------------------------------------------
#
# A classic BPF program over `struct seccomp_data` (nr at byte 0, arch at 4, args[0] at 16, its
# low 32 bits first on the little-endian machines below). Written out here rather than through
# libseccomp: it is eight rules, and the harness stays free of native dependencies.
SECCOMP_DATA_NR, SECCOMP_DATA_ARCH, SECCOMP_DATA_ARG0 = 0, 4, 16
BPF_LD_W_ABS, BPF_JEQ_K, BPF_JGE_K, BPF_RET_K = 0x20, 0x15, 0x35, 0x06
SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO = 0x7FFF0000, 0x00050000
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
X32_SYSCALL_BIT = 0x40000000  # x86_64's x32 ABI: the same calls under other numbers
# The machines the filter knows: audit arch, then the numbers of the calls it refuses.
SYSCALLS = {
    "x86_64": (0xC000003E, {"socket": 41, "ptrace": 101, "process_vm_readv": 310,
                            "process_vm_writev": 311, "io_uring_setup": 425, "io_uring_enter": 426,
                            "io_uring_register": 427, "pidfd_getfd": 438, "add_key": 248,
                            "request_key": 249, "keyctl": 250}),
    "aarch64": (0xC00000B7, {"socket": 198, "ptrace": 117, "process_vm_readv": 270,
                             "process_vm_writev": 271, "io_uring_setup": 425, "io_uring_enter": 426,
                             "io_uring_register": 427, "pidfd_getfd": 438, "add_key": 217,
                             "request_key": 218, "keyctl": 219}),
}


def syscall_filter(machine: str | None = None) -> bytes:
    """The candidate's seccomp program (an array of `struct sock_filter`, as bwrap's `--seccomp`
    and PR_SET_SECCOMP take it): every call allowed but `socket` of another family than AF_UNIX
    and the calls in SYSCALLS, which fail with EPERM. A call made through another ABI (32-bit
    `int 0x80`, x32) is refused whole: the numbers below would not name it.

    Raises RuntimeError on a machine it has no syscall numbers for: a candidate is not run
    unfiltered."""
    machine = machine or platform.machine()
    if machine not in SYSCALLS:
        raise RuntimeError(f"no syscall filter for {machine} (known: {', '.join(SYSCALLS)}); "
                           "candidates cannot be kept off the network here")
    arch, nrs = SYSCALLS[machine]
    refused = [nr for name, nr in nrs.items() if name != "socket"]
    # (code, jump-if-true, jump-if-false, k); jumps name a label, None is the next instruction
    prog: list[tuple[int, str | None, str | None, int]] = [
        (BPF_LD_W_ABS, None, None, SECCOMP_DATA_ARCH),
        (BPF_JEQ_K, None, "deny", arch),
        (BPF_LD_W_ABS, None, None, SECCOMP_DATA_NR),
    ]
    if machine == "x86_64":
        prog.append((BPF_JGE_K, "deny", None, X32_SYSCALL_BIT))
    prog.append((BPF_JEQ_K, "socket", None, nrs["socket"]))
    prog += [(BPF_JEQ_K, "deny", None, nr) for nr in refused]
    prog.append((BPF_RET_K, None, None, SECCOMP_RET_ALLOW))
    labels = {"socket": len(prog)}
    prog += [(BPF_LD_W_ABS, None, None, SECCOMP_DATA_ARG0),
             (BPF_JEQ_K, None, "deny", 1),  # AF_UNIX
             (BPF_RET_K, None, None, SECCOMP_RET_ALLOW)]
    labels["deny"] = len(prog)
    prog.append((BPF_RET_K, None, None, SECCOMP_RET_ERRNO | errno.EPERM))
    out = b""
    for i, (code, jt, jf, k) in enumerate(prog):
        hop = [0 if j is None else labels[j] - i - 1 for j in (jt, jf)]
        assert all(0 <= h < 256 for h in hop)  # classic BPF jumps only forward, at most 255
        out += code.to_bytes(2, "little") + bytes(hop) + k.to_bytes(4, "little")
    return out


def filter_fd() -> int:
    """A pipe's read end holding syscall_filter(), for bwrap's `--seccomp FD` (the caller passes
    it to bwrap and closes it)."""
    prog = syscall_filter()
    r, w = os.pipe()
    os.write(w, prog)  # a few hundred bytes: well inside a pipe's buffer
    os.close(w)
    return r


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


class Confinement:
    """The filter, ready to load between fork and exec (`apply`), when no bwrap loads it.

    Everything that allocates or loads a library happens here in the parent, so the forked
    child only makes two prctl calls."""

    def __init__(self) -> None:
        self._prog = ctypes.create_string_buffer(syscall_filter())
        self._fprog = _SockFprog(len(self._prog.raw) // 8, ctypes.addressof(self._prog))
        self._prctl = ctypes.CDLL(None, use_errno=True).prctl

    def apply(self) -> None:
        """no-new-privs (the kernel's condition for an unprivileged filter), then the filter.
        Raises OSError if either is refused: the candidate then does not start."""
        if self._prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS refused")
        if self._prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(self._fprog), 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "seccomp filter refused")


def not_dumpable() -> None:
    """No /proc/<pid>/mem, fd or environ of this process, and no ptrace of it, for a process
    without CAP_SYS_PTRACE (PR_SET_DUMPABLE 0), though it has this process's uid.

    The harness of a Kubernetes train container shares its uid with the candidate and has the
    Pod's network: writing into the harness's memory would be a way around the filter."""
    if ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE, 0
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")


def bwrap() -> str | None:
    return shutil.which("bwrap")


def available() -> str | None:
    """None if candidates can be sandboxed here, else why not (a sentence with the fix)."""
    exe = bwrap()
    if not exe:
        return ("bubblewrap is not installed (Debian/Ubuntu: `apt-get install bubblewrap`); "
                "candidates cannot be isolated from the lab")
    try:
        fd = filter_fd()
    except RuntimeError as e:
        return str(e)
    probe = command(["/bin/true"], scratch=Path("/"), harness=None, gpu=False, seccomp_fd=fd,
                    probe=True)
    try:
        done = subprocess.run(probe, stdin=subprocess.DEVNULL, capture_output=True, timeout=20,
                              pass_fds=(fd,))
    except (OSError, subprocess.SubprocessError) as e:
        return f"bubblewrap does not start here ({e})"
    finally:
        os.close(fd)
    if done.returncode != 0:
        why = done.stderr.decode(errors="replace").strip().splitlines()
        return (f"bubblewrap cannot create namespaces here ({why[-1] if why else done.returncode}); "
                "run as root or enable unprivileged user namespaces")
    return None


# --- fitness: can the sandbox run the benchmark at all? ------------------------------------------

BENCHMARK_NEEDS = ("numpy", "torch", "prepare")  # what train.py and prepare.py import from outside the stdlib
FITNESS_EXIT = 97  # the boot's exit code when the sandbox is unfit (the candidate never ran)
FITNESS_LIMIT_SECONDS = 300.0  # for the boot's report; the candidate's start-up allowance counts from it
# argv: the report pipe's fd, the modules to import (comma-separated), "1" if CUDA must work,
# and "find" to only find and read each module's file (the quick up-front check: no import).
# Nothing is kept in the namespace train.py runs in (runpy gives it a fresh one).
FITNESS_BOOT = r"""
import json, os, sys
def _boot():
    fd, needs, cuda = int(sys.argv[1]), [n for n in sys.argv[2].split(",") if n], sys.argv[3] == "1"
    find = sys.argv[4:5] == ["find"]
    try:
        import importlib, importlib.util
        for name in needs:
            if not find:
                importlib.import_module(name)
                continue
            spec = importlib.util.find_spec(name)
            if spec is None:
                raise ModuleNotFoundError(f"No module named {name!r}")
            if spec.origin and os.path.isfile(spec.origin):
                open(spec.origin, "rb").close()
        if cuda and not find:
            import torch
            if not torch.cuda.is_available():
                raise RuntimeError("torch.cuda.is_available() is False although the run was given a GPU")
        report = {"fit": True}
    except BaseException as e:
        report = {"fit": False, "error": f"{type(e).__name__}: {e}"[:1000], "executable": sys.executable,
                  "prefix": sys.prefix, "uid": os.getuid()}
    os.write(fd, json.dumps(report).encode())
    os.close(fd)
    return report["fit"]
if not _boot():
    os._exit(97)
del _boot
import runpy
sys.argv = [os.path.abspath("train.py")]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def fitness_pipe() -> tuple[int, int]:
    """(read end, write end) for the boot's report; pass the write end to the sandbox and close
    it here once the sandbox has started."""
    r, w = os.pipe()
    os.set_inheritable(w, True)
    return r, w


def boot_argv(python: str, report_fd: int, cuda: bool, needs: tuple[str, ...] = BENCHMARK_NEEDS,
              find_only: bool = False) -> list[str]:
    """The interpreter's argv that checks fitness, reports on report_fd, then runs ./train.py
    (find_only: finds and reads each module's file instead of importing it; no CUDA check)."""
    return [python, "-s", "-P", "-c", FITNESS_BOOT, str(report_fd), ",".join(needs), "1" if cuda else "0",
            *(["find"] if find_only else [])]


def read_fitness(r: int) -> dict | None:
    """The boot's report from the pipe's read end (closed here): read until it is whole or the
    pipe ends; None if there is none (the interpreter never started, or died before it could say).
    The boot writes it at once, then closes its end; a process that passed the fd on (bwrap's
    own) may hold it open longer, so the report is taken as soon as it parses."""
    import json

    raw = b""
    try:
        while len(raw) < 2**16:
            part = os.read(r, 4096)
            if not part:
                break
            raw += part
            try:
                report = json.loads(raw)
            except ValueError:
                continue
            return report if isinstance(report, dict) else None
    finally:
        os.close(r)
    return None


class Fitness:
    """The boot's report, read by a thread while the sandbox runs; `at`: when it came
    (time.monotonic), so that the candidate's start-up allowance counts from there."""

    def __init__(self, r: int) -> None:
        import threading

        self.report: dict | None = None
        self.at: float | None = None
        self._thread = threading.Thread(target=self._read, args=(r,), daemon=True, name="sandbox-fitness")
        self._thread.start()

    def _read(self, r: int) -> None:
        import time

        self.report = read_fitness(r)
        self.at = time.monotonic()

    def result(self, timeout: float = 5.0) -> dict | None:
        """The report, once the sandbox has ended (None if it never came)."""
        self._thread.join(timeout)
        return self.report


def unfit_reason(report: dict | None, who: str, last_words: str = "") -> str:
    """What was wrong and the fix, for a sandbox whose boot reported unfit (or did not report)."""
    if report is None:
        return (f"the sandbox did not start the Python interpreter as {who} "
                f"({last_words or 'no output'}); nothing of the candidate ran. The interpreter "
                f"{sys.executable} must be executable by {who}")
    error = str(report.get("error", ""))
    if "cuda" in error.lower():
        return (f"the run was given a GPU but CUDA does not work in the sandbox ({error}); nothing of "
                "the candidate ran. Check the driver (`nvidia-smi`) and that /dev/nvidia* exist")
    prefix = report.get("prefix") or sys.prefix
    return (f"{who} cannot import what the benchmark needs with {report.get('executable') or sys.executable} "
            f"({error}); nothing of the candidate ran. The Python installation ({sys.prefix}, with its "
            f"packages; the sandbox saw prefix {prefix}) must be readable by {who}, and every directory "
            "above it searchable: install it or clone the lab under a directory other users can enter "
            "(not a 0700 home or `mktemp -d`), or `chmod o+rx` those directories")


def fitness_problem(cuda: bool = False, quick: bool = False) -> str | None:
    """None if the sandbox can import what the benchmark needs (and use CUDA, if asked), run once
    the way a candidate is; else what was wrong and the fix. For the up-front check of a machine
    (`python -I sandbox.py`): it imports torch, a second or two. quick: finds and reads the
    modules' files instead (`--quick`, what `autolab run` asks; no CUDA check)."""
    import tempfile

    try:
        seccomp = filter_fd()
    except RuntimeError as e:
        return str(e)
    r, w = fitness_pipe()
    scratch = Path(tempfile.mkdtemp(prefix="autolab-fitness-"))
    try:
        os.chmod(scratch, 0o755)
        (scratch / "train.py").write_text("")
        prepare_scratch(scratch)
        here = Path(__file__).resolve().parent
        argv = command(boot_argv(sys.executable, w, cuda and not quick, find_only=quick), scratch=scratch, harness=here, gpu=cuda,
                       seccomp_fd=seccomp)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": HARNESS, "HOME": SCRATCH,
               "AUTOLAB_BENCH_PROFILE": os.environ.get("AUTOLAB_BENCH_PROFILE", "tiny")}
        try:
            done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=300,
                                  pass_fds=(seccomp, w), env=env)
        except (OSError, subprocess.SubprocessError) as e:
            return f"the sandbox does not start here ({e})"
        finally:
            os.close(w)
        report = read_fitness(r)
        r = -1
    finally:
        os.close(seccomp)
        if r >= 0:
            os.close(r)
        shutil.rmtree(scratch, ignore_errors=True)
    if report is not None and report.get("fit"):
        return None
    words = done.stderr.decode(errors="replace").strip().splitlines()
    who = f"the sandbox's uid {SANDBOX_UID}" if os.geteuid() == 0 else "the sandbox"
    return unfit_reason(report, who, words[-1] if words else "")


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
            seccomp_fd: int, probe: bool = False) -> list[str]:
    """The bwrap argv that runs `argv` in the sandbox (cwd /scratch), under the syscall filter
    read from seccomp_fd (filter_fd(); pass it to bwrap)."""
    root = os.geteuid() == 0
    args = [bwrap() or "bwrap", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--die-with-parent", "--new-session",
            "--seccomp", str(seccomp_fd)]
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


if __name__ == "__main__":  # `python -I sandbox.py [--quick]`: exit 0 if candidates can be sandboxed here
    # exit 1: no sandbox here; 2: a sandbox that cannot run the benchmark (the message says why)
    problem = available()
    unfit = None if problem else fitness_problem(cuda=wants_gpu(), quick="--quick" in sys.argv[1:])
    print(problem or unfit or "ok: candidates run in a bubblewrap sandbox that can import what the "
                              "benchmark needs")
    sys.exit(1 if problem else 2 if unfit else 0)
