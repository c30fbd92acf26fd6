"""The Kubernetes Job backend on its own: what a run's Job looks like, and how its state is read.

No operator here: the backend talks to the API emulator through the real
client, and the test plays the Job controller and the kubelet (and the
harness, signing results with the key the backend put in the run's Secret).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import dataclasses
import json
from pathlib import Path
from typing import Any, AsyncIterator

import kmock
import pytest
import yaml
from kubernetes import client as k8s

from controller.backends import RunRequest
from controller.backends.kubernetes import KubernetesBackend
from controller.backends.results import result_signature
from controller.kube.cluster import Kube, MasterStore, owner_reference
from controller.core.spec import LabSpec
from controller.kube.emulator import Emulator

REPO = Path(__file__).resolve().parents[1]
NS = "autolab"
JOBS = "batch/v1/jobs"
SECRETS = "v1/secrets"
CANDIDATE = "print(1)\n"
SHA1 = hashlib.sha1(CANDIDATE.encode()).hexdigest()


class Env:
    def __init__(self, em: Emulator, api: k8s.ApiClient):
        self.em = em
        self.kube = Kube(api)
        self.core = k8s.CoreV1Api(api)
        self.batch = k8s.BatchV1Api(api)

    def backend(self, **kubernetes: Any) -> KubernetesBackend:
        lab = LabSpec.from_dict({"profile": "tiny", "budgetSeconds": 30,
                                 "kubernetes": {"image": "bench:1", **kubernetes}})
        return KubernetesBackend(self.kube, NS, "default", lab)

    async def pod(self, job: str, name: str, status: dict) -> None:
        await asyncio.to_thread(self.core.create_namespaced_pod, NS, {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NS,
                         "labels": {"job-name": job, "app.kubernetes.io/managed-by": "autolab"}},
            "spec": {"initContainers": [{"name": "stage", "image": "bench:1"},
                                        {"name": "train", "image": "bench:1"}],
                     "containers": [{"name": "run", "image": "bench:1"}], "nodeName": "n1"},
            "status": status})

    def key(self, run: str) -> bytes:
        """The run's key, as the evaluator container reads it from the Secret's volume."""
        secret = self.em.get(SECRETS, NS, f"{run}-key")
        return base64.b64decode(secret["data"]["key"]).strip()

    def signed(self, run: str, status: str, val: float | None = None, reason: str = "",
               limit: float = 100.0, **extra: Any) -> str:
        """The termination message the harness's evaluate phase writes for `run`."""
        out = harness_result(status, val, reason)
        out.update({"run": run, "candidate_sha1": SHA1, "limits": {"train_phase_seconds": limit},
                    **extra})
        out["signature"] = result_signature(self.key(run), out)
        return json.dumps(out)

    async def job_condition(self, job: str, type_: str, reason: str) -> None:
        await asyncio.to_thread(self.batch.patch_namespaced_job_status, job, NS, {"status": {
            "conditions": [{"type": type_, "status": "True", "reason": reason,
                            "message": f"Job has reached {reason}"}]}},
            _content_type="application/merge-patch+json")


@pytest.fixture()
async def env() -> AsyncIterator[Env]:
    async with Emulator() as em, kmock.Server(em) as server:
        api = k8s.ApiClient(k8s.Configuration(host=str(server.url).rstrip("/")))
        yield Env(em, api)
        api.close()


def request(run: str = "exp-e-1", gpus: int = 1) -> RunRequest:
    return RunRequest(run=run, experiment="e", campaign="c", candidate_source=CANDIDATE,
                      slot="slot-0", profile="tiny", data="synthetic",
                      budget_seconds=30, gpus=gpus)


def init_status(name: str, exit_code: int, seconds: float = 0, reason: str = "Completed",
                message: str = "") -> dict:
    finished = f"2026-12-01T10:{int(seconds) // 60:02d}:{int(seconds) % 60:02d}Z"
    return {"name": name, "image": "bench:1", "imageID": "", "ready": exit_code == 0,
            "restartCount": 0, "state": {"terminated": {
                "exitCode": exit_code, "reason": reason, "message": message,
                "startedAt": "2026-12-01T10:00:00Z", "finishedAt": finished}}}


def terminated(exit_code: int, message: str = "", train_seconds: float = 40) -> dict:
    """A Pod whose stage and train init containers did their part and whose evaluator exited."""
    return {"phase": "Succeeded" if exit_code == 0 else "Failed",
            "initContainerStatuses": [init_status("stage", 0, 5),
                                      init_status("train", 0, train_seconds)],
            "containerStatuses": [{
                "name": "run", "image": "bench:1", "imageID": "", "ready": False,
                "restartCount": 0, "state": {"terminated": {"exitCode": exit_code,
                                                            "message": message}}}]}


def harness_result(status: str, val: float | None = None, reason: str = "") -> dict:
    out: dict = {"version": 2, "status": status, "reason": reason}
    if val is not None:
        out["metrics"] = {"val_bpb": val}
    return out


async def call(fn: Any, *args: Any) -> Any:
    return await asyncio.to_thread(fn, *args)


async def test_submitting_twice_adopts_the_job_instead_of_starting_another(env):
    b = env.backend()
    first = await call(b.submit, request())
    key = env.key("exp-e-1")
    again = await call(b.submit, request())
    assert first.state == again.state == "queued"
    assert first.job_id == again.job_id
    assert len(env.em.items(JOBS, NS)) == 1
    assert env.key("exp-e-1") == key  # the key the first Job's evaluator signs with stays


async def test_a_new_run_is_three_creates_and_no_reads(env):
    """Submitting writes the Secret, the ConfigMap and the Job, and reads nothing back: the
    Job's answer to its create is what the run looks like (queued, no Pod yet)."""
    b = env.backend()
    before = len(env.em.requests)
    obs = await call(b.submit, request())
    calls = [(r.method.value if hasattr(r.method, "value") else str(r.method), r.url.path)
             for r in env.em.requests[before:]]
    assert calls == [("POST", f"/api/v1/namespaces/{NS}/secrets"),
                     ("POST", f"/api/v1/namespaces/{NS}/configmaps"),
                     ("POST", f"/apis/batch/v1/namespaces/{NS}/jobs")]
    assert obs.state == "queued" and obs.message == "Job exp-e-1 waits for its Pod."
    assert obs.job_id == env.em.get(JOBS, NS, "exp-e-1")["metadata"]["uid"]
    assert obs == await call(b.observe, "exp-e-1"), "what a later look sees, until a Pod comes"


async def test_kueue_queue_makes_a_suspended_job_that_waits_to_be_admitted(env):
    b = env.backend(queue="gpu-queue")
    obs = await call(b.submit, request())
    job = env.em.get(JOBS, NS, "exp-e-1")
    assert job["spec"]["suspend"] is True
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu-queue"
    assert obs.state == "queued" and obs.reason == "WaitingForAdmission"
    assert "gpu-queue" in obs.message and "admit" in obs.message


async def test_cpu_run_requests_no_gpu_and_without_a_cache_pvc_uses_an_empty_dir(env):
    await call(env.backend().submit, request(gpus=0))
    pod = env.em.get(JOBS, NS, "exp-e-1")["spec"]["template"]["spec"]
    assert all("resources" not in c for c in pod["containers"] + pod["initContainers"])
    assert {"name": "cache", "emptyDir": {}} in pod["volumes"]


async def test_only_the_evaluator_is_told_how_long_the_evaluation_may_take(env):
    """The bound the controller sets from the master's evaluation (core.evaluation) reaches the
    harness of the evaluate phase; without one, the profile's eval_timeout holds."""
    await call(env.backend().submit, dataclasses.replace(request(), eval_limit=200.0))
    await call(env.backend().submit, request("exp-f-1"))
    pods = {n: env.em.get(JOBS, NS, n)["spec"]["template"]["spec"] for n in ("exp-e-1", "exp-f-1")}
    run = pods["exp-e-1"]["containers"][0]["command"]
    assert run[run.index("--eval-limit") + 1] == "200"
    assert not [c for c in pods["exp-e-1"]["initContainers"] if "--eval-limit" in c["command"]]
    assert "--eval-limit" not in pods["exp-f-1"]["containers"][0]["command"]


async def test_the_candidate_trains_in_a_container_of_its_own_with_least_privilege(env):
    """stage -> train -> evaluate, one container each: the candidate's container gets the
    training split and a place to export, nothing else; only the evaluator sees the
    validation data and the key; every container is locked down."""
    b = env.backend(cachePVC="autolab-cache")
    await call(b.submit, request())
    job = env.em.get(JOBS, NS, "exp-e-1")
    assert job["metadata"]["annotations"]["autolab.dev/candidate-sha1"] == SHA1
    # Every field is one the Kubernetes API knows (a misspelt one would be dropped here).
    client = k8s.ApiClient()
    model = client._ApiClient__deserialize(json.loads(json.dumps(job["spec"])), "V1JobSpec")
    assert client.sanitize_for_serialization(model) == job["spec"]

    pod = job["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["shareProcessNamespace"] is False and pod["enableServiceLinks"] is False
    assert not (pod["hostPID"] or pod["hostIPC"] or pod["hostNetwork"])
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert "serviceAccountName" not in pod
    stage, train = pod["initContainers"]
    (run,) = pod["containers"]
    assert [c["name"] for c in (stage, train, run)] == ["stage", "train", "run"]
    for c in (stage, train, run):
        sc = c["securityContext"]
        assert sc["runAsNonRoot"] is True and sc["runAsUser"] != 0
        assert sc["allowPrivilegeEscalation"] is False and sc["privileged"] is False
        assert sc["capabilities"] == {"drop": ["ALL"]}
        assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
        assert sc["readOnlyRootFilesystem"] is True
        assert "envFrom" not in c and all("valueFrom" not in e for e in c["env"])
        assert c["command"][:3] == ["python", "-I", "/opt/autolab/bench/run.py"]
    phase = {c["name"]: c["command"][c["command"].index("--phase") + 1] for c in (stage, train, run)}
    assert phase == {"stage": "stage", "train": "train", "run": "evaluate"}
    assert train["command"][train["command"].index("--sandbox") + 1] == "container"
    assert run["command"][run["command"].index("--run") + 1] == "exp-e-1"
    assert run["terminationMessagePolicy"] == "File"

    volumes = {v["name"]: v for v in pod["volumes"]}

    def mounts(c: dict) -> dict[str, tuple[str, bool]]:
        return {m["name"]: (m["mountPath"], m.get("readOnly", False)) for m in c["volumeMounts"]}

    assert mounts(stage) == {"cache": ("/var/cache/autolab", False),
                             "train-data": ("/autolab/train-data", False),
                             "stage-tmp": ("/tmp", False)}
    assert mounts(train) == {"candidate": ("/autolab/candidate", True),
                             "train-data": ("/autolab/train-data", False),  # train.bin unlinked
                             "export": ("/autolab/export", False),
                             "train-tmp": ("/tmp", False)}
    assert mounts(run) == {"candidate": ("/autolab/candidate", True),
                           "cache": ("/var/cache/autolab", True),
                           "export": ("/autolab/export", True),
                           "key": ("/autolab/key", True),
                           "run-tmp": ("/tmp", False)}
    for name in ("train-data", "export", "stage-tmp", "train-tmp", "run-tmp"):
        assert volumes[name] == {"name": name, "emptyDir": {}}
    assert volumes["cache"]["persistentVolumeClaim"]["claimName"] == "autolab-cache"
    assert volumes["key"]["secret"]["secretName"] == "exp-e-1-key"
    # The key: a Secret of its own, mounted into the evaluator only, named nowhere else.
    assert len(env.key("exp-e-1")) == 64
    key = env.key("exp-e-1").decode()
    assert key not in json.dumps(job)
    assert [c["name"] for c in (stage, train, run) if "key" in mounts(c)] == ["run"]
    assert [c["name"] for c in (stage, train, run) if "cache" in mounts(c)] == ["stage", "run"]
    gpus = {c["name"]: (c.get("resources") or {}).get("limits") for c in (stage, train, run)}
    assert gpus == {"stage": None, "train": {"nvidia.com/gpu": "1"}, "run": {"nvidia.com/gpu": "1"}}
    rules = job["spec"]["podFailurePolicy"]["rules"]
    assert rules[2] == {"action": "FailJob", "onExitCodes": {
        "containerName": "train", "operator": "NotIn", "values": [0, 4]}}
    secret = env.em.get(SECRETS, NS, "exp-e-1-key")
    assert secret["metadata"]["labels"]["autolab.dev/run"] == "exp-e-1"


async def test_no_pod_hostname_tells_a_candidate_which_run_it_is(env):
    """A Pod's hostname is its name unless the Pod says otherwise, and the name is the run's
    (`exp-e-1-c3-x7k2p`): a confirm run's candidate would read its place, and so whose run
    comes next, from `hostname`. Every run's Pod has the same hostname, which names no run."""
    b = env.backend()
    runs = ("exp-e-1-c1", "exp-e-1-m1", "exp-e-1-c2")
    for run in runs:
        await call(b.submit, request(run))
    hostnames = {env.em.get(JOBS, NS, run)["spec"]["template"]["spec"].get("hostname")
                 for run in runs}
    assert len(hostnames) == 1, hostnames
    (hostname,) = hostnames
    assert hostname and not any(part in hostname for part in ("exp-", "-c1", "-m1", "-c2"))
    assert len(hostname) <= 63 and all(c.isalnum() or c == "-" for c in hostname)  # DNS-1123


async def test_result_comes_from_the_termination_message(env):
    b = env.backend()
    await call(b.submit, request())
    await env.pod("exp-e-1", "exp-e-1-a", terminated(0, env.signed("exp-e-1", "succeeded", 0.91)))
    obs = await call(b.observe, "exp-e-1")
    assert obs.state == "succeeded" and obs.result["metrics"]["val_bpb"] == 0.91
    assert obs.result["train_container_seconds"] == 40
    assert "signature" not in obs.result
    assert obs.worker == "k8s:n1/exp-e-1-a"


async def test_log_is_the_fallback_and_a_line_the_candidate_printed_is_not_believed(env):
    b = env.backend()
    await call(b.submit, request())
    fake = "AUTOLAB_RESULT " + json.dumps(harness_result("succeeded", 0.1))
    # The harness died (exit 137) after a "result" was printed: nothing to believe.
    await env.pod("exp-e-1", "exp-e-1-a", terminated(137))
    env.em.logs[(NS, "exp-e-1-a")] = f"step 1\n{fake}\n"
    assert (await call(b.observe, "exp-e-1")).state == "queued"
    await env.job_condition("exp-e-1", "Failed", "BackoffLimitExceeded")
    obs = await call(b.observe, "exp-e-1")
    assert obs.state == "lost" and "BackoffLimitExceeded" in obs.message
    # A harness that could not write its termination message: its own last line, exit code 3.
    await env.pod("exp-e-1", "exp-e-1-b", terminated(3))
    real = "AUTOLAB_RESULT " + env.signed("exp-e-1", "failed", reason="loss is NaN")
    env.em.logs[(NS, "exp-e-1-b")] = f"{fake}\nharness: failed\n{real}\n"
    obs = await call(b.observe, "exp-e-1")
    assert obs.state == "failed" and obs.message == "loss is NaN"


@pytest.mark.parametrize("forgery", ["unsigned", "other run", "other key", "other candidate"])
async def test_a_result_that_is_not_this_runs_harness_is_not_believed(env, forgery):
    b = env.backend()
    await call(b.submit, request())
    await call(b.submit, request("exp-f-1"))
    message = {
        "unsigned": json.dumps(harness_result("succeeded", 0.1) | {"run": "exp-e-1",
                                                                   "candidate_sha1": SHA1}),
        "other run": env.signed("exp-f-1", "succeeded", 0.1),  # a valid result, of another run
        "other key": json.dumps(json.loads(env.signed("exp-e-1", "succeeded", 0.1))
                                | {"signature": "0" * 64}),
        "other candidate": env.signed("exp-e-1", "succeeded", 0.1, candidate_sha1="f" * 40),
    }[forgery]
    await env.pod("exp-e-1", "exp-e-1-a", terminated(0, message))
    assert (await call(b.observe, "exp-e-1")).state == "queued"  # not final: nothing believed
    await env.job_condition("exp-e-1", "Complete", "Completed")
    obs = await call(b.observe, "exp-e-1")
    assert obs.state == "error" and obs.result["reason_code"] == "ResultNotAuthentic"
    assert "metrics" not in obs.result


async def test_a_train_container_that_ran_past_its_allowance_fails_with_budget_exceeded(env):
    """The harness in the train container is within the candidate's reach; its Pod status is
    not: a run whose train container outlasted the harness's own limit is BudgetExceeded,
    whatever the signed result says."""
    b = env.backend()
    await call(b.submit, request())
    await call(b.submit, request("exp-f-1"))
    await env.pod("exp-e-1", "exp-e-1-a", terminated(
        0, env.signed("exp-e-1", "succeeded", 0.5, limit=100.0), train_seconds=161))
    obs = await call(b.observe, "exp-e-1")
    assert obs.state == "failed" and obs.result["reason_code"] == "BudgetExceeded"
    assert obs.result["train_container_seconds"] == 161 and "metrics" not in obs.result
    assert "161s" in obs.message and "100s" in obs.message
    # Just within: believed.
    await env.pod("exp-f-1", "exp-f-1-a", terminated(
        0, env.signed("exp-f-1", "succeeded", 0.5, limit=100.0), train_seconds=99))
    obs = await call(b.observe, "exp-f-1")
    assert obs.state == "succeeded" and obs.result["train_container_seconds"] == 99


async def test_a_result_the_controller_cannot_hold_to_its_budget_is_an_error(env):
    b = env.backend()
    await call(b.submit, request())
    status = terminated(0, env.signed("exp-e-1", "succeeded", 0.5))
    del status["initContainerStatuses"][1]["state"]["terminated"]["finishedAt"]
    await env.pod("exp-e-1", "exp-e-1-a", status)
    await env.job_condition("exp-e-1", "Complete", "Completed")
    obs = await call(b.observe, "exp-e-1")
    assert obs.state == "error" and "how long the train container ran" in obs.message


async def test_a_train_container_that_died_outside_the_harness_fails_the_run(env):
    b = env.backend()
    await call(b.submit, request())
    await env.pod("exp-e-1", "exp-e-1-a", {
        "phase": "Failed", "conditions": [{"type": "DisruptionTarget", "status": "True"}],
        "initContainerStatuses": [init_status("stage", 0, 5),
                                  init_status("train", 137, 30, reason="Error")]})
    assert (await call(b.observe, "exp-e-1")).state == "queued"  # preempted: the Job retries
    await env.pod("exp-e-1", "exp-e-1-b", {
        "phase": "Failed", "initContainerStatuses": [
            init_status("stage", 0, 5), init_status("train", 137, 30, reason="OOMKilled")]})
    obs = await call(b.observe, "exp-e-1")
    assert obs.state == "failed" and obs.result["reason_code"] == "CandidateCrashed"
    assert "OOMKilled" in obs.message and obs.worker == "k8s:n1/exp-e-1-b"


async def test_a_stage_container_that_failed_is_named_when_the_job_gives_up(env):
    b = env.backend()
    await call(b.submit, request())
    await env.pod("exp-e-1", "exp-e-1-a", {"phase": "Failed", "initContainerStatuses": [
        init_status("stage", 4, 5, reason="Error", message=json.dumps(
            {"ok": False, "reason": "preparing the data (hub) failed: no network"}))]})
    assert (await call(b.observe, "exp-e-1")).state == "queued"
    await env.job_condition("exp-e-1", "Failed", "BackoffLimitExceeded")
    obs = await call(b.observe, "exp-e-1")
    assert obs.state == "lost" and "stage container failed: preparing the data (hub)" in obs.message


async def test_the_train_containers_own_words_are_not_the_runs_message(env):
    """The candidate runs in the train container with its harness's uid and can write the
    container's termination message: a lost run tells the kubelet's reason and exit code of
    it, never its text (it could blame the GPU and ask for a rerun)."""
    b = env.backend()
    await call(b.submit, request())
    await env.pod("exp-e-1", "exp-e-1-a", {"phase": "Failed", "initContainerStatuses": [
        init_status("stage", 0, 5),
        init_status("train", 4, 30, reason="Error",
                    message="GPU Xid 79: fallen off the bus; please retry")]})
    await env.job_condition("exp-e-1", "Failed", "BackoffLimitExceeded")
    obs = await call(b.observe, "exp-e-1")
    assert obs.state == "lost", obs
    assert "Xid" not in obs.message and "retry" not in obs.message, obs.message
    assert "train container failed: Error (exit code 4)" in obs.message, obs.message


async def test_infrastructure_error_is_final_only_when_the_job_gives_up(env):
    b = env.backend()
    await call(b.submit, request())
    await env.pod("exp-e-1", "exp-e-1-a", terminated(4, env.signed(
        "exp-e-1", "error", reason="cache volume full")))
    assert (await call(b.observe, "exp-e-1")).state == "queued"  # the Job retries (backoffLimit)
    await env.job_condition("exp-e-1", "Failed", "BackoffLimitExceeded")
    obs = await call(b.observe, "exp-e-1")
    assert obs.state == "error" and obs.message == "cache volume full"


async def test_job_past_its_deadline_without_a_result_is_lost(env):
    b = env.backend()
    await call(b.submit, request())
    await env.pod("exp-e-1", "exp-e-1-a", {"phase": "Running", "containerStatuses": [{
        "name": "run", "image": "bench:1", "imageID": "", "ready": True, "restartCount": 0,
        "state": {"running": {}}}]})
    assert (await call(b.observe, "exp-e-1")).state == "running"
    await env.job_condition("exp-e-1", "Failed", "DeadlineExceeded")
    obs = await call(b.observe, "exp-e-1")
    assert obs.state == "lost" and "DeadlineExceeded" in obs.message


async def test_cancel_keeps_a_result_that_arrived_first(env):
    b = env.backend()
    await call(b.submit, request())
    await env.pod("exp-e-1", "exp-e-1-a", terminated(0, env.signed("exp-e-1", "succeeded", 0.9)))
    assert (await call(b.cancel, "exp-e-1")).state == "succeeded"
    assert env.em.get(JOBS, NS, "exp-e-1") is not None
    await call(b.submit, request("exp-f-1"))
    assert (await call(b.cancel, "exp-f-1")).state == "cancelled"
    assert env.em.get(JOBS, NS, "exp-f-1") is None


async def test_cleanup_removes_the_job_its_candidate_and_its_key(env):
    b = env.backend()
    await call(b.submit, request())
    assert await call(b.leftovers, "exp-e-1")
    await call(b.cleanup, "exp-e-1")
    assert env.em.get(SECRETS, NS, "exp-e-1-key") is None
    assert not await call(b.leftovers, "exp-e-1")


def test_rbac_grants_what_the_backend_does_with_keys_and_owner_references():
    docs = list(yaml.safe_load_all((REPO / "manifests" / "rbac.yaml").read_text()))
    (role,) = [d for d in docs if d and d["kind"] == "Role"]

    def granted(group: str, resource: str, verb: str) -> bool:
        return any(group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"]
                   for r in role["rules"])

    assert all(granted("", "secrets", v) for v in ("get", "create", "delete"))
    ref = owner_reference({"apiVersion": "autolab.dev/v1alpha1", "kind": "Experiment",
                           "metadata": {"name": "e", "uid": "u"}})
    if ref.get("blockOwnerDeletion"):  # the API server then checks update on the finalizers
        assert granted("autolab.dev", "experiments/finalizers", "update")
        assert granted("autolab.dev", "labs/finalizers", "update")


async def test_missing_image_is_refused_with_what_to_set(env):
    b = KubernetesBackend(env.kube, NS, "default", LabSpec())
    with pytest.raises(Exception, match="spec.kubernetes.image"):
        await call(b.submit, request())
    assert env.em.items(JOBS, NS) == []


async def test_master_promotion_is_compare_and_swap_on_the_configmap(env, tmp_path):
    """Two promotions from the same read: the second one's write is refused and compared again."""
    from controller.local import init_lab

    lab = init_lab(tmp_path / "lab", profile="tiny", data="synthetic")
    lab.repo.set_master_metric(1.0)
    store = MasterStore(env.kube, NS, "default")
    await call(store.ensure, lab.repo)
    stale = await call(store.read)
    seed = stale.doc["hash"]
    assert (await call(store.promote, "a", "A = 1\n", "c1", 0.95, seed, 0.0, "t1")).promoted
    # A writer holding the version it read before "a" was promoted is refused (409)...
    assert await call(store._cas, stale, {"master.json": "{}"}) is False
    # ...a promotion built on the old master is refused however good (it lacks "a")...
    res = await call(store.promote, "b", "B = 1\n", "c2", 0.90, seed, 0.0, "t2")
    assert not res.promoted and res.reason == "MasterMoved"
    # ...and one built on "a" that does not beat it is rejected, not written.
    a_hash = (await call(store.read)).doc["hash"]
    res = await call(store.promote, "c", "C = 1\n", "c3", 0.97, a_hash, 0.0, "t3")
    assert not res.promoted and res.master_val_bpb == 0.95 and res.reason == "DidNotBeatMaster"
    doc = (await call(store.read)).doc
    assert doc["experiment"] == "a"
    # Promoting "a" again (a retried pass) is recognised, not applied twice.
    again = await call(store.promote, "a", "A = 1\n", "c1", 0.95, seed, 0.0, "t4")
    assert again.promoted and again.master_val_bpb == 1.0
    assert len((await call(store.read)).promotions) == 1
