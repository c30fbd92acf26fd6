"""The entry point of a Hugging Face job: run the harness, hand back a result nobody can forge.

A Hugging Face job has no copy of the lab. The controller ships this file,
the fixed harness (`prepare.py`, `run.py`, `evaluate.py`, ...) and the
candidate `train.py` as a gzipped tarball in the job's environment; a few
lines of bootstrap in the job's command unpack it and exec this file:

    AUTOLAB_RUN=NAME python3 hf_entry.py run --profile P --source S [--budget S]
                            [--data-mount DIR] [--with REQUIREMENT ...]
    python3 hf_entry.py prepare --profile P --source S --data-mount DIR [--with ...]

`run` measures one candidate. The only thing the controller believes is one
log line, `AUTOLAB_SIGNED_RESULT v1 <payload> <hmac>`: the harness's compact
result JSON and the run's name, signed with HMAC-SHA256 under a key the
controller drew for this run and passed as the job secret
`AUTOLAB_RESULT_KEY`. The candidate prints to the same log, so keeping the
key away from it is the whole point:

1. Stage one (this process, as started) takes the key out of its
   environment, installs whatever the image lacks with secrets scrubbed from
   the installer's environment, writes the key into a pipe, and re-execs
   itself with an environment that holds neither the key nor `HF_TOKEN`.
   After exec, `/proc/<pid>/environ` shows the new environment: a candidate
   reading its parent's environ finds nothing. The job's command execs
   straight into Python (no shell, no `uv run` wrapper left as an ancestor
   holding the original environment); if some ancestor does hold the key
   all the same, stage one refuses to measure rather than sign a result
   the candidate could have signed.
2. Stage two reads the key from the pipe, closes it and marks itself
   non-dumpable (`PR_SET_DUMPABLE` 0), so without CAP_SYS_PTRACE (not granted
   to containers by default) no other process can read its memory or its
   /proc files. It then calls the harness in-process
   (`run.run_candidate`), which runs the candidate in its sandbox; the result
   comes back as a Python object, never through a file the candidate could
   overwrite, and is signed and printed here.

The step curve. A local run's Trackio curve is the JSONL file the harness
keeps (`report_step` -> `$AUTOLAB_CURVE_PATH` -> validated by run.py). The
job's files do not come back, so after the run stage two prints that curve as
`AUTOLAB_SIGNED_CURVE curve-v1 <payload> <hmac>` lines (the run's name, part
i of n, at most CURVE_POINTS_PER_LINE points each, at most CURVE_MAX_POINTS in
all, evenly thinned past that), signed under the same key with their own
version tag so no curve line can pass for a result line, and printed before
the result line, when the candidate is dead. The curve is informational: the
controller keeps the points of verified lines only, checks every number, and
never reads a metric from it.

The sandbox (`run.py --sandbox isolated`): bubblewrap where it can make its
namespaces here (`sandbox.available()`); else, when the job runs as root
(jobs usually do), the candidate runs as the dedicated uid
`sandbox.SANDBOX_UID` with no capabilities and no-new-privs, in a scratch
directory of its own, and every process of that uid is killed before the
evaluation (run.py's uid mode). The bundle, the cache overlay and the result
live in root-owned 0700 directories that uid cannot read, and uid mode checks
that it cannot read the validation split either (a bucket mount readable by
every user makes it refuse). Neither possible: no measurement, but a signed
error result saying why.

The prepared data comes from the lab's bucket, mounted read-only at
`--data-mount`: a candidate cannot poison the cache the next runs measure
on. The harness wants a writable cache root (lock files, the compile
cache), so stage two builds one in a temporary directory whose `data/`
entries are symlinks to the bucket's prepared directories. With no prepared
data on the bucket, the harness prepares it inside the job (slower; run
`autolab hf prepare` once instead).

`prepare` fills the bucket (mounted read-write) with `prepare.py --source S`;
only the fixed harness runs there, so it may see `HF_TOKEN` for downloads.

Exit codes follow run.py: 0 succeeded, 3 the candidate failed, 4 an
infrastructure error (including this entry point's own failures).
"""

from __future__ import annotations

import argparse
import base64
import ctypes
import hashlib
import hmac
import importlib.util
import inspect
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
KEY_ENV = "AUTOLAB_RESULT_KEY"
SIGNED_MARKER = "AUTOLAB_SIGNED_RESULT"
SIGNATURE_VERSION = "v1"
CURVE_MARKER = "AUTOLAB_SIGNED_CURVE"
CURVE_VERSION = "curve-v1"
CURVE_POINTS_PER_LINE = 50   # a line stays a few KiB
CURVE_MAX_POINTS = 5000      # the controller keeps no more (controller/backends/hf_wire.py)
CURVE_FILE_LIMIT = 2**20     # run.py keeps at most this much of the candidate's curve
CURVE_KEYS = ("step", "loss", "tokens_per_sec", "time")
# Never handed to the candidate, the installer or the harness of a run.
SECRET_ENV = (KEY_ENV, "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "AUTOLAB_BUNDLE")
BUNDLE_PARTS = "AUTOLAB_BUNDLE_"  # the rest of a long bundle (the bootstrap took them already)
EXIT_HARNESS_ERROR = 4
PR_SET_DUMPABLE = 4
SANDBOX_REQUEST = "isolated"  # run.py: bubblewrap, else (as root) a uid of its own, else refuse


# --- the signed result line (the controller verifies it: controller/backends/hf_wire.py) -----

def sign_result(key: bytes, run: str, compact_result: str) -> str:
    """The one log line the controller believes: run name + result, HMAC-SHA256 under key."""
    payload = json.dumps({"run": run, "result": json.loads(compact_result)},
                         separators=(",", ":"), sort_keys=True)
    b64 = base64.urlsafe_b64encode(payload.encode()).decode()
    mac = hmac.new(key, f"{SIGNATURE_VERSION} {b64}".encode(), hashlib.sha256).hexdigest()
    return f"{SIGNED_MARKER} {SIGNATURE_VERSION} {b64} {mac}"


def _signed(marker: str, version: str, key: bytes, payload: dict) -> str:
    b64 = base64.urlsafe_b64encode(json.dumps(payload, separators=(",", ":"),
                                              sort_keys=True).encode()).decode()
    mac = hmac.new(key, f"{version} {b64}".encode(), hashlib.sha256).hexdigest()
    return f"{marker} {version} {b64} {mac}"


def sign_curve(key: bytes, run: str, points: list[dict]) -> list[str]:
    """The step curve as signed log lines: part i of n, CURVE_POINTS_PER_LINE points each."""
    if len(points) > CURVE_MAX_POINTS:  # thin evenly, keep the last point
        stride = math.ceil(len(points) / CURVE_MAX_POINTS)
        points = points[::stride][:CURVE_MAX_POINTS - 1] + points[-1:]
    chunks = [points[i:i + CURVE_POINTS_PER_LINE]
              for i in range(0, len(points), CURVE_POINTS_PER_LINE)]
    return [_signed(CURVE_MARKER, CURVE_VERSION, key,
                    {"run": run, "part": i, "parts": len(chunks), "points": chunk})
            for i, chunk in enumerate(chunks)]


def harness_curve(result: dict) -> list[dict]:
    """The curve the harness kept for this run (already checked by run.py), as points."""
    path = result.get("curve")
    if not isinstance(path, str) or not path:
        return []
    try:
        with open(path, "rb") as f:
            raw = f.read(CURVE_FILE_LIMIT + 1)
    except OSError:
        return []
    points = []
    for text in raw[:CURVE_FILE_LIMIT].decode("utf-8", "replace").splitlines():
        try:
            d = json.loads(text)
        except ValueError:
            continue
        if isinstance(d, dict) and isinstance(d.get("step"), int):
            points.append({k: d[k] for k in CURVE_KEYS if isinstance(d.get(k), (int, float))})
    return points


# --- stage one: secrets out of the environment, dependencies in ------------------------------

def _log(text: str) -> None:
    print(f"[hf] {text}", flush=True)


def _scrubbed_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in SECRET_ENV and not k.startswith(BUNDLE_PARTS)}


def _module_of(requirement: str) -> str:
    name = re.split(r"[<>=!~\[;@ ]", requirement.strip(), maxsplit=1)[0]
    return name.replace("-", "_").lower()


def install_missing(requirements: list[str]) -> None:
    """Install the requirements whose module the image lacks (none: nothing is downloaded)."""
    missing = [r for r in requirements if importlib.util.find_spec(_module_of(r)) is None]
    if not missing:
        return
    if shutil.which("uv"):
        cmd = ["uv", "pip", "install", "--system", "--break-system-packages",
               "--python", sys.executable, *missing]
    else:
        cmd = [sys.executable, "-m", "pip", "install", "--no-input", *missing]
    _log(f"installing {' '.join(missing)}")
    rc = subprocess.run(cmd, env=_scrubbed_env(), stdin=subprocess.DEVNULL).returncode
    if rc != 0:
        _log(f"installing the dependencies failed (exit code {rc}); check the image and the "
             "requirements")
        sys.exit(EXIT_HARNESS_ERROR)


def ancestors_holding(name: str) -> list[int]:
    """Pids of this process's ancestors whose environment still holds `name`.

    A candidate can read the environ of every process of its user that is not
    protected; if whatever started this job (a shell, an init wrapper) kept the
    key there, the key is exposed however carefully this process scrubs itself.
    """
    found, pid, marker = [], os.getppid(), f"{name}=".encode()
    while pid > 1:
        try:
            if marker in Path(f"/proc/{pid}/environ").read_bytes():
                found.append(pid)
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat.rsplit(")", 1)[1].split()[1])
    return found


def stage_one(args: argparse.Namespace, argv: list[str]) -> None:
    key = os.environ.pop(KEY_ENV, "")
    if not key:
        _log(f"the job has no {KEY_ENV} secret; the controller cannot trust any result of it")
        sys.exit(EXIT_HARNESS_ERROR)
    exposed = ancestors_holding(KEY_ENV)
    if exposed:
        _log(f"process(es) {', '.join(map(str, exposed))} above this one keep {KEY_ENV} in their "
             "environment, where the candidate could read it; refusing to measure. The job's "
             "command must exec python3 directly (no shell or wrapper that stays alive)")
        sys.exit(EXIT_HARNESS_ERROR)
    for name in [*SECRET_ENV, *(k for k in os.environ if k.startswith(BUNDLE_PARTS))]:
        os.environ.pop(name, None)
    install_missing(args.requirements)
    read_end, write_end = os.pipe()
    os.write(write_end, key.encode())
    os.close(write_end)
    os.set_inheritable(read_end, True)
    # exec, not spawn: this pid's environ is replaced, and no ancestor keeps the key.
    os.execve(sys.executable, [sys.executable, str(Path(__file__).resolve()), *argv,
                               "--key-fd", str(read_end)], _scrubbed_env())


# --- stage two: the measured run ----------------------------------------------------------------

def _no_dumping() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the re-exec still keeps the key off environ
        pass


def _read_key(fd: int) -> bytes:
    chunks = []
    while True:
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks)


def cache_overlay(data_mount: str | None) -> Path:
    """A writable cache root whose data/ entries point at the bucket's prepared directories."""
    root = Path(tempfile.mkdtemp(prefix="autolab-cache-"))
    (root / "data").mkdir()
    prepared = Path(data_mount) / "data" if data_mount else None
    found = []
    if prepared is not None and prepared.is_dir():
        for entry in sorted(prepared.iterdir()):
            if entry.is_dir() and not entry.name.startswith("."):
                (root / "data" / entry.name).symlink_to(entry, target_is_directory=True)
                found.append(entry.name)
    if found:
        _log(f"prepared data from the bucket (read-only): {', '.join(found)}")
    else:
        _log("no prepared data on the bucket; the harness prepares it inside this job (run "
             "`autolab hf prepare` once so runs do not pay for it)")
    return root


def _load_harness(profile: str):
    os.environ["AUTOLAB_BENCH_PROFILE"] = profile  # prepare.py reads it at import
    sys.path.insert(0, str(BENCH_DIR))
    spec = importlib.util.spec_from_file_location("autolab_run_harness", BENCH_DIR / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stage_two(args: argparse.Namespace) -> int:
    _no_dumping()
    key = _read_key(args.key_fd)
    if not key:
        _log("the result key did not reach the measuring process")
        return EXIT_HARNESS_ERROR
    os.environ["AUTOLAB_CACHE"] = str(cache_overlay(args.data_mount))
    harness = _load_harness(args.profile)
    out = Path(tempfile.mkdtemp(prefix="autolab-result-"))
    # A lab's pinned harness may predate the evaluation's bound (run.py --eval-limit).
    bound = {"eval_limit_seconds": args.eval_limit} if args.eval_limit and "eval_limit_seconds" in \
        inspect.signature(harness.run_candidate).parameters else {}
    result = harness.run_candidate(BENCH_DIR / "train.py", out / "result.json", source=args.source,
                                   budget=args.budget, termination_log="",
                                   sandbox_request=SANDBOX_REQUEST, run=args.run, seed=args.seed,
                                   **bound)
    try:  # informational: a curve that cannot be read must not cost the result
        curve = sign_curve(key, args.run, harness_curve(result))
    except Exception as e:  # noqa: BLE001
        _log(f"the step curve could not be sent ({type(e).__name__}); the result stands")
        curve = []
    for line in curve:
        print(line, flush=True)
    print(sign_result(key, args.run, harness.compact(result)), flush=True)
    return harness.EXIT_CODES.get(result.get("status"), EXIT_HARNESS_ERROR)


# --- prepare: fill the bucket ------------------------------------------------------------------

def prepare_mode(args: argparse.Namespace) -> int:
    if not args.data_mount:
        _log("prepare needs --data-mount (the lab's bucket, mounted read-write)")
        return EXIT_HARNESS_ERROR
    os.environ.pop(KEY_ENV, None)
    os.environ.pop("AUTOLAB_BUNDLE", None)
    install_missing(args.requirements)
    env = dict(os.environ, AUTOLAB_CACHE=args.data_mount, AUTOLAB_BENCH_PROFILE=args.profile,
               PYTHONUNBUFFERED="1")
    _log(f"preparing {args.source} for the {args.profile} profile into {args.data_mount}")
    return subprocess.run([sys.executable, str(BENCH_DIR / "prepare.py"), "--source", args.source],
                          env=env, stdin=subprocess.DEVNULL).returncode


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=["run", "prepare"])
    p.add_argument("--run", default=os.environ.get("AUTOLAB_RUN", ""),
                   help="the run's name, signed into the result (default: $AUTOLAB_RUN, which the "
                        "controller sets: a command line is open to every uid in the container)")
    p.add_argument("--profile", default="default")
    p.add_argument("--source", default="hub")
    p.add_argument("--budget", type=float, default=None)
    p.add_argument("--seed", type=int, default=0, help="the harness's seed (run.py --seed)")
    p.add_argument("--eval-limit", type=float, default=None,
                   help="seconds the evaluation may take (run.py --eval-limit)")
    p.add_argument("--data-mount", default=None, help="where the lab's bucket is mounted")
    p.add_argument("--with", dest="requirements", action="append", default=[],
                   help="a requirement the job needs; installed only if the image lacks it")
    p.add_argument("--key-fd", type=int, default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    if args.mode == "prepare":
        return prepare_mode(args)
    if args.key_fd is None:
        stage_one(args, argv)  # does not return
    return stage_two(args)


if __name__ == "__main__":
    sys.exit(main())
