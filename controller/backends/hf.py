"""The Hugging Face Jobs backend: one run = one managed-GPU job, found again by its labels.

For a lab with no cluster: each run is a job on Hugging Face's
infrastructure, created through `huggingface_hub`'s Jobs API (`run_job`,
`inspect_job`, `fetch_job_logs`, `cancel_job`, `list_jobs`), on the flavor,
timeout and namespace the Lab's `spec.hf` names and an Experiment's
`spec.hf` overrides.

What the job gets. The job has no copy of the lab, so the files travel in
the job spec: the lab's harness (`bench/*.py` next to `prepare.py`, the
surface replaced by the candidate) and `bench/hf_entry.py` from this
installation, as a deterministic gzipped tarball, base64 in the environment
variable `AUTOLAB_BUNDLE` (at most BUNDLE_LIMIT characters: one environment
string must stay under Linux's 128 KiB MAX_ARG_STRLEN, and the job spec
small). The command is `python3 -c BOOTSTRAP run ...`: unpack, exec the
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
candidate's sha1, both checked. No signed line: "no authentic result".

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
import gzip
import hashlib
import hmac
import io
import json
import os
import re
import secrets
import tarfile
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

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
BUNDLE_LIMIT = 96 * 1024  # characters of base64
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
RESULT_STATES = {"succeeded": "succeeded", "failed": "failed", "error": "error"}
ACTIVE_STAGES = ("SCHEDULING", "RUNNING")
MAX_LOG_LINES = 20_000

# Unpack the bundle into a fresh directory and exec the entry point there. Runs as
# `python3 -c BOOTSTRAP ARGS...`, so sys.argv[1:] are the entry point's arguments.
BOOTSTRAP = (
    "import base64,io,os,sys,tarfile,tempfile\n"
    "d=tempfile.mkdtemp(prefix='autolab-job-')\n"
    f"t=tarfile.open(fileobj=io.BytesIO(base64.b64decode(os.environ.pop('{BUNDLE_ENV}'))),"
    "mode='r:gz')\n"
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


def verify_signed_result(lines: Iterable[str], key: bytes, run: str,
                         candidate_sha1: str | None = None) -> dict | None:
    """The harness result of the last line signed with `key` for `run` (and, when given, for
    the candidate with this sha1); None if no line is."""
    found = None
    for line in lines:
        m = SIGNED_LINE.search(line)
        if not m:
            continue
        version, b64, mac = m.groups()
        want = hmac.new(key, f"{version} {b64}".encode(), hashlib.sha256).hexdigest()
        if not hmac.compare_digest(want, mac):
            continue
        try:
            payload = json.loads(base64.urlsafe_b64decode(b64.encode()))
        except ValueError:
            continue
        if not isinstance(payload, dict) or payload.get("run") != run \
                or not isinstance(payload.get("result"), dict):
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
    """A gzipped tarball of `files` (archive path -> bytes), base64; the same bytes every time."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(files):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(files[name]), 0o644, 0
            tar.addfile(info, io.BytesIO(files[name]))
    return base64.b64encode(gzip.compress(raw.getvalue(), mtime=0)).decode()


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


def _now() -> float:
    return time.time()


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _status_code(e: Exception) -> int | None:
    response = getattr(e, "response", None)
    return getattr(response, "status_code", None)


def _server_message(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[-1] if text else type(e).__name__


class HfBackend:
    """Runs, observes and cancels bench runs as Hugging Face jobs (see the module docstring)."""

    name = "hf"
    result_grace_seconds = 30.0  # after the job ends, how long to wait for its signed line
    submit_grace_seconds = 60.0  # after a submission of unknown outcome, how long to look for it

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

    def _auth_error(self, e: Exception, what: str) -> HfBackendError:
        return HfBackendError(f"Hugging Face refused to {what} ({_status_code(e)}): "
                              f"{_server_message(e)}; check the token (HF_TOKEN or `hf auth "
                              "login`) and that it may run jobs in the namespace")

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
                                 f"KiB of base64, over the {BUNDLE_LIMIT // 1024} KiB limit of one "
                                 "environment variable; make train.py smaller")
        command = ["python3", "-c", BOOTSTRAP, "run", "--run", req.run, "--profile", req.profile,
                   "--source", req.data]
        if req.budget_seconds:
            command += ["--budget", str(req.budget_seconds)]
        if req.seed:
            command += ["--seed", str(req.seed)]
        bucket = self.bucket_id(settings, namespace)
        volumes = None
        if bucket:
            command += ["--data-mount", DATA_MOUNT]
            volumes = [Volume(type="bucket", source=bucket, mount_path=DATA_MOUNT, read_only=True)]
        for r in RUN_REQUIREMENTS:
            command += ["--with", r]
        role = "baseline" if req.experiment == "baseline" else "run"
        return dict(image=settings.image, command=command,
                    env={BUNDLE_ENV: bundle, "PYTHONUNBUFFERED": "1"},
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
        try:
            namespace = self.namespace(settings)
            adopted = self._adopt(req.run, namespace)
        except HfHubHTTPError as e:
            if _status_code(e) in (401, 403):
                raise self._auth_error(e, "list the jobs") from None
            return RunObservation(req.run, "queued", message=f"cannot reach Hugging Face Jobs "
                                                             f"({_server_message(e)}); retrying")
        except httpx2.HTTPError as e:
            return RunObservation(req.run, "queued", message=f"cannot reach Hugging Face Jobs "
                                                             f"({e}); retrying")
        if adopted is not None:
            return self.observe(req.run)
        rec = self.record(req.run)
        since = rec.get("submittingSince")
        if since and _now() - since < self.submit_grace_seconds:
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
               "slot": req.slot, "experiment": req.experiment, "submittingSince": _now(),
               "candidateSha1": hashlib.sha1(req.candidate_source.encode()).hexdigest()}
        self._write_record(req.run, rec)
        try:
            job = self.api.run_job(**args)
        except HfHubHTTPError as e:
            code = _status_code(e)
            if code in (401, 403):
                self._write_record(req.run, {k: v for k, v in rec.items()
                                             if k != "submittingSince"})
                raise self._auth_error(e, "create the job") from None
            if code is not None and 400 <= code < 500 and code != 429:
                return self._conclude(req.run, "error", f"Hugging Face refused the job ({code}): "
                                                        f"{_server_message(e)}", rec=rec)
            return RunObservation(req.run, "queued", message=f"submitting to Hugging Face Jobs "
                                                             f"failed ({_server_message(e)}); "
                                                             "retrying")
        except httpx2.HTTPError as e:
            return RunObservation(req.run, "queued", message=f"submitting to Hugging Face Jobs "
                                                             f"failed ({e}); retrying")
        rec.update(jobId=job.id, url=job.url, submittedAt=iso(_now()))
        rec.pop("submittingSince", None)
        self._write_record(req.run, rec)
        return self._from_stage(req.run, rec, job.status.stage, job.status.message)

    def _adopt(self, run: str, namespace: str) -> dict | None:
        """Record the job already created for `run` (found by its labels), if there is one."""
        jobs = list(self.api.list_jobs(namespace=namespace,
                                       labels={LABEL_RUN: run, LABEL_LAB_ID: self.lab_id}))
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
            job = self.api.inspect_job(job_id=rec["jobId"], namespace=rec["namespace"])
        except JobNotFoundError:
            return self._conclude(run, "lost", f"job {rec.get('jobId')} no longer exists on "
                                               "Hugging Face", rec=rec)
        except HfHubHTTPError as e:
            if _status_code(e) in (401, 403):
                raise self._auth_error(e, "show the job") from None
            return self._last_known(run, rec, f"cannot reach Hugging Face Jobs "
                                              f"({_server_message(e)})")
        except httpx2.HTTPError as e:
            return self._last_known(run, rec, f"cannot reach Hugging Face Jobs ({e})")
        return self._from_stage(run, rec, job.status.stage, job.status.message)

    def _last_known(self, run: str, rec: dict, message: str) -> RunObservation:
        state = {"RUNNING": "running"}.get(rec.get("stage", ""), "queued")
        return RunObservation(run, state, message=message, job_id=rec.get("jobId", ""),
                              worker=self._worker(rec))

    def _from_stage(self, run: str, rec: dict, stage: str, message: str | None) -> RunObservation:
        stage = str(getattr(stage, "value", stage))
        if rec.get("stage") != stage:
            rec["stage"] = stage
            self._write_record(run, rec)
        job_id, worker = rec.get("jobId", ""), self._worker(rec)
        if stage == "SCHEDULING":
            return RunObservation(run, "queued", job_id=job_id, worker=worker,
                                  message=f"Job {job_id} waits for a {rec.get('flavor')} machine "
                                          f"({rec.get('url', '')}).")
        if stage == "RUNNING":
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

    def _read_result(self, run: str, rec: dict, stage: str, message: str) -> RunObservation:
        key = self._key(run)
        try:
            signed = self._fetch_logs(run, rec, key)
        except (HfHubHTTPError, httpx2.HTTPError) as e:
            return self._last_known(run, rec, f"reading the job's logs failed ({e})")
        result = verify_signed_result(signed, key, run, rec.get("candidateSha1")) if key \
            else None
        if result is not None:
            state = RESULT_STATES.get(result.get("status"), "failed")
            return self._conclude(run, state, result.get("reason", ""), result, rec=rec)
        if "terminalSeenAt" not in rec:
            rec["terminalSeenAt"] = _now()
            self._write_record(run, rec)
        if _now() - rec["terminalSeenAt"] < self.result_grace_seconds:
            return RunObservation(run, "running", job_id=rec.get("jobId", ""),
                                  worker=self._worker(rec),
                                  message="reading the signed result from the job's logs")
        if key is None:
            why = (f"no authentic result: this run's result key is not on this machine "
                   f"({self.run_dir(run) / 'result.key'}), so nothing in job "
                   f"{rec.get('jobId')}'s logs can be trusted")
            return self._conclude(run, "error", why, rec=rec)
        if stage == "ERROR":
            why = (f"job {rec.get('jobId')} ended in ERROR ({message or 'no message'}) with no "
                   f"authentic result; see {self.log_path(run)}")
            return self._conclude(run, "error", why, rec=rec)
        why = (f"no authentic result: job {rec.get('jobId')} completed without a result line "
               "signed with this run's key (a line the candidate printed does not count); see "
               f"{self.log_path(run)}")
        return self._conclude(run, "failed", why, rec=rec)

    def _fetch_logs(self, run: str, rec: dict, key: bytes | None) -> list[str]:
        """Save the job's log to log.txt (token and key blanked out); return its signed lines."""
        tail: deque[str] = deque(maxlen=MAX_LOG_LINES)
        signed: list[str] = []
        for line in self.api.fetch_job_logs(job_id=rec["jobId"], namespace=rec["namespace"]):
            line = line.rstrip("\n")
            tail.append(line)
            if "AUTOLAB_SIGNED_RESULT" in line:
                signed.append(line)
        text = "".join(line + "\n" for line in tail)
        for s in (self.token(), key.decode() if key else None):
            if s:
                text = text.replace(s, "[redacted]")
        atomic_write(self.log_path(run), text)
        return signed

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
                if since and _now() - since < self.submit_grace_seconds:
                    return obs  # a job may have been created: cancel it once it shows up
                return self._conclude(run, "cancelled", "cancelled before a job was created",
                                      rec=rec)
            if rec.get("terminalSeenAt"):
                return obs  # it ended; its result is being read
            self.api.cancel_job(job_id=rec["jobId"], namespace=rec["namespace"])
        except JobNotFoundError:
            return self._conclude(run, "cancelled", f"job {rec.get('jobId')} is gone", rec=rec)
        except HfHubHTTPError as e:
            if _status_code(e) in (401, 403):
                raise self._auth_error(e, "cancel the job") from None
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
            env={BUNDLE_ENV: make_bundle(files), "PYTHONUNBUFFERED": "1"}, secrets=job_secrets,
            flavor=flavor, timeout=timeout, name=f"autolab-prepare-{self.lab_name}"[:60],
            labels=labels, namespace=namespace,
            volumes=[Volume(type="bucket", source=bucket, mount_path=DATA_MOUNT,
                            read_only=False)])


class BundleTooLarge(ValueError):
    pass
