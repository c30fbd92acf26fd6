"""The Kubernetes backend: one batch/v1 Job per run, its result read from the Pod's status.

A run is a Job named after the run (`exp-<name>-1`, `baseline-<hash>`), so a
restarted operator that submits again gets 409 AlreadyExists and adopts the
Job it made before instead of starting a second one. Next to it:

- the candidate's surface in a ConfigMap `<run>-surface`, mounted read-only;
  the run image (the Lab's `spec.kubernetes.image`, built from bench/Dockerfile)
  brings the fixed harness, so the candidate is the only thing that varies;
- the run's result-signing key in a Secret `<run>-key` (32 random bytes, hex),
  mounted only into the evaluator;
- the data and compile caches on the Lab's PVC (`spec.kubernetes.cachePVC`),
  mounted at the cache dir the harness reads from `AUTOLAB_CACHE`;
- `nvidia.com/gpu` requests and limits from the experiment's `resources.gpus`,
  and the Lab's node selector, tolerations and priority class; with a Kueue
  queue the Job carries `kueue.x-k8s.io/queue-name` and starts suspended, and
  Kueue admits it when the quota allows;
- `restartPolicy: Never`, a small `backoffLimit` for Pods lost to the
  infrastructure, a `podFailurePolicy` that fails the Job at once when the
  harness says the candidate failed (exit code 3: retrying cannot help) or
  the train container ended without the harness's say-so, and does not count
  Pods evicted or preempted (`DisruptionTarget`), and an
  `activeDeadlineSeconds` of the budget plus an allowance for data, compile
  and evaluation.

The trust boundary. The candidate is hostile (see bench/run.py). Its Pod
runs bench/run.py in three phases, one container each, in order:

1. `stage` (init container, trusted code only): prepares the data on the
   cache volume and copies the training split, and only it, into the
   `train-data` emptyDir.
2. `train` (init container, the candidate): mounts the candidate, the
   `train-data` emptyDir (its harness maps train.bin, then unlinks it before the
   candidate starts), the `export` emptyDir and an emptyDir at /tmp; nothing else: no cache (no validation split), no key, no
   service-account token. The harness streams the training data to the
   candidate and records what happened in the export directory. When the
   container's first process exits, every process of the container goes with
   it: none survives into evaluation.
3. `run` (the main container, trusted code only): mounts the cache and the
   export read-only and the key; measures the export (regular files only)
   with `python -I evaluate.py` and writes its result, signed with the key,
   as its termination message.

Every container runs as the image's non-root user with no privilege
escalation, all capabilities dropped, the RuntimeDefault seccomp profile and
a read-only root filesystem; the Pod mounts no service-account token and
shares no process namespace. Its hostname is one fixed label for every run
(`POD_HOSTNAME`), not the Pod's name, which would tell a candidate which run
it is.

What the controller believes. The `run` container's termination message
(`terminationMessagePolicy: File`), or failing that the harness's
`AUTOLAB_RESULT` line at the end of that container's log (no candidate ever
wrote to it), and either only if the container's exit code is the one the
harness gives that status, the HMAC verifies under the run's key
(controller.backends.results), the result names this run and
the sha1 of the candidate the Job was made for (its annotation). Because the
train container's own clock is in the candidate's reach, the controller times
that container from the Pod's status (`state.terminated.startedAt` to
`finishedAt`) and fails the run with `BudgetExceeded` when it ran longer than
the harness allowed (`limits.train_phase_seconds` of the signed result:
start-up allowance + budget + slack + export allowance, the profile's values).

    Job suspended, no Pod yet, or Pod Pending   -> queued
    Pod running                                  -> running
    result succeeded / failed                    -> succeeded / failed
    train container killed outside the harness   -> failed (CandidateCrashed)
    result error, Job out of retries             -> error
    Job failed (deadline, backoff) and no result -> lost

The Job, its ConfigMap and its Secret go only when the operator says so
(`cleanup`), after the result is in the status and the ledger.
"""

from __future__ import annotations

import base64
import datetime as _dt
import hashlib
import json
import math
import secrets
from typing import Any

from kubernetes.client.exceptions import ApiException

from controller.backends import Backend, RunRequest
from controller.backends.results import authentic
from controller.kube.cluster import (LABEL_BASELINE, LABEL_CAMPAIGN, LABEL_EXPERIMENT, LABEL_LAB,
                                LABEL_RUN, OURS, ClusterError, Kube, deleted, unless_gone)
from controller.core.reconcile import RunObservation
from controller.core.spec import LabSpec
from controller.core.status import Reason
from controller.lab import profiles

CONTAINER = "run"  # the evaluator: its termination message is the result
STAGE_CONTAINER = "stage"
TRAIN_CONTAINER = "train"
WORKDIR = "/opt/autolab"
HARNESS = f"{WORKDIR}/bench/run.py"
CANDIDATE_DIR = "/autolab/candidate"
CACHE_DIR = "/var/cache/autolab"
TRAIN_DATA_DIR = "/autolab/train-data"
EXPORT_DIR = "/autolab/export"
KEY_DIR = "/autolab/key"
KEY_FILE = "key"
TMP_DIR = "/tmp"
TERMINATION_LOG = "/dev/termination-log"
RESULT_PATH = "/tmp/autolab/result.json"
RESULT_MARKER = "AUTOLAB_RESULT"
CANDIDATE_SHA1 = "autolab.dev/candidate-sha1"  # Job annotation: what the result must have measured
EXIT_CODES = {"succeeded": 0, "failed": 3, "error": 4}  # bench/run.py's contract
EXIT_CANDIDATE_FAILED = EXIT_CODES["failed"]
EXIT_HARNESS_ERROR = EXIT_CODES["error"]
DEADLINE_ALLOWANCE = 1800  # data preparation on first use, compilation, evaluation
DEFAULT_BACKOFF_LIMIT = 2
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
GPU = "nvidia.com/gpu"
RUN_UID = 10001  # bench/Dockerfile's user
# Every run's Pod has this hostname. A Pod's hostname is otherwise its name, the Job's (the run's)
# with a suffix: `exp-<name>-<attempt>-p3-x7k2p` tells a candidate (`hostname`, $HOSTNAME,
# /etc/hostname, /etc/hosts) its place among its pair runs, and with it whose run comes next
# on its machine (controller.core.reconcile.next_run). One fixed DNS label says nothing.
POD_HOSTNAME = "autolab-run"


def surface_configmap_name(run: str) -> str:
    return f"{run}-surface"


def key_secret_name(run: str) -> str:
    return f"{run}-key"


def container_security() -> dict[str, Any]:
    """Every run container: the image's non-root user, nothing to escalate to, nothing writable
    but its volumes."""
    return {"runAsNonRoot": True, "runAsUser": RUN_UID, "runAsGroup": RUN_UID,
            "privileged": False, "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"}}


class KubernetesBackend(Backend):
    """Runs on Kubernetes Jobs in one namespace, for one Lab."""

    name = "kubernetes"

    def __init__(self, kube: Kube, namespace: str, lab_name: str, lab: LabSpec,
                 default_image: str | None = None):
        self.kube = kube
        self.namespace = namespace
        self.lab_name = lab_name
        self.lab = lab
        self.default_image = default_image

    # -- what gets created -----------------------------------------------------------------------
    def labels(self, req: RunRequest) -> dict[str, str]:
        out = {**OURS, "app.kubernetes.io/name": "autolab-run", LABEL_LAB: self.lab_name,
               LABEL_RUN: req.run}
        if req.experiment == "baseline":
            out[LABEL_BASELINE] = "true"
        else:
            out[LABEL_EXPERIMENT] = req.experiment
        if req.campaign:
            out[LABEL_CAMPAIGN] = req.campaign
        return out

    def surface_name(self) -> str:
        return self.lab.surface.rsplit("/", 1)[-1]

    def _meta(self, name: str, req: RunRequest, owner: dict | None) -> dict[str, Any]:
        meta: dict[str, Any] = {"name": name, "namespace": self.namespace,
                                "labels": self.labels(req)}
        if owner:
            meta["ownerReferences"] = [owner]
        return meta

    def surface_manifest(self, req: RunRequest, owner: dict | None) -> dict:
        return {"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": self._meta(surface_configmap_name(req.run), req, owner),
                "data": {self.surface_name(): req.candidate_source}}

    def key_manifest(self, req: RunRequest, owner: dict | None) -> dict:
        """A fresh result-signing key for the run (hex, as the harness reads it from the file)."""
        key = secrets.token_hex(32).encode()
        return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                "metadata": self._meta(key_secret_name(req.run), req, owner),
                "data": {KEY_FILE: base64.b64encode(key).decode()}}

    def job_manifest(self, req: RunRequest, owner: dict | None) -> dict:
        k = self.lab.kubernetes
        image = k.get("image") or self.default_image
        if not image:
            raise ClusterError(f"Lab {self.lab_name} has no spec.kubernetes.image; set it to the "
                               "run image built from bench/Dockerfile")
        labels = self.labels(req)
        budget = req.budget_seconds or _profile_budget(req.profile)
        candidate = f"{CANDIDATE_DIR}/{self.surface_name()}"
        budget_args = ["--budget", str(req.budget_seconds)] if req.budget_seconds else []
        if req.seed:  # a repeat run of one program (noise, confirm): the harness's seed
            budget_args += ["--seed", str(req.seed)]
        common_env = [{"name": "AUTOLAB_BENCH_PROFILE", "value": req.profile},
                      {"name": "PYTHONUNBUFFERED", "value": "1"},
                      {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"},
                      {"name": "HOME", "value": TMP_DIR}, {"name": "TMPDIR", "value": TMP_DIR}]
        cache_env = [{"name": "AUTOLAB_CACHE", "value": CACHE_DIR}]

        def container(name: str, command: list[str], env: list[dict], mounts: list[dict],
                      gpu: bool) -> dict[str, Any]:
            out: dict[str, Any] = {
                "name": name, "image": image, "imagePullPolicy": "IfNotPresent",
                "command": ["python", "-I", HARNESS, *command], "workingDir": TMP_DIR,
                "env": common_env + env,
                "volumeMounts": mounts + [{"name": f"{name}-tmp", "mountPath": TMP_DIR}],
                "securityContext": container_security(),
                "terminationMessagePath": TERMINATION_LOG,
                "terminationMessagePolicy": "File",
            }
            if gpu and req.gpus > 0:
                out["resources"] = {"requests": {GPU: str(req.gpus)},
                                    "limits": {GPU: str(req.gpus)}}
            return out

        def mount(volume: str, path: str, read_only: bool) -> dict:
            return {"name": volume, "mountPath": path, "readOnly": read_only}

        stage = container(STAGE_CONTAINER, [
            "--phase", "stage", "--source", req.data, "--train-data", TRAIN_DATA_DIR,
            "--termination-log", TERMINATION_LOG,
        ], cache_env, [mount("cache", CACHE_DIR, False), mount("train-data", TRAIN_DATA_DIR, False)],
            gpu=False)
        train = container(TRAIN_CONTAINER, [
            "--phase", "train", "--candidate", candidate, "--train-data", TRAIN_DATA_DIR,
            "--export-dir", EXPORT_DIR, "--sandbox", "container", *budget_args,
        # train-data writable: the harness unlinks train.bin once it is mapped, before the
        # candidate (its own uid) starts, so the split reaches it only through the timed stream.
        ], [], [mount("candidate", CANDIDATE_DIR, True), mount("train-data", TRAIN_DATA_DIR, False),
                mount("export", EXPORT_DIR, False)], gpu=True)
        evaluate = container(CONTAINER, [
            "--phase", "evaluate", "--candidate", candidate, "--export-dir", EXPORT_DIR,
            "--result", RESULT_PATH, "--termination-log", TERMINATION_LOG, "--source", req.data,
            "--sandbox", "container", "--key-file", f"{KEY_DIR}/{KEY_FILE}", "--run", req.run,
            *budget_args, *(["--eval-limit", f"{req.eval_limit:g}"] if req.eval_limit else []),
        ], cache_env + [{"name": "AUTOLAB_RUN", "value": req.run},
                        {"name": "AUTOLAB_EXPERIMENT", "value": req.experiment}],
            [mount("candidate", CANDIDATE_DIR, True), mount("cache", CACHE_DIR, True),
             mount("export", EXPORT_DIR, True), mount("key", KEY_DIR, True)], gpu=True)

        cache: dict[str, Any] = {"name": "cache", "emptyDir": {}}
        if k.get("cachePVC"):
            cache = {"name": "cache", "persistentVolumeClaim": {"claimName": k["cachePVC"]}}
        pod: dict[str, Any] = {
            "restartPolicy": "Never",
            "hostname": POD_HOSTNAME,  # not the run's name (see POD_HOSTNAME)
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "shareProcessNamespace": False,
            "hostPID": False, "hostIPC": False, "hostNetwork": False,
            # The run image's user; fsGroup makes the volumes writable for it.
            "securityContext": {"runAsNonRoot": True, "runAsUser": RUN_UID, "runAsGroup": RUN_UID,
                                "fsGroup": RUN_UID, "seccompProfile": {"type": "RuntimeDefault"}},
            "initContainers": [stage, train],
            "containers": [evaluate],
            "volumes": [
                {"name": "candidate", "configMap": {"name": surface_configmap_name(req.run),
                                                    "defaultMode": 0o444}},
                cache,
                {"name": "train-data", "emptyDir": {}},
                {"name": "export", "emptyDir": {}},
                {"name": "key", "secret": {"secretName": key_secret_name(req.run),
                                           "defaultMode": 0o440}},
                *({"name": f"{c['name']}-tmp", "emptyDir": {}} for c in (stage, train, evaluate)),
            ],
        }
        if k.get("nodeSelector"):
            pod["nodeSelector"] = dict(k["nodeSelector"])
        if k.get("tolerations"):
            pod["tolerations"] = list(k["tolerations"])
        if k.get("priorityClassName"):
            pod["priorityClassName"] = k["priorityClassName"]
        job_labels = dict(labels)
        if k.get("queue"):
            job_labels[QUEUE_LABEL] = k["queue"]
        meta: dict[str, Any] = {"name": req.run, "namespace": self.namespace,
                                "labels": job_labels,
                                "annotations": {CANDIDATE_SHA1: hashlib.sha1(
                                    req.candidate_source.encode("utf-8")).hexdigest()}}
        if owner:
            meta["ownerReferences"] = [owner]
        return {
            "apiVersion": "batch/v1", "kind": "Job", "metadata": meta,
            "spec": {
                "suspend": bool(k.get("queue")),
                "backoffLimit": int(k.get("backoffLimit", DEFAULT_BACKOFF_LIMIT)),
                "activeDeadlineSeconds": int(budget) + DEADLINE_ALLOWANCE,
                "podFailurePolicy": {"rules": [
                    {"action": "FailJob",
                     "onExitCodes": {"containerName": CONTAINER, "operator": "In",
                                     "values": [EXIT_CANDIDATE_FAILED]}},
                    {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]},
                    # The train phase's harness exits 0 once it recorded the run, whatever the
                    # candidate did (4: an infrastructure problem, retried); anything else means
                    # the candidate took the container down with it.
                    {"action": "FailJob",
                     "onExitCodes": {"containerName": TRAIN_CONTAINER, "operator": "NotIn",
                                     "values": [0, EXIT_HARNESS_ERROR]}},
                ]},
                "template": {"metadata": {"labels": labels}, "spec": pod},
            },
        }

    # -- the Backend seam ------------------------------------------------------------------------
    def submit(self, req: RunRequest) -> RunObservation:
        """Create the run's Secret, ConfigMap and Job, or adopt them if they exist (409)."""
        owner = req.owner
        job = self.job_manifest(req, owner)  # refuses before anything is created
        made: dict | None = None
        for create, body in ((self._create_secret, self.key_manifest(req, owner)),
                             (self.kube.create_configmap, self.surface_manifest(req, owner)),
                             (self.kube.create_job, job)):
            try:
                answer = create(self.namespace, body)
            except ApiException as e:
                if e.status != 409:  # 409: made before (a restarted operator); the first one stays
                    raise
                continue
            if body is job:
                made = answer
        if made is not None:
            # Made just now: the API server answered with the Job as stored at its creation,
            # when no Pod of it could exist yet. Reading both back would tell nothing more.
            return self._observation(req.run, made, [])
        return self.observe(req.run)  # adopted: as it is now

    def observe(self, run: str) -> RunObservation:
        job = self.kube.get_job(self.namespace, run)
        if job is None or (job.get("metadata") or {}).get("deletionTimestamp"):
            return RunObservation(run, "missing")
        return self._observation(run, job, self.kube.list_pods(self.namespace, {"job-name": run}))

    def _observation(self, run: str, job: dict, pods: list[dict]) -> RunObservation:
        """What `job` and its Pods say of the run (see the table in the module docstring)."""
        job_id = job["metadata"].get("uid", "")
        sha1 = ((job["metadata"].get("annotations") or {}).get(CANDIDATE_SHA1))
        status = job.get("status") or {}
        done = {c["type"]: c for c in status.get("conditions") or []
                if c.get("status") == "True" and c.get("type") in ("Complete", "Failed")}
        pods = sorted(pods, key=lambda p: (p["metadata"].get("creationTimestamp") or "",
                                           p["metadata"].get("name", "")))
        # A finished Pod whose result is final decides, even before the Job controller caught up.
        for pod in reversed(pods):
            result = self._finished(pod, run, sha1)
            if result is None:
                continue
            state = result["status"]
            if state in ("succeeded", "failed") or "Failed" in done or "Complete" in done:
                return RunObservation(run, state, result=result, message=result.get("reason", ""),
                                      job_id=job_id, worker=_worker(pod))
        if "Failed" in done or "Complete" in done:
            cond = done.get("Failed") or done["Complete"]
            why = cond.get("message") or cond.get("reason") or "no reason given"
            init = _init_failure(pods[-1]) if pods else ""
            return RunObservation(run, "lost", job_id=job_id,
                                  worker=_worker(pods[-1]) if pods else "",
                                  message=f"Job {run} ended ({cond.get('reason', cond['type'])}: "
                                          f"{why}) without a result from the harness{init}; see "
                                          f"`kubectl logs job/{run} --all-containers`")
        if job.get("spec", {}).get("suspend"):
            queue = (job["metadata"].get("labels") or {}).get(QUEUE_LABEL) \
                or self.lab.kubernetes.get("queue")
            where = f"Kueue to admit it from queue {queue}" if queue else \
                "someone to resume it (spec.suspend is true)"
            return RunObservation(run, "queued", job_id=job_id,
                                  reason=Reason.WAITING_FOR_ADMISSION,
                                  message=f"Job {run} is suspended: it waits for {where}; "
                                          "no GPU is held meanwhile.")
        live = [p for p in pods if (p.get("status") or {}).get("phase") in ("Pending", "Running")]
        if live and live[-1]["status"].get("phase") == "Running":
            return RunObservation(run, "running", job_id=job_id, worker=_worker(live[-1]))
        message = f"Job {run} waits for its Pod."
        if live:
            message = f"Pod {live[-1]['metadata']['name']} is pending: {_pending_reason(live[-1])}"
        return RunObservation(run, "queued", job_id=job_id, message=message,
                              worker=_worker(live[-1]) if live else "")

    def _finished(self, pod: dict, run: str, candidate_sha1: str | None) -> dict | None:
        """The result of a Pod that finished, as far as it can be believed; None if it has not
        finished or left nothing to believe."""
        train = _terminated(pod, TRAIN_CONTAINER, init=True)
        if train and train.get("exitCode") not in (0, EXIT_HARNESS_ERROR, None) \
                and not _disrupted(pod):  # an evicted or preempted Pod is retried, not judged
            seconds = _duration(train)
            return {"status": "failed", "reason_code": "CandidateCrashed", "run": run,
                    "candidate_sha1": candidate_sha1, "train_container_seconds": seconds,
                    "reason": f"the train container ended with exit code {train.get('exitCode')} "
                              f"({train.get('reason') or 'no reason given'}) before the harness "
                              "recorded the run"}
        term = _terminated(pod, CONTAINER)
        if not term:
            return None
        code = term.get("exitCode")
        result = _parse_result(term.get("message") or "")
        if result is None:
            result = _result_from_log(self.kube.pod_log_tail(
                self.namespace, pod["metadata"]["name"], CONTAINER))
        if result is None or EXIT_CODES.get(result["status"]) != code:
            return None
        key = self._key(run)
        wrong = "the run's key Secret is gone" if key is None else \
            authentic(result, key, run, candidate_sha1)
        if wrong:
            return {"status": "error", "reason_code": "ResultNotAuthentic", "run": run,
                    "reason": f"the result in Pod {pod['metadata']['name']}'s termination message is "
                              f"not this run's harness's: {wrong}; nothing of it is believed"}
        return _held_to_budget(result, train)

    def cancel(self, run: str) -> RunObservation:
        """Stop the run. A run that finished meanwhile keeps its result (it is returned)."""
        obs = self.observe(run)
        if obs.state in ("succeeded", "failed", "error", "lost"):
            return obs
        self.kube.delete_job(self.namespace, run)
        return RunObservation(run, "cancelled", job_id=obs.job_id, worker=obs.worker,
                              message=f"Job {run} was deleted before it finished.")

    def cleanup(self, run: str) -> None:
        """Remove the run's Job (and its Pods), ConfigMap and key, once its result is recorded."""
        self.kube.delete_job(self.namespace, run)
        self.kube.delete_configmap(self.namespace, surface_configmap_name(run))
        self._delete_secret(key_secret_name(run))

    def leftovers(self, run: str) -> bool:
        job = self.kube.get_job(self.namespace, run)
        if job is not None and not job["metadata"].get("deletionTimestamp"):
            return True
        if self.kube.get_configmap(self.namespace, surface_configmap_name(run)) is not None:
            return True
        return self._read_secret(key_secret_name(run)) is not None

    # -- the key Secret ----------------------------------------------------------------------------
    def _create_secret(self, namespace: str, body: dict) -> dict:
        return self.kube.create_secret(namespace, body)

    def _read_secret(self, name: str) -> dict | None:
        return unless_gone(lambda: json.loads(self.kube.core.read_namespaced_secret(
            name, self.namespace, _preload_content=False).data))

    def _delete_secret(self, name: str) -> None:
        deleted(lambda: self.kube.core.delete_namespaced_secret(
            name, self.namespace, _preload_content=False))

    def _key(self, run: str) -> bytes | None:
        secret = self._read_secret(key_secret_name(run))
        data = ((secret or {}).get("data") or {}).get(KEY_FILE)
        return base64.b64decode(data).strip() if data else None


def _terminated(pod: dict, name: str, init: bool = False) -> dict | None:
    st = pod.get("status") or {}
    for cs in st.get("initContainerStatuses" if init else "containerStatuses") or []:
        if cs.get("name") == name:
            return (cs.get("state") or {}).get("terminated") or None
    return None


def _disrupted(pod: dict) -> bool:
    return any(c.get("type") == "DisruptionTarget" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def _timestamp(value: Any) -> float | None:
    if not isinstance(value, str):
        return None
    try:
        return _dt.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _duration(term: dict | None) -> float | None:
    """Seconds a terminated container ran, from the Pod's status (the kubelet's clock)."""
    if not term:
        return None
    start, end = _timestamp(term.get("startedAt")), _timestamp(term.get("finishedAt"))
    return None if start is None or end is None or end < start else end - start


def _profile_budget(name: str) -> float:
    """The training budget of profile `name` by bench/prepare.py (the one next to this
    controller, which the run image is built from); the default profile's for an unknown name."""
    found = profiles.profiles()
    return found.get(name, found[profiles.DEFAULT]).time_budget


def _held_to_budget(result: dict, train: dict | None) -> dict:
    """The result, with how long the train container ran; failed (BudgetExceeded) if longer than
    the harness allowed it."""
    seconds = _duration(train)
    limit = (result.get("limits") or {}).get("train_phase_seconds")
    if seconds is None or isinstance(limit, bool) or not isinstance(limit, (int, float)) \
            or not math.isfinite(limit):
        return {**{k: v for k, v in result.items() if k not in ("metrics", "signature")},
                "status": "error", "reason_code": "HarnessError", "harness_status": result["status"],
                "reason": "cannot hold the run to its budget: " + (
                    "the Pod's status does not say how long the train container ran"
                    if seconds is None else "the result does not say how long the train phase "
                                            "may take (a run image older than this controller?)")}
    out = {k: v for k, v in result.items() if k != "signature"}
    out["train_container_seconds"] = round(seconds, 1)
    if seconds > limit:
        out.pop("metrics", None)
        out.update(status="failed", reason_code="BudgetExceeded", harness_status=result["status"],
                   reason=f"the train container ran {seconds:.0f}s by the Pod's status, past the "
                          f"{limit:g}s its budget allows (start-up allowance + budget + slack + "
                          "export allowance); the harness's own clock in that container is in "
                          "the candidate's reach, this one is not")
    return out


def _init_failure(pod: dict) -> str:
    """", stage container: <its message>" for an init container that failed, else "".

    The train container's termination message is not quoted: the candidate runs there, of
    its harness's uid, and can write /dev/termination-log ("GPU fell off the bus; retry"). Of
    it, only what the kubelet says (its reason and exit code) is told."""
    for name in (STAGE_CONTAINER, TRAIN_CONTAINER):
        term = _terminated(pod, name, init=True)
        if term and term.get("exitCode") not in (0, None):
            said = term.get("message") if name == STAGE_CONTAINER else None
            what = said or f"{term.get('reason') or 'ended'} (exit code {term.get('exitCode')})"
            try:
                what = json.loads(what).get("reason") or what
            except (ValueError, AttributeError):
                pass
            return f"; its {name} container failed: {str(what)[:500]}"
    return ""


def _parse_result(text: str) -> dict | None:
    try:
        result = json.loads(text)
    except ValueError:
        return None
    if isinstance(result, dict) and result.get("status") in EXIT_CODES:
        return result
    return None


def _result_from_log(log: str) -> dict | None:
    for line in reversed(log.splitlines()):
        if line.startswith(RESULT_MARKER + " "):
            return _parse_result(line[len(RESULT_MARKER) + 1:])
    return None


def _worker(pod: dict) -> str:
    node = (pod.get("spec") or {}).get("nodeName") or "unscheduled"
    return f"k8s:{node}/{pod['metadata']['name']}"


def _pending_reason(pod: dict) -> str:
    st = pod.get("status") or {}
    for cs in (st.get("initContainerStatuses") or []) + (st.get("containerStatuses") or []):
        waiting = (cs.get("state") or {}).get("waiting")
        if waiting:
            return waiting.get("message") or waiting.get("reason") or "waiting"
    for cond in st.get("conditions") or []:
        if cond.get("status") == "False" and cond.get("message"):
            return cond["message"]
    return "waiting to be scheduled"
