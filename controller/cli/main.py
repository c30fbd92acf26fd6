"""`autolab`: the kubectl-like command line of a lab on one machine.

Every command takes `--lab DIR` (default: the current directory). The verbs
follow kubectl's: `apply -f`, `get [-o wide|json|yaml]`, `describe`, `logs`,
`delete`; `run` is the controller loop itself (reconcile until every
experiment is finished, or forever with `--watch`).
"""

from __future__ import annotations

import argparse
import errno
import os
import sys

from filelock import Timeout as LockTimeout

from controller.backends import BackendConfigError
from controller.core.errors import MACHINE, kind_of
from controller.core.noise import FIRST_LOOK
from controller.lab.harness import HarnessError
from controller.cli import authoring, completion, demo, hf, lab, operator
from controller.cli.output import REPO_ROOT, CliError, one_line
from controller.core.spec import SpecError
from controller.lab.init import LabInitError
from controller.lab.ledger import LedgerError
from controller.lab.paths import find_lab_root
from controller.lab.git import GitError
from controller.engine import BaselineFailed
from controller.lab.profiles import profiles


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("autolab-research")  # the distribution's name (pyproject.toml)
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def _max_pairs_arg(text: str) -> int:
    """`--max-pairs`: an integer in the schema's range for promotion.maxPairs."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not FIRST_LOOK <= value <= 50:
        raise argparse.ArgumentTypeError(f"{text!r}: the most pairs one decision may take is a whole "
                                         f"number from {FIRST_LOOK} (the first look) to 50")
    return value


def _min_delta_arg(text: str) -> float | str:
    """`--min-delta`: auto, or a number of val_bpb >= 0."""
    if text == "auto":
        return text
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is neither auto nor a number >= 0 (val_bpb the "
                                         "candidate must beat the master by)")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="autolab", description=__doc__.split("\n\n")[0])
    p.add_argument("--version", action="version", version=f"autolab {_version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name, fn, help_, lab=True):
        sp = sub.add_parser(name, help=help_, description=help_)
        if lab:
            sp.add_argument("--lab", default=".", metavar="DIR",
                            help="lab directory (default: the lab around the current directory)")
        sp.set_defaults(fn=fn)
        return sp

    sp = add("init", lab.cmd_init, "create a new lab: git repo, bench/, research/, seeded master",
             lab=False)
    sp.add_argument("dir")
    sp.add_argument("--profile", choices=sorted(profiles()), default="default")
    sp.add_argument("--data", default="hub", help="synthetic | hub | dir:PATH")
    sp.add_argument("--name", default="default", help="the Lab's name")
    sp.add_argument("--budget", type=int, help="training seconds per run (default: profile's)")
    sp.add_argument("--from", dest="seed", metavar="SEED_DIR",
                    help="adopt a lab in the seed's layout: its train.py is the master, its "
                         "research/results.tsv rows are kept (marked Imported)")
    sp.add_argument("--min-delta", type=_min_delta_arg, default="auto", metavar="auto|NUMBER",
                    help="promotion.minDelta: auto (the default) promotes any gain the paired, "
                         "sequential test shows real; a number lets one pair decide: the first "
                         "run must beat the master's run on the same seed by more than it")
    sp.add_argument("--max-pairs", type=_max_pairs_arg, default=None, metavar="N",
                    help="promotion.maxPairs: the most pairs one decision may take (default 10; "
                         "3 for the tiny profile, a CPU smoke test)")
    sp.add_argument("--keep-metric", action="store_true",
                    help="with --from: take the master's val_bpb from SEED_DIR/research/live/"
                         "master.json instead of measuring it again")
    sp = add("apply", lab.cmd_apply, "create experiments from spec files (a spec cannot change "
             "once applied, and a name recorded in the ledger is never reused)")
    sp.add_argument("-f", "--filename", action="append", required=True,
                    help="FILE, DIR or - (stdin); repeatable")
    sp = add("run", lab.cmd_run, "reconcile until every experiment is finished")
    sp.add_argument("--watch", action="store_true", help="keep running and pick up new specs")
    sp.add_argument("--interval", type=float, default=1.0, help="seconds between passes")
    sp.add_argument("--unsafe-no-sandbox", action="store_true",
                    help="run candidates without bubblewrap (only for code you trust; every "
                         "result says so)")
    sp = add("noise", lab.cmd_noise, "what this machine and budget let the lab see: the master "
             "across the lab's secret seeds, the same seeds again, and the smallest gain it detects")
    sp.add_argument("--runs", type=int, default=5, help="seeds to measure the master on (at least 2)")
    sp.add_argument("--unsafe-no-sandbox", action="store_true",
                    help="run without bubblewrap (only for code you trust)")
    sp.add_argument("--interval", type=float, default=1.0, help="seconds between checks")
    sp = add("get", lab.cmd_get, "list experiments (or one)")
    sp.add_argument("name", nargs="?")
    sp.add_argument("-o", "--output", choices=["wide", "json", "yaml", "name"])
    sp.add_argument("-w", "--watch", action="store_true",
                    help="after the list, print each experiment again when it changes (Ctrl-C "
                         "stops)")
    sp.add_argument("-l", "--selector", metavar="SELECTOR",
                    help="only experiments whose metadata.labels match: key=value, key!=value, "
                         "key, !key; comma-separated")
    sp.add_argument("--sort-by", metavar="FIELD",
                    help="a field (.status.metrics.val_bpb, .status.delta, .metadata.name) or a "
                         "column (VAL_BPB, DELTA, AGE, ...)")
    sp.add_argument("--interval", type=float, default=1.0, help=argparse.SUPPRESS)
    sp = add("describe", lab.cmd_describe, "everything about one experiment, with its events")
    sp.add_argument("name")
    sp = add("logs", lab.cmd_logs, "the run log of an experiment")
    sp.add_argument("name")
    sp.add_argument("-f", "--follow", action="store_true")
    sp = add("delete", lab.cmd_delete, "delete experiments (cancels their runs, records them; "
             "a name is never reused)")
    sp.add_argument("name", nargs="*")
    sp.add_argument("-f", "--filename", action="append",
                    help="the experiments named in FILE, DIR or - (stdin); repeatable")
    sp.add_argument("--all", action="store_true",
                    help="every experiment (runs in flight are cancelled; ledger rows stay)")
    sp = add("ledger", lab.cmd_ledger, "the ledger, research/results.tsv")
    sp.add_argument("-o", "--output", choices=["table", "tsv"], default="table")
    sp = add("master", lab.cmd_master, "the current master")
    sp.add_argument("-o", "--output", choices=["text", "json"], default="text")
    sp = add("demo", demo.cmd_demo, "a whole lab in a temporary directory: seven outcomes, tiny, CPU",
             lab=False)
    sp.add_argument("--keep", action="store_true", help="keep the demo lab directory")
    sp.add_argument("--dir", help="build the demo lab here instead of a temporary directory")
    sp = add("crds", lab.cmd_crds, "write the CRDs generated from the spec schema", lab=False)
    sp.add_argument("--out", default=str(REPO_ROOT / "crds"))
    sp = add("completion", lambda a: completion.cmd_completion(a, p), "print a shell "
             "completion script: `source <(autolab completion bash)` (or zsh)", lab=False)
    sp.add_argument("shell", choices=["bash", "zsh"])
    authoring.add_commands(sub, add)
    hf.add_commands(sub, add)
    operator.add_arguments(add("operator", operator.cmd_operator,
                               "run the Kubernetes operator: Experiments and Labs in one namespace "
                               "become Jobs, ledger rows and promotions", lab=False))
    return p


# --- known failures -----------------------------------------------------------------------------
# Something wrong in the world, not in autolab (a damaged git repo, a hand-edited ledger, a
# cluster or Hugging Face out of reach, a full disk): one line on stderr saying what went wrong
# and what to do, exit 1. Anything else is a bug and keeps its traceback. Kubernetes, kopf,
# huggingface_hub and the HTTP clients are recognised by class name along the exception's MRO,
# so that `autolab` imports none of them for a command that does not use them.

ACCESS_HINT = "check the permissions and owner of that path (run autolab as the lab's owner)"
FILE_HINTS = {
    errno.EACCES: ACCESS_HINT,
    errno.EPERM: ACCESS_HINT,
    errno.ENOSPC: "free some disk space (or move the lab to a larger disk), then run again",
    errno.EDQUOT: "the disk quota is used up: free some space, then run again",
    errno.EROFS: "the file system is read-only: put the lab on a writable disk",
    errno.ENOENT: "check the path (is --lab the lab's directory?)",
    errno.ENOTDIR: "check the path (is --lab the lab's directory?)",
    errno.EISDIR: "check the path: a directory is where a file should be",
    errno.EMFILE: "too many open files: raise the limit (ulimit -n), then run again",
    errno.ENFILE: "too many open files on this machine: stop other processes, then run again",
    errno.EIO: "the disk reported an I/O error: check it (dmesg) before running again",
}
NETWORK_ERRNOS = {errno.ECONNREFUSED, errno.ECONNRESET, errno.ECONNABORTED, errno.ETIMEDOUT,
                  errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENETDOWN, errno.EPIPE}


def _is(e: BaseException, module: str, name: str) -> bool:
    """Whether `e` is an instance of `module.name` (or of a class so named in a submodule),
    without importing `module`."""
    return any(c.__qualname__ == name and (c.__module__ == module
                                           or c.__module__.startswith(module + "."))
               for c in type(e).__mro__)


def _says(message: object, hint: str, always: bool = False) -> str:
    """`what went wrong; what to do`. Our own errors mostly say what to do already (after a
    '; '): the hint is added only where they do not, and always to a tool's raw output."""
    text = one_line(message).rstrip(".") or "failed"
    return text if ("; " in text and not always) else f"{text}; {hint}"


def _status(e: BaseException) -> int | None:
    response = getattr(e, "response", None)
    code = getattr(response, "status_code", None) if response is not None else None
    return code if isinstance(code, int) else None


def _url(e: BaseException) -> str:
    try:  # httpx raises RuntimeError where a request was not set
        request = getattr(e, "request", None)
    except RuntimeError:
        return ""
    url = getattr(request, "url", None) if request is not None else getattr(e, "url", None)
    return str(url or "")


def _hf_http(e: BaseException) -> str:
    code = _status(e)
    if code == 401:
        hint = ("check the token: `hf auth login` or HF_TOKEN; `autolab hf preflight` checks the "
                "setup")
    elif code == 403:
        hint = ("the token may not act in that namespace: use a token with write access, or set "
                "spec.hf.namespace; `autolab hf preflight` checks the setup")
    elif code == 404:
        hint = "check spec.hf.namespace and spec.hf.bucket in lab.yaml (`autolab hf preflight`)"
    elif code == 429 or (code or 0) >= 500:
        hint = "Hugging Face is busy or down: wait a little, then run again"
    else:
        hint = "`autolab hf preflight` checks the token, namespace, bucket and flavor"
    return _says(f"Hugging Face answered{f' {code}' if code else ''}: {e}", hint, always=True)


def _kube_api(e: BaseException) -> str:
    import json
    status, reason = getattr(e, "status", None), getattr(e, "reason", None)
    detail = ""
    try:
        detail = json.loads(getattr(e, "body", None) or "{}").get("message", "")
    except (ValueError, TypeError, AttributeError):
        pass
    what = f"the Kubernetes API server answered {status} {reason or ''}".rstrip()
    what += f": {detail}" if detail else ""
    if status in (401, 403):
        hint = ("check the credentials of the kubeconfig (or the service account) and its RBAC "
                "rights in the namespace")
    elif status == 404:
        hint = "check the namespace, and that the CRDs are installed (`kubectl apply -f crds/`)"
    else:
        hint = "check the cluster (`kubectl get --raw /readyz`), then run again"
    return _says(what, hint, always=True)


def _network(e: BaseException, hint: str) -> str:
    url = _url(e)
    detail = str(e) or type(e).__name__
    code = _status(e)
    if code is not None:
        return _says(f"{url or 'the server'} answered {code}: {detail}", hint, always=True)
    return _says(f"cannot reach {url}: {detail}" if url else f"network error: {detail}", hint,
                 always=True)


def _os_error(e: OSError) -> str | None:
    if isinstance(e, (ConnectionError, TimeoutError)) or e.errno in NETWORK_ERRNOS \
            or _is(e, "socket", "gaierror"):
        return _network(e, "check the network connection and the server's address, then run "
                           "again")
    if e.filename is None and e.errno not in FILE_HINTS:
        return None  # no file and no errno we know: a bug, shown with its traceback
    what = e.strerror or str(e)
    if e.filename is not None:
        target = f"{e.filename}" + (f" -> {e.filename2}" if e.filename2 is not None else "")
        what = f"{target}: {what}"
    hint = FILE_HINTS.get(e.errno, "check the path, then run again")
    name = str(e.filename or "")
    if e.errno == errno.ENOENT and name and "/" not in name and "." not in name:
        hint = f"is {name} installed? install it or put it on PATH"  # a program, run by name
    return _says(what, hint, always=True)


def known_failure(e: BaseException, lab: str | None = None) -> str | None:
    """The one line `autolab` prints for a known failure (without `error: `), or None for a bug."""
    lab = lab or "."
    if isinstance(e, (SpecError, CliError, LabInitError)):  # HfBackendError is a SpecError
        return one_line(e)
    if isinstance(e, GitError) and "Read-only file system" in str(e):
        # An agent runtime's sandbox (Codex's workspace-write) keeps .git read-only.
        return _says(e, f"{lab}/.git is read-only where this ran, as in an agent's sandbox: "
                        "`autolab agents render --for codex` lets Codex sessions write it; "
                        "elsewhere run autolab outside the sandbox", always=True)
    if isinstance(e, GitError):
        return _says(e, f"the lab's git repository is damaged or busy: check it with "
                        f"`git -C {lab} status` and `git -C {lab} fsck`", always=True)
    if isinstance(e, LedgerError):
        return _says(e, f"fix {lab}/research/results.tsv by hand: its first line is the header, "
                        "then one tab-separated row per run")
    if isinstance(e, HarnessError):
        return _says(e, f"the lab's first commit is unreadable: check `git -C {lab} fsck`, or "
                        "make a new lab with `autolab init`")
    if isinstance(e, BaselineFailed):
        return _says(e, "see the run's log, then run again")
    if isinstance(e, BackendConfigError):
        return _says(e, "fix the backend's settings in lab.yaml, then run again")
    if _is(e, "controller.kube.cluster", "ClusterError"):
        return _says(e, "check the cluster with kubectl, then run again")
    if isinstance(e, LockTimeout):
        return _says(f"another autolab process holds the lock {e.lock_file}",
                     "wait for it to finish (or stop it), then run again", always=True)
    if _is(e, "huggingface_hub", "LocalTokenNotFoundError"):
        return ("no Hugging Face token on this machine; log in with `hf auth login`, or set "
                "HF_TOKEN (a token with the Jobs permission), then run again")
    if _is(e, "huggingface_hub", "HfHubHTTPError"):
        return _hf_http(e)
    if _is(e, "kubernetes", "ApiException"):
        return _kube_api(e)
    if _is(e, "kubernetes", "ConfigException"):
        return _says(f"cannot load the Kubernetes configuration: {e}",
                     "set KUBECONFIG (or run in a cluster), or pass --server URL", always=True)
    if _is(e, "urllib3", "HTTPError") or _is(e, "aiohttp", "ClientError") \
            or _is(e, "kopf", "APIError"):
        return _network(e, "check that the Kubernetes API server is up and that the kubeconfig "
                           "(or --server) names it, then run again")
    if _is(e, "httpx", "HTTPError") or _is(e, "httpx2", "HTTPError") \
            or _is(e, "requests", "RequestException"):
        endpoint = os.environ.get("HF_ENDPOINT")
        return _network(e, "check the network connection" + (
            f" and HF_ENDPOINT ({endpoint})" if endpoint else "") + ", then run again")
    if isinstance(e, OSError):
        return _os_error(e)
    return None


def _redacted(text: str) -> str:
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        token = os.environ.get(var) or ""
        if len(token) >= 8:
            text = text.replace(token, "[redacted]")
    return text


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reader has closed it (poll says POLLERR), so that a broken
    pipe was ours to write to, not some connection's."""
    import select
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & select.POLLERR for _, ev in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # io.UnsupportedOperation is both
        return False


def _silence_stdout() -> None:
    """The reader of our stdout is gone (`autolab ledger | head -1`): point stdout at /dev/null,
    so that the interpreter's flush at exit has nowhere to fail and prints no 'Exception
    ignored ... BrokenPipeError'."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    if isinstance(getattr(a, "lab", None), str):
        found = find_lab_root(a.lab)  # from anywhere inside a lab, like git
        a.lab = str(found) if found is not None else a.lab
    try:
        rc = a.fn(a)
        sys.stdout.flush()  # a closed pipe shows up here, not in the interpreter's exit
        return rc
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        if isinstance(e, BrokenPipeError) and _stdout_reader_gone():
            _silence_stdout()  # nobody reads any more: nothing to say, to anyone
            return 1
        message = known_failure(e, lab=getattr(a, "lab", None))
        if message is None:
            raise  # a bug: its traceback is the honest report
        try:  # what the command printed; if stdout itself failed (a full disk), drop the rest
            sys.stdout.flush()
        except (OSError, ValueError):
            _silence_stdout()
        # Who must act: autolab's own failures say; every other known one (the disk, the
        # network, the cluster's API, a lock, a token) is the environment's.
        kind = kind_of(e) or MACHINE
        try:
            print(f"error: {_redacted(message)} ({kind})", file=sys.stderr, flush=True)
        except OSError:
            pass
        return 1


if __name__ == "__main__":
    sys.exit(main())
