"""The Kubernetes backend: one batch/v1 Job per run, its result read from the Pod's status.

A run is a Job named after the run (`exp-<name>-1`, `baseline-<hash>`), so a
restarted operator that submits again gets 409 AlreadyExists and adopts the
Job it made before instead of starting a second one. Next to it:

- the candidate's surface in a ConfigMap `<run>-surface`, mounted read-only;
  the run image (the Lab's `spec.kubernetes.image`, built from bench/Dockerfile)
  brings the fixed harness, so the candidate is the only thing that varies;
- the data and compile caches on the Lab's PVC (`spec.kubernetes.cachePVC`),
  mounted at the cache dir the harness reads from `AUTOLAB_CACHE`;
- `nvidia.com/gpu` requests and limits from the experiment's `resources.gpus`,
  and the Lab's node selector, tolerations and priority class; with a Kueue
  queue the Job carries `kueue.x-k8s.io/queue-name` and starts suspended, and
  Kueue admits it when the quota allows;
- `restartPolicy: Never`, a small `backoffLimit` for Pods lost to the
  infrastructure, a `podFailurePolicy` that fails the Job at once when the
  harness says the candidate failed (exit code 3: retrying cannot help) and
  does not count Pods evicted or preempted (`DisruptionTarget`), and an
  `activeDeadlineSeconds` of the budget plus an allowance for data, compile
  and evaluation.

The harness writes its result JSON (at most 4 KiB) to the container's
termination message (`terminationMessagePolicy: File`, not
FallbackToLogsOnError, which would turn a log line the candidate printed into
a "result"). The backend reads it from `containerStatuses[].state.terminated`.
Only when a Pod has no termination message does it look at the end of the
log for the harness's `AUTOLAB_RESULT` line, and it believes either one only
if the container's exit code is the one the harness gives that status, which
a candidate's own output cannot arrange.

    Job suspended, no Pod yet, or Pod Pending   -> queued
    Pod running                                  -> running
    result succeeded / failed                    -> succeeded / failed
    result error, Job out of retries             -> error
    Job failed (deadline, backoff) and no result -> lost

The Job and its ConfigMap go only when the operator says so (`cleanup`),
after the result is in the status and the ledger.
"""

from __future__ import annotations

import json
from typing import Any

from kubernetes.client.exceptions import ApiException

from controller.backends import RunRequest
from controller.cluster import (LABEL_BASELINE, LABEL_CAMPAIGN, LABEL_EXPERIMENT, LABEL_LAB,
                                LABEL_RUN, OURS, ClusterError, Kube)
from controller.core.reconcile import RunObservation
from controller.core.spec import LabSpec

CONTAINER = "run"
WORKDIR = "/opt/autolab"
CANDIDATE_DIR = "/autolab/candidate"
CACHE_DIR = "/var/cache/autolab"
TERMINATION_LOG = "/dev/termination-log"
RESULT_PATH = "/tmp/autolab/result.json"
RESULT_MARKER = "AUTOLAB_RESULT"
EXIT_CODES = {"succeeded": 0, "failed": 3, "error": 4}  # bench/run.py's contract
EXIT_CANDIDATE_FAILED = EXIT_CODES["failed"]
DEFAULT_BUDGET = {"default": 300, "tiny": 4}  # bench/prepare.py's profiles
DEADLINE_ALLOWANCE = 1800  # data preparation on first use, compilation, evaluation
DEFAULT_BACKOFF_LIMIT = 2
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
GPU = "nvidia.com/gpu"
RUN_UID = 10001  # bench/Dockerfile's user


def surface_configmap_name(run: str) -> str:
    return f"{run}-surface"


class KubernetesBackend:
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

    def surface_manifest(self, req: RunRequest, owner: dict | None) -> dict:
        meta: dict[str, Any] = {"name": surface_configmap_name(req.run),
                                "namespace": self.namespace, "labels": self.labels(req)}
        if owner:
            meta["ownerReferences"] = [owner]
        return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta,
                "data": {self.surface_name(): req.candidate_source}}

    def job_manifest(self, req: RunRequest, owner: dict | None) -> dict:
        k = self.lab.kubernetes
        image = k.get("image") or self.default_image
        if not image:
            raise ClusterError(f"Lab {self.lab_name} has no spec.kubernetes.image; set it to the "
                               "run image built from bench/Dockerfile")
        labels = self.labels(req)
        budget = req.budget_seconds or DEFAULT_BUDGET.get(req.profile, DEFAULT_BUDGET["default"])
        command = ["python", f"{WORKDIR}/bench/run.py",
                   "--candidate", f"{CANDIDATE_DIR}/{self.surface_name()}",
                   "--result", RESULT_PATH, "--termination-log", TERMINATION_LOG,
                   "--source", req.data]
        if req.budget_seconds:
            command += ["--budget", str(req.budget_seconds)]
        container: dict[str, Any] = {
            "name": CONTAINER, "image": image, "imagePullPolicy": "IfNotPresent",
            "command": command, "workingDir": WORKDIR,
            "env": [{"name": "AUTOLAB_BENCH_PROFILE", "value": req.profile},
                    {"name": "AUTOLAB_CACHE", "value": CACHE_DIR},
                    {"name": "AUTOLAB_RUN", "value": req.run},
                    {"name": "AUTOLAB_EXPERIMENT", "value": req.experiment},
                    {"name": "PYTHONUNBUFFERED", "value": "1"}],
            "volumeMounts": [{"name": "candidate", "mountPath": CANDIDATE_DIR, "readOnly": True},
                             {"name": "cache", "mountPath": CACHE_DIR}],
            "terminationMessagePath": TERMINATION_LOG,
            "terminationMessagePolicy": "File",
        }
        if req.gpus > 0:
            container["resources"] = {"requests": {GPU: str(req.gpus)},
                                      "limits": {GPU: str(req.gpus)}}
        cache: dict[str, Any] = {"name": "cache", "emptyDir": {}}
        if k.get("cachePVC"):
            cache = {"name": "cache", "persistentVolumeClaim": {"claimName": k["cachePVC"]}}
        pod: dict[str, Any] = {
            "restartPolicy": "Never",
            # The run image's user; fsGroup makes the cache volume writable for it.
            "securityContext": {"runAsNonRoot": True, "runAsUser": RUN_UID, "runAsGroup": RUN_UID,
                                "fsGroup": RUN_UID},
            "containers": [container],
            "volumes": [{"name": "candidate",
                         "configMap": {"name": surface_configmap_name(req.run)}}, cache],
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
                                "labels": job_labels}
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
                ]},
                "template": {"metadata": {"labels": labels}, "spec": pod},
            },
        }

    # -- the Backend seam ------------------------------------------------------------------------
    def submit(self, req: RunRequest, owner: dict | None = None) -> RunObservation:
        """Create the run's ConfigMap and Job, or adopt them if they exist (409)."""
        job = self.job_manifest(req, owner)  # refuses before anything is created
        try:
            self.kube.create_configmap(self.namespace, self.surface_manifest(req, owner))
        except ApiException as e:
            if e.status != 409:
                raise
        try:
            self.kube.create_job(self.namespace, job)
        except ApiException as e:
            if e.status != 409:
                raise
        return self.observe(req.run)

    def observe(self, run: str) -> RunObservation:
        job = self.kube.get_job(self.namespace, run)
        if job is None or (job.get("metadata") or {}).get("deletionTimestamp"):
            return RunObservation(run, "missing")
        job_id = job["metadata"].get("uid", "")
        status = job.get("status") or {}
        done = {c["type"]: c for c in status.get("conditions") or []
                if c.get("status") == "True" and c.get("type") in ("Complete", "Failed")}
        pods = sorted(self.kube.list_pods(self.namespace, {"job-name": run}),
                      key=lambda p: (p["metadata"].get("creationTimestamp") or "",
                                     p["metadata"].get("name", "")))
        # A finished Pod whose result is final decides, even before the Job controller caught up.
        for pod in reversed(pods):
            finished = self._finished(pod)
            if finished is None:
                continue
            result, exit_code = finished
            state = result["status"]
            if state in ("succeeded", "failed") or "Failed" in done or "Complete" in done:
                return RunObservation(run, state, result=result, message=result.get("reason", ""),
                                      job_id=job_id, worker=_worker(pod))
        if "Failed" in done or "Complete" in done:
            cond = done.get("Failed") or done["Complete"]
            why = cond.get("message") or cond.get("reason") or "no reason given"
            return RunObservation(run, "lost", job_id=job_id,
                                  worker=_worker(pods[-1]) if pods else "",
                                  message=f"Job {run} ended ({cond.get('reason', cond['type'])}: "
                                          f"{why}) without a result from the harness; see "
                                          f"`kubectl logs job/{run}`")
        if job.get("spec", {}).get("suspend"):
            return RunObservation(run, "queued", job_id=job_id,
                                  message=f"Job {run} waits to be admitted "
                                          f"(queue {self.lab.kubernetes.get('queue', '-')}).")
        live = [p for p in pods if (p.get("status") or {}).get("phase") in ("Pending", "Running")]
        if live and live[-1]["status"].get("phase") == "Running":
            return RunObservation(run, "running", job_id=job_id, worker=_worker(live[-1]))
        message = f"Job {run} waits for its Pod."
        if live:
            message = f"Pod {live[-1]['metadata']['name']} is pending: {_pending_reason(live[-1])}"
        return RunObservation(run, "queued", job_id=job_id, message=message,
                              worker=_worker(live[-1]) if live else "")

    def _finished(self, pod: dict) -> tuple[dict, int] | None:
        """The harness's result of a terminated Pod, if it can be believed."""
        for cs in (pod.get("status") or {}).get("containerStatuses") or []:
            if cs.get("name") != CONTAINER:
                continue
            term = (cs.get("state") or {}).get("terminated")
            if not term:
                return None
            code = term.get("exitCode")
            result = _parse_result(term.get("message") or "")
            if result is None:
                result = _result_from_log(self.kube.pod_log_tail(
                    self.namespace, pod["metadata"]["name"], CONTAINER))
            if result is None or EXIT_CODES.get(result["status"]) != code:
                return None
            return result, code
        return None

    def cancel(self, run: str) -> RunObservation:
        """Stop the run. A run that finished meanwhile keeps its result (it is returned)."""
        obs = self.observe(run)
        if obs.state in ("succeeded", "failed", "error", "lost"):
            return obs
        self.kube.delete_job(self.namespace, run)
        return RunObservation(run, "cancelled", job_id=obs.job_id, worker=obs.worker,
                              message=f"Job {run} was deleted before it finished.")

    def cleanup(self, run: str) -> None:
        """Remove the run's Job (and its Pods) and ConfigMap, once its result is recorded."""
        self.kube.delete_job(self.namespace, run)
        self.kube.delete_configmap(self.namespace, surface_configmap_name(run))

    def leftovers(self, run: str) -> bool:
        job = self.kube.get_job(self.namespace, run)
        if job is not None and not job["metadata"].get("deletionTimestamp"):
            return True
        return self.kube.get_configmap(self.namespace, surface_configmap_name(run)) is not None


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
    for cs in st.get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting")
        if waiting:
            return waiting.get("message") or waiting.get("reason") or "waiting"
    for cond in st.get("conditions") or []:
        if cond.get("status") == "False" and cond.get("message"):
            return cond["message"]
    return "waiting to be scheduled"
