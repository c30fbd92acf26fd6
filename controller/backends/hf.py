"""The Hugging Face Jobs backend: one run = one managed-GPU job, found again by its labels.

For a lab with no cluster: each run is a job on Hugging Face's
infrastructure, created through `huggingface_hub`'s Jobs API (`run_job`,
`inspect_job`, `fetch_job_logs`, `cancel_job`, `list_jobs`), on the flavor,
timeout and namespace the Lab's `spec.hf` names and an Experiment's
`spec.hf` overrides.

What the job gets. The job has no copy of the lab, so the files travel in
the job spec: the lab's harness (`bench/*.py` next to `prepare.py`, the
surface replaced by the candidate) and `bench/hf_entry.py` from this
installation, as a deterministic xz-compressed tarball, base64 in the
environment: `AUTOLAB_BUNDLE`, then `AUTOLAB_BUNDLE_1`, `_2`, ... when it is
longer than BUNDLE_PART characters (one environment string must stay under
Linux's 128 KiB MAX_ARG_STRLEN), at most BUNDLE_LIMIT in all (the job spec
stays small). The command is `python3 -c BOOTSTRAP run ...`: unpack, exec the
entry point. Dependencies are declared in the command as `--with`
requirements; the entry point installs, with uv, only those the image lacks
(the default image is uv's Python image; a PyTorch image skips torch). The
lab's bucket is mounted read-only at DATA_MOUNT (`Volume(type="bucket")`,
huggingface_hub's way of giving a job a bucket); `autolab hf prepare` fills
it with a job that mounts it read-write.

What the controller believes. Only a log line signed with HMAC-SHA256 under
a key drawn for this run (see bench/hf_entry.py for how the job keeps the
key from the candidate). The key stays on this machine in
`.autolab/runs/<run>/result.key` (mode 0600) and travels as the job secret
`AUTOLAB_RESULT_KEY`; it never appears in a status, an event, the ledger or
a log we write. The signed payload names the run and carries the
candidate's sha1, both checked. No signed line: "no authentic result", an
infrastructure error (state `error`, ledger status `error`): nothing was
measured, so the experiment may run again. The job's step curve comes back
the same way, as lines signed under the same key (bench/hf_entry.py); its
verified points, each number checked and at most MAX_CURVE_POINTS, go to
`curve.jsonl` next to the run's `result.json`, where Trackio reads a local
run's curve. The curve is informational; the metric is the signed result's.

Watching a job, on a budget of API calls. Each inspection is a call, and the
Hub rate-limits tokens, so a running job is inspected at POLL_MIN_SECONDS
after a change of stage, then at doubling intervals up to POLL_MAX_SECONDS;
between inspections `observe` answers from what was last seen. Liveness
comes from the log instead: a daemon thread per running job follows its log
stream (`fetch_job_logs(follow=True)`: one long-lived call), keeping the end
of the log and our signed lines; when the stream ends or carries the signed
result, the job is inspected soon after. Once the job has ended, its result
is read from what the threads kept; a stream that stalls (no line for
LOG_STALL_SECONDS) or fails is read again without following, at most
LOG_READS times, and never holds up the controller's loop. A 429 makes every
call of this backend wait out its `Retry-After` (seconds or an HTTP date).
A 10-minute run costs about 20 calls (tests/test_hf_backend.py counts them).

Finding a run again. `.autolab/runs/<run>/hf.json` records the job id; a
controller that crashed between creating the job and recording it finds the
job through `list_jobs(labels={autolab-run: <run>, autolab-lab-id: <lab>})`
and adopts it, so a run is never launched twice. Hugging Face label keys
allow only letters, digits, '-' and '_', hence `autolab-run` rather than the
Kubernetes-style `autolab.dev/run`.

The token: huggingface_hub's normal lookup (HF_TOKEN, then `hf auth login`),
or one passed in (an operator reads the Lab's `tokenSecret` with
`token_from_secret`). Run jobs do not receive it at all: the bucket is
mounted by the platform and the candidate, which can reach the network,
must not hold credentials. Only the prepare job gets it, as a secret.
"""

from __future__ import annotations

import base64
import email.utils
import hashlib
import hmac
import io
import json
import lzma
import math
import os
import re
import secrets
import tarfile
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import httpx2
import yaml
from huggingface_hub import HfApi, Volume
from huggingface_hub.errors import HfHubHTTPError, JobNotFoundError
from huggingface_hub.utils import get_token

from controller.backends import BackendConfigError, RunRequest
from controller.lab.harness import HARNESS_FILES, pinned_harness
from controller.core.reconcile import RunObservation
from controller.core.spec import LabSpec, SpecError
from controller.lab.clock import iso
from controller.lab.repo import atomic_write
from controller.lab.paths import LabPaths

SYNTHETIC_SEED_ENV = "AUTOLAB_SYNTHETIC_SEED"  # bench/prepare.py reads it (a job secret, never the candidate's)

REPO_ROOT = Path(__file__).resolve().parents[2]
ENTRY_POINT = REPO_ROOT / "bench" / "hf_entry.py"

DEFAULT_IMAGE = "ghcr.io/astral-sh/uv:python3.12-bookworm"  # Python 3.12 with uv
DEFAULT_FLAVOR = "h200"
DEFAULT_TIMEOUT = "30m"
PREPARE_FLAVOR = "cpu-upgrade"
PREPARE_TIMEOUT = "2h"
DATA_MOUNT = "/autolab-data"
BUNDLE_ENV = "AUTOLAB_BUNDLE"
KEY_SECRET = "AUTOLAB_RESULT_KEY"
BUNDLE_PART = 96 * 1024    # characters of base64 in one environment variable
BUNDLE_LIMIT = 4 * BUNDLE_PART  # in all: the harness is ~80 KiB of it, the candidate the rest
RUN_REQUIREMENTS = ("torch>=2.4", "numpy>=1.26", "pyarrow>=14", "tokenizers>=0.19",
                    "huggingface_hub>=0.30")
PREPARE_REQUIREMENTS = tuple(r for r in RUN_REQUIREMENTS if not r.startswith("torch"))

LABEL_LAB = "autolab-lab"
LABEL_LAB_ID = "autolab-lab-id"
LABEL_RUN = "autolab-run"
LABEL_EXPERIMENT = "autolab-experiment"
LABEL_CAMPAIGN = "autolab-campaign"
LABEL_ROLE = "autolab-role"

SIGNED_LINE = re.compile(r"AUTOLAB_SIGNED_RESULT (v1) ([A-Za-z0-9_=-]+) ([0-9a-f]{64})")
CURVE_LINE = re.compile(r"AUTOLAB_SIGNED_CURVE (curve-v1) ([A-Za-z0-9_=-]+) ([0-9a-f]{64})")
RESULT_MARKER, CURVE_MARKER = "AUTOLAB_SIGNED_RESULT", "AUTOLAB_SIGNED_CURVE"
RESULT_STATES = {"succeeded": "succeeded", "failed": "failed", "error": "error"}
ACTIVE_STAGES = ("SCHEDULING", "RUNNING")

# What one read of a job's log keeps, whatever the candidate prints into it.
MAX_LOG_LINES = 20_000        # the end of the log, for log.txt
MAX_LINE_CHARS = 4096         # a longer line is cut in log.txt
MAX_MARKED_CHARS = 64 * 1024  # a longer line is no signed line of ours
MAX_RESULT_LINES = 64         # the last lines with the result marker (ours is the last)
MAX_CURVE_LINES = 256         # the last lines with the curve marker (ours: at most 100)
MAX_CURVE_POINTS = 5000       # bench/hf_entry.py CURVE_MAX_POINTS
CURVE_KEYS = ("loss", "tokens_per_sec", "time")
MAX_CURVE_STEP = 10**12

# The API budget (see "Watching a job" above).
POLL_MIN_SECONDS = 2.0    # the first inspection after a change of stage
POLL_MAX_SECONDS = 60.0   # the interval doubles up to this while nothing changes
RATE_LIMIT_SECONDS = 30.0  # the wait after a 429 without a usable Retry-After
RETRY_AFTER_MAX = 3600.0
LOG_STALL_SECONDS = 30.0  # a log read with no line for this long is stalled
LOG_RETRY_SECONDS = 5.0   # between two reads of one job's log
LOG_READS = 3             # reads of an ended job's log before it has no result

RUN_ENV = "AUTOLAB_RUN"  # the run's name, as bench/hf_entry.py reads it

# Unpack the bundle into a fresh directory and exec the entry point there. Runs as
# `python3 -c BOOTSTRAP ARGS...`, so sys.argv[1:] are the entry point's arguments.
BOOTSTRAP = (
    "import base64,io,os,sys,tarfile,tempfile\n"
    "d=tempfile.mkdtemp(prefix='autolab-job-')\n"
    f"b=os.environ.pop('{BUNDLE_ENV}');i=1\n"
    f"while '{BUNDLE_ENV}_%d'%i in os.environ:b+=os.environ.pop('{BUNDLE_ENV}_%d'%i);i+=1\n"
    "t=tarfile.open(fileobj=io.BytesIO(base64.b64decode(b)),mode='r:xz')\n"
    "t.extractall(d,**({'filter':'data'} if hasattr(tarfile,'data_filter') else {}))\n"
    "e=os.path.join(d,'bench','hf_entry.py')\n"
    "os.execv(sys.executable,[sys.executable,e]+sys.argv[1:])\n"
)


class HfBackendError(SpecError, BackendConfigError):
    """The lab's Hugging Face settings cannot work; the message says what to set."""


@dataclass(frozen=True)
class HfSettings:
    """The Lab's `spec.hf`, with an Experiment's overrides applied."""

    flavor: str
    timeout: str
    namespace: str | None
    bucket: str | None
    image: str

    @classmethod
    def resolve(cls, lab_hf: dict, overrides: dict | None = None) -> "HfSettings":
        o = overrides or {}
        return cls(flavor=o.get("flavor") or lab_hf.get("flavor") or DEFAULT_FLAVOR,
                   timeout=str(o.get("timeout") or lab_hf.get("timeout") or DEFAULT_TIMEOUT),
                   namespace=o.get("namespace") or lab_hf.get("namespace"),
                   bucket=lab_hf.get("bucket"), image=lab_hf.get("image") or DEFAULT_IMAGE)


def timeout_seconds(timeout: str) -> int:
    """'30m' -> 1800; the same units huggingface_hub accepts (s, m, h, d; bare = seconds)."""
    factors = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    t = str(timeout).strip()
    if t and t[-1] in factors:
        return int(float(t[:-1]) * factors[t[-1]])
    return int(float(t))


def _signed_payloads(lines: Iterable[str], pattern: re.Pattern, key: bytes,
                     run: str) -> Iterator[dict]:
    """The JSON objects of the lines `pattern` finds whose HMAC verifies under `key` and that
    name `run`, in order. `pattern`'s groups: version, base64 payload, hex MAC."""
    for line in lines:
        m = pattern.search(line)
        if not m:
            continue
        version, b64, mac = m.groups()
        want = hmac.new(key, f"{version} {b64}".encode(), hashlib.sha256).hexdigest()
        if not hmac.compare_digest(want, mac):
            continue
        try:
            payload = json.loads(base64.urlsafe_b64decode(b64.encode()))
        except ValueError:  # binascii.Error and JSONDecodeError are ValueErrors
            continue
        if isinstance(payload, dict) and payload.get("run") == run:
            yield payload


def verify_signed_result(lines: Iterable[str], key: bytes, run: str,
                         candidate_sha1: str | None = None) -> dict | None:
    """The harness result of the last line signed with `key` for `run` (and, when given, for
    the candidate with this sha1); None if no line is."""
    found = None
    for payload in _signed_payloads(lines, SIGNED_LINE, key, run):
        if not isinstance(payload.get("result"), dict):
            continue
        result = payload["result"]
        measured = result.get("candidate_sha1")
        # A measurement of another program is not this run's, whoever signed it. (A harness
        # that could not even read the candidate reports an error without a sha1.)
        if candidate_sha1 and measured != candidate_sha1 \
                and (measured is not None or result.get("status") == "succeeded"):
            continue
        found = result
    return found


def make_bundle(files: dict[str, bytes]) -> str:
    """An xz-compressed tarball of `files` (archive path -> bytes), base64; the same bytes every
    time. (xz: Python source packs ~15 % smaller than with gzip.)"""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(files):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(files[name]), 0o644, 0
            tar.addfile(info, io.BytesIO(files[name]))
    return base64.b64encode(lzma.compress(raw.getvalue(), preset=9)).decode()


def bundle_env(bundle: str) -> dict[str, str]:
    """The bundle in environment variables of at most BUNDLE_PART characters each, in the names
    BOOTSTRAP joins: AUTOLAB_BUNDLE, AUTOLAB_BUNDLE_1, ..."""
    parts = [bundle[i:i + BUNDLE_PART] for i in range(0, len(bundle), BUNDLE_PART)] or [""]
    return {BUNDLE_ENV if i == 0 else f"{BUNDLE_ENV}_{i}": part for i, part in enumerate(parts)}


def token_from_secret(name: str, namespace: str, core_api: Any = None) -> str:
    """In a cluster: the token in key HF_TOKEN of the Secret the Lab names (spec.hf.tokenSecret)."""
    if core_api is None:
        from kubernetes import client
        core_api = client.CoreV1Api()
    secret = core_api.read_namespaced_secret(name, namespace)
    data = (secret.data or {}).get("HF_TOKEN")
    if not data:
        raise HfBackendError(f"Secret {namespace}/{name} has no key HF_TOKEN; create it with "
                             f"`kubectl -n {namespace} create secret generic {name} "
                             "--from-literal=HF_TOKEN=hf_...`")
    return base64.b64decode(data).decode().strip()


class RateLimited(Exception):
    """Hugging Face answered 429 (now or recently): no call before `seconds` have passed."""

    def __init__(self, seconds: float):
        super().__init__(seconds)
        self.seconds = seconds

    def message(self) -> str:
        return (f"Hugging Face asked for fewer API calls (429); the next one in "
                f"{self.seconds:.0f} s")


def retry_after(response: Any, now: float) -> float | None:
    """Seconds to wait from a 429's `Retry-After`, in seconds or as an HTTP date; None if absent
    or unreadable. At most RETRY_AFTER_MAX (a wrong date must not stop the lab for days)."""
    headers = getattr(response, "headers", None) or {}
    value = str(headers.get("Retry-After") or headers.get("retry-after") or "").strip()
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when is None:
            return None
        seconds = when.timestamp() - now
    if seconds != seconds:  # NaN
        return None
    return min(max(seconds, 0.0), RETRY_AFTER_MAX)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _curve_point(p: Any) -> dict | None:
    """One point of a step curve, every number checked; None if it is not one."""
    if not isinstance(p, dict) or not _is_int(p.get("step")) \
            or not 0 <= p["step"] <= MAX_CURVE_STEP:
        return None
    point: dict[str, Any] = {"step": p["step"]}
    for k in CURVE_KEYS:
        v = p.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            point[k] = v
    return point if len(point) > 1 else None


def verify_signed_curve(lines: Iterable[str], key: bytes | None, run: str) -> list[dict]:
    """The step curve of the verified curve lines for `run` (bench/hf_entry.py sign_curve):
    its parts in order, every point checked, at most MAX_CURVE_POINTS. [] if none verifies."""
    if not key:
        return []
    parts: dict[int, list] = {}
    total = None
    for payload in _signed_payloads(lines, CURVE_LINE, key, run):
        part, n, points = payload.get("part"), payload.get("parts"), payload.get("points")
        if not (_is_int(part) and _is_int(n) and 0 <= part < n <= MAX_CURVE_LINES
                and isinstance(points, list)):
            continue
        if n != total:  # another curve (a second run of the harness?): the last one counts
            parts, total = {}, n
        parts[part] = points
    curve: list[dict] = []
    for i in sorted(parts):
        for p in parts[i]:
            point = _curve_point(p)
            if point is not None:
                curve.append(point)
            if len(curve) >= MAX_CURVE_POINTS:
                return curve
    return curve


@dataclass(frozen=True)
class _Poll:
    stage: str       # the stage the last inspection saw
    interval: float  # seconds from it to the next
    due: float
    at: float        # when it was made


class LogReader:
    """One read of a job's log in a daemon thread of its own, so no read holds up the loop.

    `fetch_job_logs` may block for minutes on a stream that says nothing (its read timeout
    is 120 s when following, 5 s when not) and cannot be interrupted; here it blocks only
    this thread. The reader keeps what the controller needs and no more, whatever the
    candidate prints: the last MAX_LOG_LINES lines (each cut to MAX_LINE_CHARS) and the last
    lines that carry one of our signed markers. Its times are the backend's clock.
    """

    def __init__(self, api: HfApi, job_id: str, namespace: str, *, follow: bool,
                 clock: Callable[[], float], on_rate_limit: Callable[[Exception], float]):
        self.api, self.job_id, self.namespace, self.follow = api, job_id, namespace, follow
        self.clock, self.on_rate_limit = clock, on_rate_limit
        self.tail: deque[str] = deque(maxlen=MAX_LOG_LINES)
        self.results: deque[str] = deque(maxlen=MAX_RESULT_LINES)
        self.curve: deque[str] = deque(maxlen=MAX_CURVE_LINES)
        self.count = 0
        self.started_at = clock()
        self.last_line_at: float | None = None
        self.result_at: float | None = None
        self.ended_at: float | None = None
        self.error: str | None = None
        self.timed_out = False  # it ended after a long silence: the read timed out
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._read, daemon=True,
                                        name=f"hf-log-{job_id[-8:]}")

    def start(self) -> "LogReader":
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self.ended_at is None

    def silent_for(self, now: float) -> float:
        return now - (self.last_line_at if self.last_line_at is not None else self.started_at)

    def snapshot(self) -> tuple[list[str], list[str], list[str]]:
        with self._lock:
            return list(self.tail), list(self.results), list(self.curve)

    def trouble(self, now: float, stall_seconds: float) -> str | None:
        """What went wrong with this read, in words; None if it ended normally."""
        if self.alive and self.silent_for(now) >= stall_seconds:
            return f"the log stream stalled: no line for {self.silent_for(now):.0f} s"
        if self.error:
            return f"reading it failed: {self.error}"
        if self.timed_out:
            return "the log stream went silent until the read timed out"
        return None

    def _read(self) -> None:
        quiet = time.monotonic()
        try:
            for line in self.api.fetch_job_logs(job_id=self.job_id, namespace=self.namespace,
                                                follow=self.follow):
                quiet = time.monotonic()
                self._take(line)
        except HfHubHTTPError as e:
            if _status_code(e) == 429:
                self.on_rate_limit(e)
            self.error = f"{_status_code(e)} {_server_message(e)}"
        except Exception as e:  # noqa: BLE001 - whatever the stream does, the read ends
            self.error = f"{type(e).__name__}: {e}"
        finally:
            # The client ends a silent no-follow read after 5 s (a followed one after 120 s).
            self.timed_out = time.monotonic() - quiet >= (100.0 if self.follow else 4.5)
            self.ended_at = self.clock()

    def _take(self, line: str) -> None:
        line = line.rstrip("\n")
        now = self.clock()
        with self._lock:
            self.count += 1
            self.last_line_at = now
            if len(line) <= MAX_MARKED_CHARS:
                if RESULT_MARKER in line:
                    self.results.append(line)
                    self.result_at = now
                elif CURVE_MARKER in line:
                    self.curve.append(line)
            self.tail.append(line if len(line) <= MAX_LINE_CHARS
                             else line[:MAX_LINE_CHARS] + " [line cut]")


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _status_code(e: Exception) -> int | None:
    response = getattr(e, "response", None)
    return getattr(response, "status_code", None)


def _server_message(e: Exception) -> str:
    """What the server said (huggingface_hub keeps it as `server_message`), else the error's
    last line."""
    said = (getattr(e, "server_message", None) or "").strip()
    if said:
        return " ".join(said.split())
    text = str(e).strip().splitlines()
    return text[-1] if text else type(e).__name__


def refusal_message(e: Exception, what: str, namespace: str | None) -> str:
    """A 401 or 403 from Hugging Face, told with the server's words and the fix."""
    code, said = _status_code(e), _server_message(e)
    if code == 401:
        return (f"Hugging Face rejected the token when asked to {what} (401: {said}); log in "
                "again with `hf auth login` or set HF_TOKEN to a valid token; `autolab hf "
                "preflight` checks it")
    where = f"namespace {namespace}" if namespace else "the jobs' namespace"
    return (f"Hugging Face refused to {what} in {where} (403: {said}). The token may not run "
            f"jobs there: use a token with write access to {namespace or 'it'} (a fine-grained "
            "token needs the permission to start and manage Jobs for that user or "
            "organisation, and for an organisation its user must be a member allowed to), log "
            "in with it (`hf auth login`, or HF_TOKEN), or set spec.hf.namespace in lab.yaml "
            "(or the Experiment's spec.hf.namespace) to a namespace the token may use, such as "
            "its own user; `autolab hf preflight` checks it")


class HfBackend:
    """Runs, observes and cancels bench runs as Hugging Face jobs (see the module docstring)."""

    name = "hf"
    result_grace_seconds = 30.0  # after the job ends, how long to wait for its signed line
    submit_grace_seconds = 60.0  # after a submission of unknown outcome, how long to look for it
    poll_min_seconds = POLL_MIN_SECONDS
    poll_max_seconds = POLL_MAX_SECONDS
    log_stall_seconds = LOG_STALL_SECONDS
    log_retry_seconds = LOG_RETRY_SECONDS
    log_reads = LOG_READS

    def __init__(self, lab: LabSpec, lab_root: str | Path, *, lab_name: str, lab_id: str,
                 token: str | None = None, endpoint: str | None = None):
        self.lab = lab
        self.root = Path(lab_root).resolve()
        self.runs = LabPaths.of(self.root).state / "runs"
        self.lab_name = lab_name
        self.lab_id = lab_id
        self._token = token
        self.api = HfApi(endpoint=endpoint, token=token)
        self._whoami: dict | None = None
        self.clock: Callable[[], float] = time.time  # a test's clock may stand in
        self._lock = threading.RLock()  # the operator observes from several threads
        self._quiet_until = 0.0  # no API call before (a 429's Retry-After)
        self._polls: dict[str, _Poll] = {}
        self._readers: dict[str, list[LogReader]] = {}

    @classmethod
    def from_lab(cls, lab: LabSpec, lab_root: Path, *, token: str | None = None,
                 endpoint: str | None = None, lab_name: str | None = None) -> "HfBackend":
        """The backend of a lab directory. The endpoint is $HF_ENDPOINT read now (not at import)."""
        root = Path(lab_root).resolve()
        if lab_name is None:
            try:
                doc = yaml.safe_load((root / "lab.yaml").read_text()) or {}
                lab_name = str((doc.get("metadata") or {}).get("name") or "default")
            except (OSError, yaml.YAMLError):
                lab_name = "default"
        # The seed commit tells two labs of the same name apart (same namespace, same names).
        seed = ""
        try:
            history = json.loads(LabPaths.of(root).master_file.read_text())
            seed = (history.get("history") or [{}])[0].get("commit", "")
        except (OSError, ValueError):
            pass
        lab_id = seed[:12] or hashlib.sha1(str(root).encode()).hexdigest()[:12]
        return cls(lab, root, lab_name=lab_name, lab_id=lab_id, token=token,
                   endpoint=endpoint or os.environ.get("HF_ENDPOINT") or None)

    # -- local records -------------------------------------------------------------------------
    def run_dir(self, run: str) -> Path:
        return self.runs / run

    def log_path(self, run: str) -> Path:
        return self.run_dir(run) / "log.txt"

    def slot_of(self, run: str) -> str | None:
        return _read_json(self.run_dir(run) / "hf.json").get("slot")

    def record(self, run: str) -> dict:
        """What this machine knows of the run's job: hf.json (job id, namespace, flavor, ...)."""
        return _read_json(self.run_dir(run) / "hf.json")

    def _write_record(self, run: str, rec: dict) -> None:
        atomic_write(self.run_dir(run) / "hf.json", json.dumps(rec, indent=2, sort_keys=True) + "\n")

    def _key(self, run: str, create: bool = False) -> bytes | None:
        path = self.run_dir(run) / "result.key"
        if path.exists():
            return path.read_bytes().strip()
        if not create:
            return None
        path.parent.mkdir(parents=True, exist_ok=True)
        key = secrets.token_hex(32).encode()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(key)
        return key

    def _conclude(self, run: str, state: str, message: str, result: dict | None = None,
                  rec: dict | None = None) -> RunObservation:
        """Write the run's final observation once; later observes read it, not the API."""
        rec = rec if rec is not None else self.record(run)
        final = {"state": state, "message": message, "result": result,
                 "jobId": rec.get("jobId", ""), "worker": self._worker(rec)}
        atomic_write(self.run_dir(run) / "final.json", json.dumps(final, indent=2) + "\n")
        with self._lock:  # its reads end by themselves; nothing more is asked about it
            self._polls.pop(run, None)
            self._readers.pop(run, None)
        return self._from_final(run, final)

    def _from_final(self, run: str, final: dict) -> RunObservation:
        return RunObservation(run, final["state"], result=final.get("result"),
                              message=final.get("message", ""), job_id=final.get("jobId", ""),
                              worker=final.get("worker", ""))

    @staticmethod
    def _worker(rec: dict) -> str:
        return f"hf:{rec.get('namespace', '')}:{rec.get('flavor', '')}" if rec.get("jobId") else ""

    # -- identity --------------------------------------------------------------------------------
    def token(self) -> str | None:
        """The token in use (never printed): the one given, else huggingface_hub's lookup."""
        return self._token or get_token()

    def whoami(self) -> dict:
        if self._whoami is None:
            self._whoami = self.api.whoami()
        return self._whoami

    def settings(self, overrides: dict | None = None) -> HfSettings:
        return HfSettings.resolve(self.lab.hf, overrides)

    def namespace(self, settings: HfSettings) -> str:
        return settings.namespace or self.whoami()["name"]

    def bucket_id(self, settings: HfSettings, namespace: str) -> str | None:
        if not settings.bucket:
            return None
        return settings.bucket if "/" in settings.bucket else f"{namespace}/{settings.bucket}"

    def _require_token(self) -> None:
        if not self.token():
            raise HfBackendError("no Hugging Face token: set HF_TOKEN or run `hf auth login` "
                                 "(a token with write access to the jobs' namespace); "
                                 "`autolab hf preflight` checks the setup")

    def _auth_error(self, e: Exception, what: str, namespace: str | None) -> HfBackendError:
        return HfBackendError(refusal_message(e, what, namespace))

    # -- the job spec ------------------------------------------------------------------------------
    def bench_files(self, candidate_source: str) -> dict[str, bytes]:
        """What the job needs: the pinned harness (the lab's first commit's, never its editable
        bench/), the candidate as the surface, the entry point."""
        pinned = pinned_harness(self.root)
        files = {f"bench/{name}": (pinned / name).read_bytes() for name in HARNESS_FILES}
        files["bench/train.py"] = candidate_source.encode()  # the name the entry point runs
        files["bench/hf_entry.py"] = ENTRY_POINT.read_bytes()
        return files

    def labels(self, run: str, experiment: str, campaign: str, role: str) -> dict[str, str]:
        out = {LABEL_LAB: self.lab_name, LABEL_LAB_ID: self.lab_id, LABEL_RUN: run,
               LABEL_EXPERIMENT: experiment, LABEL_ROLE: role}
        if campaign:
            out[LABEL_CAMPAIGN] = campaign
        return out

    def run_job_args(self, req: RunRequest, settings: HfSettings, namespace: str,
                     key: bytes) -> dict[str, Any]:
        """The keyword arguments of HfApi.run_job for one measured run."""
        bundle = make_bundle(self.bench_files(req.candidate_source))
        if len(bundle) > BUNDLE_LIMIT:
            raise BundleTooLarge(f"the job bundle (harness + candidate) is {len(bundle) // 1024} "
                                 f"KiB of base64, over the {BUNDLE_LIMIT // 1024} KiB limit of a job's "
                                 "environment; make train.py smaller")
        # The run's name goes in the environment, not the command: where the candidate runs as
        # another uid in the job's container (uid mode), every process's command line is open
        # to it, and a pair run's name (`-p3`) would tell it its place among its pair runs.
        command = ["python3", "-c", BOOTSTRAP, "run", "--profile", req.profile,
                   "--source", req.data]
        if req.budget_seconds:
            command += ["--budget", str(req.budget_seconds)]
        if req.seed:
            command += ["--seed", str(req.seed)]
        if req.eval_limit:
            command += ["--eval-limit", f"{req.eval_limit:g}"]
        bucket = self.bucket_id(settings, namespace)
        volumes = None
        if bucket:
            command += ["--data-mount", DATA_MOUNT]
            volumes = [Volume(type="bucket", source=bucket, mount_path=DATA_MOUNT, read_only=True)]
        for r in RUN_REQUIREMENTS:
            command += ["--with", r]
        role = "baseline" if req.experiment == "baseline" else "run"
        return dict(image=settings.image, command=command,
                    env={**bundle_env(bundle), "PYTHONUNBUFFERED": "1", RUN_ENV: req.run},
                    secrets={KEY_SECRET: key.decode(), **self.synthetic_secret(req.data)}, flavor=settings.flavor,
                    timeout=settings.timeout, name=req.run,
                    labels=self.labels(req.run, req.experiment, req.campaign, role),
                    volumes=volumes, namespace=namespace)

    def synthetic_secret(self, data: str) -> dict[str, str]:
        """For synthetic data, the lab's secret validation seed (bench/prepare.py synthetic_seed),
        so every job of the lab scores the same validation text and no candidate can regenerate it."""
        if data != "synthetic":
            return {}
        path = LabPaths.of(self.root).state / "synthetic.seed"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(secrets.token_hex(16) + "\n")
            except FileExistsError:
                pass
        return {SYNTHETIC_SEED_ENV: path.read_text().strip()}

    # -- the Backend seam --------------------------------------------------------------------------
    def submit(self, req: RunRequest) -> RunObservation:
        d = self.run_dir(req.run)
        if (d / "final.json").exists() or self.record(req.run).get("jobId"):
            return self.observe(req.run)  # adopt: never start a run twice
        if req.data.startswith("dir:"):
            raise HfBackendError(f"the lab's data source {req.data} is a path on this machine; a "
                                 "Hugging Face job cannot read it. Use `data: hub` (and run "
                                 "`autolab hf prepare` once) or `data: synthetic` in lab.yaml")
        self._require_token()
        settings = self.settings(req.overrides)
        namespace = settings.namespace
        try:
            namespace = self.namespace(settings)
            adopted = self._adopt(req.run, namespace)
        except RateLimited as e:
            return RunObservation(req.run, "queued", message=e.message())
        except HfHubHTTPError as e:
            if _status_code(e) in (401, 403):
                raise self._auth_error(e, "list the jobs", namespace) from None
            return RunObservation(req.run, "queued", message=f"cannot reach Hugging Face Jobs "
                                                             f"({_server_message(e)}); retrying")
        except httpx2.HTTPError as e:
            return RunObservation(req.run, "queued", message=f"cannot reach Hugging Face Jobs "
                                                             f"({e}); retrying")
        if adopted is not None:
            return self.observe(req.run)
        rec = self.record(req.run)
        since = rec.get("submittingSince")
        if since and self.clock() - since < self.submit_grace_seconds:
            # A submission whose answer was lost may not be listed yet: look again before
            # creating another.
            return RunObservation(req.run, "queued", message="confirming the submission of "
                                                             f"job {req.run}")
        key = self._key(req.run, create=True)
        try:
            args = self.run_job_args(req, settings, namespace, key)
        except BundleTooLarge as e:
            return self._conclude(req.run, "error", str(e), rec={})
        rec = {"namespace": namespace, "flavor": settings.flavor, "timeout": settings.timeout,
               "slot": req.slot, "experiment": req.experiment, "submittingSince": self.clock(),
               "candidateSha1": hashlib.sha1(req.candidate_source.encode()).hexdigest()}
        self._write_record(req.run, rec)
        try:
            job = self._call(lambda: self.api.run_job(**args))
        except RateLimited as e:
            return RunObservation(req.run, "queued", message=e.message())
        except HfHubHTTPError as e:
            code = _status_code(e)
            if code in (401, 403):
                self._write_record(req.run, {k: v for k, v in rec.items()
                                             if k != "submittingSince"})
                raise self._auth_error(e, "create the job", namespace) from None
            if code is not None and 400 <= code < 500 and code != 429:
                return self._conclude(req.run, "error", f"Hugging Face refused the job ({code}): "
                                                        f"{_server_message(e)}", rec=rec)
            return RunObservation(req.run, "queued", message=f"submitting to Hugging Face Jobs "
                                                             f"failed ({_server_message(e)}); "
                                                             "retrying")
        except httpx2.HTTPError as e:
            return RunObservation(req.run, "queued", message=f"submitting to Hugging Face Jobs "
                                                             f"failed ({e}); retrying")
        rec.update(jobId=job.id, url=job.url, submittedAt=iso(self.clock()))
        rec.pop("submittingSince", None)
        self._write_record(req.run, rec)
        stage = str(getattr(job.status.stage, "value", job.status.stage))
        self._schedule(req.run, stage)
        return self._from_stage(req.run, rec, stage, job.status.message)

    def _adopt(self, run: str, namespace: str) -> dict | None:
        """Record the job already created for `run` (found by its labels), if there is one."""
        jobs = self._call(lambda: list(self.api.list_jobs(
            namespace=namespace, labels={LABEL_RUN: run, LABEL_LAB_ID: self.lab_id})))
        if not jobs:
            return None
        job = max(jobs, key=lambda j: (j.created_at is not None, j.created_at or 0))
        rec = self.record(run)
        rec.update(jobId=job.id, url=job.url, namespace=namespace, adopted=True,
                   flavor=str(job.flavor or rec.get("flavor", "")))
        rec.pop("submittingSince", None)
        self._write_record(run, rec)
        return rec

    def observe(self, run: str) -> RunObservation:
        d = self.run_dir(run)
        final = _read_json(d / "final.json")
        if final:
            return self._from_final(run, final)
        rec = self.record(run)
        try:
            if not rec.get("jobId"):
                if not rec and not d.exists():
                    return RunObservation(run, "missing")
                namespace = rec.get("namespace") or self.namespace(self.settings())
                rec = self._adopt(run, namespace) or {}
                if not rec.get("jobId"):
                    return RunObservation(run, "missing")
            stage = rec.get("stage", "")
            if stage in ("COMPLETED", "ERROR"):  # ended: only its log is left to read
                return self._read_result(run, rec, stage, rec.get("stageMessage") or "")
            if stage in ACTIVE_STAGES and not self._poll_due(run):
                return self._from_stage(run, rec, stage, None)
            job = self._call(lambda: self.api.inspect_job(job_id=rec["jobId"],
                                                          namespace=rec["namespace"]))
        except RateLimited as e:
            return self._last_known(run, rec, e.message())
        except JobNotFoundError:
            return self._conclude(run, "lost", f"job {rec.get('jobId')} no longer exists on "
                                               "Hugging Face", rec=rec)
        except HfHubHTTPError as e:
            if _status_code(e) in (401, 403):
                raise self._auth_error(e, "show the job", rec.get("namespace")) from None
            return self._last_known(run, rec, f"cannot reach Hugging Face Jobs "
                                              f"({_server_message(e)})")
        except httpx2.HTTPError as e:
            return self._last_known(run, rec, f"cannot reach Hugging Face Jobs ({e})")
        stage = str(getattr(job.status.stage, "value", job.status.stage))
        self._schedule(run, stage)
        return self._from_stage(run, rec, stage, job.status.message)

    def _last_known(self, run: str, rec: dict, message: str) -> RunObservation:
        state = {"RUNNING": "running"}.get(rec.get("stage", ""), "queued")
        return RunObservation(run, state, message=message, job_id=rec.get("jobId", ""),
                              worker=self._worker(rec))

    def _from_stage(self, run: str, rec: dict, stage: str, message: str | None) -> RunObservation:
        stage = str(getattr(stage, "value", stage))
        if rec.get("stage") != stage:
            rec["stage"] = stage
            if message:
                rec["stageMessage"] = message
            self._write_record(run, rec)
        job_id, worker = rec.get("jobId", ""), self._worker(rec)
        if stage == "SCHEDULING":
            return RunObservation(run, "queued", job_id=job_id, worker=worker,
                                  message=f"Job {job_id} waits for a {rec.get('flavor')} machine "
                                          f"({rec.get('url', '')}).")
        if stage == "RUNNING":
            self._follow(run, rec)
            return RunObservation(run, "running", job_id=job_id, worker=worker)
        if stage in ("COMPLETED", "ERROR"):
            return self._read_result(run, rec, stage, message or "")
        if stage == "CANCELED":
            return self._conclude(run, "cancelled", f"job {job_id} was cancelled"
                                  + (f": {message}" if message else ""), rec=rec)
        if stage == "DELETED":
            return self._conclude(run, "cancelled", f"job {job_id} was deleted"
                                  + (f": {message}" if message else ""), rec=rec)
        return RunObservation(run, "queued", job_id=job_id, worker=worker,
                              message=f"job {job_id} is in stage {stage}")

    # -- the API budget --------------------------------------------------------------------------
    def _call(self, fn: Callable[[], Any]) -> Any:
        """One API call, unless Hugging Face asked us to wait (429): then RateLimited, no call."""
        wait = self._quiet_until - self.clock()
        if wait > 0:
            raise RateLimited(wait)
        try:
            return fn()
        except HfHubHTTPError as e:
            if _status_code(e) == 429:
                raise RateLimited(self._rate_limited(e)) from None
            raise

    def _rate_limited(self, e: Exception) -> float:
        """Note a 429: no call of this backend goes out before its Retry-After has passed."""
        wait = retry_after(getattr(e, "response", None), self.clock())
        wait = RATE_LIMIT_SECONDS if wait is None else wait
        with self._lock:
            self._quiet_until = max(self._quiet_until, self.clock() + wait)
        return wait

    def _schedule(self, run: str, stage: str) -> None:
        """The next inspection of the run's job: soon after a change of stage, then ever later."""
        now = self.clock()
        with self._lock:
            last = self._polls.get(run)
            interval = self.poll_min_seconds if last is None or last.stage != stage \
                else min(last.interval * 2, self.poll_max_seconds)
            self._polls[run] = _Poll(stage, interval, now + interval, now)

    def _poll_due(self, run: str) -> bool:
        """Whether to inspect the job now: when its time has come, or soon after its log
        stream ended or carried the signed result (the job is ending: its stage lags a little)."""
        now = self.clock()
        with self._lock:
            if now < self._quiet_until:
                return False
            poll = self._polls.get(run)
            if poll is None:
                return True
            due = poll.due
            for r in self._readers.get(run, []):
                for seen in (r.ended_at, r.result_at):
                    if seen is not None and seen > poll.at:
                        due = min(due, seen + self.poll_min_seconds)
            return now >= due

    # -- the job's log ---------------------------------------------------------------------------
    def _start_reader(self, run: str, rec: dict, follow: bool) -> "LogReader":
        reader = LogReader(self.api, rec["jobId"], rec["namespace"], follow=follow,
                           clock=self.clock, on_rate_limit=self._rate_limited)
        with self._lock:
            self._readers.setdefault(run, []).append(reader)
        return reader.start()

    def _follow(self, run: str, rec: dict) -> None:
        """Keep one thread following the running job's log (its lines, and its liveness)."""
        now = self.clock()
        with self._lock:
            readers = self._readers.get(run, [])
            if any(r.alive for r in readers) or now < self._quiet_until:
                return
            if readers and now - (readers[-1].ended_at or now) < self.log_retry_seconds:
                return
        self._start_reader(run, rec, follow=True)

    def _read_result(self, run: str, rec: dict, stage: str, message: str) -> RunObservation:
        """The job has ended: its result is the signed line in its log, read by the threads."""
        key = self._key(run)
        now = self.clock()
        if "terminalSeenAt" not in rec:
            rec["terminalSeenAt"] = now
            self._write_record(run, rec)
        with self._lock:
            readers = list(self._readers.get(run, []))
        for r in readers:
            tail, results, curve = r.snapshot()
            result = verify_signed_result(results, key, run, rec.get("candidateSha1")) \
                if key else None
            if result is not None:
                return self._conclude_result(run, rec, result, tail,
                                             verify_signed_curve(curve, key, run), key)
        fresh = [r for r in readers if r.alive and r.silent_for(now) < self.log_stall_seconds]
        if not fresh and len(readers) < self.log_reads and now >= self._quiet_until \
                and (not readers or now - readers[-1].started_at >= self.log_retry_seconds):
            fresh = [self._start_reader(run, rec, follow=False)]  # read the whole log again
        if fresh or now - rec["terminalSeenAt"] < self.result_grace_seconds:
            return RunObservation(run, "running", job_id=rec.get("jobId", ""),
                                  worker=self._worker(rec),
                                  message="reading the signed result from the job's logs")
        if readers:
            best = max(readers, key=lambda r: r.count)
            self._save_log(run, best.snapshot()[0], key)
        return self._conclude(run, "error", self._no_result(run, rec, stage, message, readers,
                                                            key, now), rec=rec)

    def _no_result(self, run: str, rec: dict, stage: str, message: str,
                   readers: list["LogReader"], key: bytes | None, now: float) -> str:
        """Why the run has no authentic result. Never the candidate's failure: whatever went
        wrong, nothing was measured, so the experiment may run again (ledger status error)."""
        job = rec.get("jobId")
        if key is None:
            return (f"no authentic result: this run's result key is not on this machine "
                    f"({self.run_dir(run) / 'result.key'}), so nothing in job {job}'s logs can "
                    "be trusted")
        troubles = [r.trouble(now, self.log_stall_seconds) for r in readers]
        troubles = [t for t in troubles if t]
        if troubles or not readers:
            what = "; ".join(dict.fromkeys(troubles)) or "no read of it could start"
            return (f"no authentic result: job {job} ended ({stage}) but its log did not come "
                    f"back whole ({what}), so its signed result was never read. Nothing was "
                    "measured; the experiment may run again")
        if stage == "ERROR":
            return (f"job {job} ended in ERROR ({message or 'no message'}) with no authentic "
                    f"result; see {self.log_path(run)}")
        return (f"no authentic result: job {job} completed but its log holds no result line "
                "signed with this run's key (a line the candidate printed does not count); "
                f"see {self.log_path(run)}")

    def _conclude_result(self, run: str, rec: dict, result: dict, tail: list[str],
                         curve: list[dict], key: bytes) -> RunObservation:
        """A verified result: its curve (if one came back) next to it, as local runs keep it."""
        result = dict(result)
        result["curve"] = None  # a path inside the job means nothing here
        if curve:
            path = self.run_dir(run) / "curve.jsonl"
            atomic_write(path, "".join(json.dumps(p) + "\n" for p in curve))
            result["curve"] = str(path)
        atomic_write(self.run_dir(run) / "result.json", json.dumps(result) + "\n")  # Trackio's
        self._save_log(run, tail, key)
        state = RESULT_STATES.get(result.get("status"), "failed")
        return self._conclude(run, state, result.get("reason", ""), result, rec=rec)

    def _save_log(self, run: str, tail: list[str], key: bytes | None) -> None:
        """log.txt: the end of the job's log, token and key blanked out."""
        text = "".join(line + "\n" for line in tail)
        for s in (self.token(), key.decode() if key else None):
            if s:
                text = text.replace(s, "[redacted]")
        atomic_write(self.log_path(run), text)

    def cleanup(self, run: str) -> None:
        """Nothing to remove: the run's directory (log, result) stays as its record."""

    def leftovers(self, run: str) -> bool:
        return False

    def cancel(self, run: str) -> RunObservation:
        obs = self.observe(run)
        if obs.state not in ("queued", "running"):
            return obs
        rec = self.record(run)
        try:
            if not rec.get("jobId") and rec.get("namespace"):
                rec = self._adopt(run, rec["namespace"]) or rec
            if not rec.get("jobId"):
                since = rec.get("submittingSince")
                if since and self.clock() - since < self.submit_grace_seconds:
                    return obs  # a job may have been created: cancel it once it shows up
                return self._conclude(run, "cancelled", "cancelled before a job was created",
                                      rec=rec)
            if rec.get("terminalSeenAt"):
                return obs  # it ended; its result is being read
            self._call(lambda: self.api.cancel_job(job_id=rec["jobId"],
                                                   namespace=rec["namespace"]))
        except JobNotFoundError:
            return self._conclude(run, "cancelled", f"job {rec.get('jobId')} is gone", rec=rec)
        except RateLimited:
            return obs
        except HfHubHTTPError as e:
            if _status_code(e) in (401, 403):
                raise self._auth_error(e, "cancel the job", rec.get("namespace")) from None
            return obs
        except httpx2.HTTPError:
            return obs
        return self._conclude(run, "cancelled", f"cancelled by the user: job {rec['jobId']} "
                                                "was cancelled on Hugging Face", rec=rec)

    # -- lab-wide views (autolab hf ...) -----------------------------------------------------------
    def lab_jobs(self, namespace: str, active_only: bool = False) -> list:
        status = list(ACTIVE_STAGES) if active_only else None
        return list(self.api.list_jobs(namespace=namespace, status=status,
                                       labels={LABEL_LAB_ID: self.lab_id}))

    def submit_prepare(self, source: str, flavor: str = PREPARE_FLAVOR,
                       timeout: str = PREPARE_TIMEOUT):
        """Start the one-time job that fills the bucket's data cache; returns its JobInfo."""
        self._require_token()
        settings = self.settings()
        namespace = self.namespace(settings)
        bucket = self.bucket_id(settings, namespace)
        if not bucket:
            raise HfBackendError("the Lab has no spec.hf.bucket to prepare; create a private "
                                 "bucket (`hf buckets create NAME --private`) and name it in "
                                 "lab.yaml under spec.hf.bucket")
        if source.startswith("dir:"):
            raise HfBackendError(f"{source} is a path on this machine; a job cannot read it "
                                 "(use hub or synthetic)")
        pinned = pinned_harness(self.root)
        files = {f"bench/{name}": (pinned / name).read_bytes() for name in HARNESS_FILES}
        files["bench/hf_entry.py"] = ENTRY_POINT.read_bytes()
        command = ["python3", "-c", BOOTSTRAP, "prepare", "--profile", self.lab.profile,
                   "--source", source, "--data-mount", DATA_MOUNT]
        for r in PREPARE_REQUIREMENTS:
            command += ["--with", r]
        job_secrets = {}
        token = self.token()
        if token:
            job_secrets["HF_TOKEN"] = token  # downloads; only the fixed harness runs here
        labels = {LABEL_LAB: self.lab_name, LABEL_LAB_ID: self.lab_id, LABEL_ROLE: "prepare"}
        return self.api.run_job(
            image=settings.image, command=command,
            env={**bundle_env(make_bundle(files)), "PYTHONUNBUFFERED": "1"}, secrets=job_secrets,
            flavor=flavor, timeout=timeout, name=f"autolab-prepare-{self.lab_name}"[:60],
            labels=labels, namespace=namespace,
            volumes=[Volume(type="bucket", source=bucket, mount_path=DATA_MOUNT,
                            read_only=False)])


class BundleTooLarge(ValueError):
    pass
