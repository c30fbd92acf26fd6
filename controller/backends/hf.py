"""The Hugging Face Jobs backend: one run = one managed-GPU job, found again by its labels.

For a lab with no cluster: each run is a job on Hugging Face's
infrastructure, created through `huggingface_hub`'s Jobs API (`run_job`,
`inspect_job`, `fetch_job_logs`, `cancel_job`, `list_jobs`), on the flavor,
timeout and namespace the Lab's `spec.hf` names and an Experiment's
`spec.hf` overrides.

Three modules: this one is the run logic (`HfBackend`: submit, observe, cancel
and adopt a run, its records on this machine, the budget of API calls);
`hf_wire` is what travels to and from a job (the bundle, BOOTSTRAP, the signed
lines and their verification); `hf_api` is the Jobs API as seen from here (its
refusals and rate limits in words, the token from a Secret, the log reader).

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

import hashlib
import json
import os
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import httpx2
import yaml
from huggingface_hub import HfApi, Volume
from huggingface_hub.errors import HfHubHTTPError, JobNotFoundError
from huggingface_hub.utils import get_token

from controller.backends import Backend, RunRequest
from controller.backends.hf_api import (HfBackendError, LogReader, RateLimited, refusal_message,
                                        retry_after, server_message, status_code,
                                        token_from_secret)
from controller.backends.hf_wire import (BOOTSTRAP, BUNDLE_LIMIT, BundleTooLarge, bundle_env,
                                         make_bundle, verify_signed_curve, verify_signed_result)
from controller.lab.harness import harness_files, pinned_harness
from controller.core.reconcile import RunObservation
from controller.core.spec import LabSpec
from controller.lab.clock import iso
from controller.lab.files import atomic_write
from controller.lab.paths import LabPaths

__all__ = ["HfBackend", "HfBackendError", "HfSettings", "token_from_secret", "refusal_message",
           "timeout_seconds"]  # the last three for the CLI and the operator, from one place

SYNTHETIC_SEED_ENV = "AUTOLAB_SYNTHETIC_SEED"  # bench/prepare.py reads it (a job secret, never the candidate's)

REPO_ROOT = Path(__file__).resolve().parents[2]
ENTRY_POINT = REPO_ROOT / "bench" / "hf_entry.py"

DEFAULT_IMAGE = "ghcr.io/astral-sh/uv:python3.12-bookworm"  # Python 3.12 with uv
DEFAULT_FLAVOR = "h200"
DEFAULT_TIMEOUT = "30m"
PREPARE_FLAVOR = "cpu-upgrade"
PREPARE_TIMEOUT = "2h"
DATA_MOUNT = "/autolab-data"
KEY_SECRET = "AUTOLAB_RESULT_KEY"
RUN_REQUIREMENTS = ("torch>=2.4", "numpy>=1.26", "pyarrow>=14", "tokenizers>=0.19",
                    "huggingface_hub>=0.30")
PREPARE_REQUIREMENTS = tuple(r for r in RUN_REQUIREMENTS if not r.startswith("torch"))

LABEL_LAB = "autolab-lab"
LABEL_LAB_ID = "autolab-lab-id"
LABEL_RUN = "autolab-run"
LABEL_EXPERIMENT = "autolab-experiment"
LABEL_CAMPAIGN = "autolab-campaign"
LABEL_ROLE = "autolab-role"

RESULT_STATES = {"succeeded": "succeeded", "failed": "failed", "error": "error"}
ACTIVE_STAGES = ("SCHEDULING", "RUNNING")

# What one read of a job's log keeps, whatever the candidate prints into it.

# The API budget (see "Watching a job" above).
POLL_MIN_SECONDS = 2.0    # the first inspection after a change of stage
POLL_MAX_SECONDS = 60.0   # the interval doubles up to this while nothing changes
RATE_LIMIT_SECONDS = 30.0  # the wait after a 429 without a usable Retry-After
LOG_STALL_SECONDS = 30.0  # a log read with no line for this long is stalled
LOG_RETRY_SECONDS = 5.0   # between two reads of one job's log
LOG_READS = 3             # reads of an ended job's log before it has no result

RUN_ENV = "AUTOLAB_RUN"  # the run's name, as bench/hf_entry.py reads it


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


@dataclass(frozen=True)
class _Poll:
    stage: str       # the stage the last inspection saw
    interval: float  # seconds from it to the next
    due: float
    at: float        # when it was made


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}



class HfBackend(Backend):
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
        files = {f"bench/{name}": (pinned / name).read_bytes() for name in harness_files(pinned)}
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
            if status_code(e) in (401, 403):
                raise self._auth_error(e, "list the jobs", namespace) from None
            return RunObservation(req.run, "queued", message=f"cannot reach Hugging Face Jobs "
                                                             f"({server_message(e)}); retrying")
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
            code = status_code(e)
            if code in (401, 403):
                self._write_record(req.run, {k: v for k, v in rec.items()
                                             if k != "submittingSince"})
                raise self._auth_error(e, "create the job", namespace) from None
            if code is not None and 400 <= code < 500 and code != 429:
                return self._conclude(req.run, "error", f"Hugging Face refused the job ({code}): "
                                                        f"{server_message(e)}", rec=rec)
            return RunObservation(req.run, "queued", message=f"submitting to Hugging Face Jobs "
                                                             f"failed ({server_message(e)}); "
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
            if status_code(e) in (401, 403):
                raise self._auth_error(e, "show the job", rec.get("namespace")) from None
            return self._last_known(run, rec, f"cannot reach Hugging Face Jobs "
                                              f"({server_message(e)})")
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
            if status_code(e) == 429:
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
            if status_code(e) in (401, 403):
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
        files = {f"bench/{name}": (pinned / name).read_bytes() for name in harness_files(pinned)}
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
