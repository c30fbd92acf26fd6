"""The Kubernetes Job backend on its own: what a run's Job looks like, and how its state is read.

No operator here: the backend talks to the API emulator through the real
client, and the test plays the Job controller and the kubelet.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator

import kmock
import pytest
from kubernetes import client as k8s

from controller.backends import RunRequest
from controller.backends.kubernetes import KubernetesBackend
from controller.cluster import Kube, MasterStore
from controller.core.spec import LabSpec
from controller.emulator import Emulator

NS = "autolab"
JOBS = "batch/v1/jobs"


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
            "spec": {"containers": [{"name": "run", "image": "bench:1"}], "nodeName": "n1"},
            "status": status})

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
    return RunRequest(run=run, experiment="e", campaign="c", candidate_source="print(1)\n",
                      candidate_path="", slot="slot-0", profile="tiny", data="synthetic",
                      budget_seconds=30, gpus=gpus)


def terminated(exit_code: int, message: str = "") -> dict:
    return {"phase": "Succeeded" if exit_code == 0 else "Failed", "containerStatuses": [{
        "name": "run", "image": "bench:1", "imageID": "", "ready": False, "restartCount": 0,
        "state": {"terminated": {"exitCode": exit_code, "message": message}}}]}


def harness_result(status: str, val: float | None = None, reason: str = "") -> dict:
    out: dict = {"version": 1, "status": status, "reason": reason}
    if val is not None:
        out["metrics"] = {"val_bpb": val}
    return out


async def call(fn: Any, *args: Any) -> Any:
    return await asyncio.to_thread(fn, *args)


async def test_submitting_twice_adopts_the_job_instead_of_starting_another(env):
    b = env.backend()
    first = await call(b.submit, request())
    again = await call(b.submit, request())
    assert first.state == again.state == "queued"
    assert first.job_id == again.job_id
    assert len(env.em.items(JOBS, NS)) == 1


async def test_kueue_queue_makes_a_suspended_job_that_waits_to_be_admitted(env):
    b = env.backend(queue="gpu-queue")
    obs = await call(b.submit, request())
    job = env.em.get(JOBS, NS, "exp-e-1")
    assert job["spec"]["suspend"] is True
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu-queue"
    assert obs.state == "queued" and "admitted" in obs.message


async def test_cpu_run_requests_no_gpu_and_without_a_cache_pvc_uses_an_empty_dir(env):
    await call(env.backend().submit, request(gpus=0))
    pod = env.em.get(JOBS, NS, "exp-e-1")["spec"]["template"]["spec"]
    assert "resources" not in pod["containers"][0]
    assert {"name": "cache", "emptyDir": {}} in pod["volumes"]


async def test_result_comes_from_the_termination_message(env):
    b = env.backend()
    await call(b.submit, request())
    await env.pod("exp-e-1", "exp-e-1-a", terminated(0, json.dumps(harness_result("succeeded", 0.91))))
    obs = await call(b.observe, "exp-e-1")
    assert obs.state == "succeeded" and obs.result["metrics"]["val_bpb"] == 0.91
    assert obs.worker == "k8s:n1/exp-e-1-a"


async def test_log_is_the_fallback_and_a_line_the_candidate_printed_is_not_believed(env):
    b = env.backend()
    await call(b.submit, request())
    fake = "AUTOLAB_RESULT " + json.dumps(harness_result("succeeded", 0.1))
    # The harness died (exit 137) after the candidate printed a "result": nothing to believe.
    await env.pod("exp-e-1", "exp-e-1-a", terminated(137))
    env.em.logs[(NS, "exp-e-1-a")] = f"step 1\n{fake}\n"
    assert (await call(b.observe, "exp-e-1")).state == "queued"
    await env.job_condition("exp-e-1", "Failed", "BackoffLimitExceeded")
    obs = await call(b.observe, "exp-e-1")
    assert obs.state == "lost" and "BackoffLimitExceeded" in obs.message
    # A harness that could not write its termination message: its own last line, exit code 3.
    await env.pod("exp-e-1", "exp-e-1-b", terminated(3))
    real = "AUTOLAB_RESULT " + json.dumps(harness_result("failed", reason="loss is NaN"))
    env.em.logs[(NS, "exp-e-1-b")] = f"{fake}\nharness: failed\n{real}\n"
    obs = await call(b.observe, "exp-e-1")
    assert obs.state == "failed" and obs.message == "loss is NaN"


async def test_infrastructure_error_is_final_only_when_the_job_gives_up(env):
    b = env.backend()
    await call(b.submit, request())
    await env.pod("exp-e-1", "exp-e-1-a", terminated(4, json.dumps(
        harness_result("error", reason="cache volume full"))))
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
    await env.pod("exp-e-1", "exp-e-1-a", terminated(0, json.dumps(harness_result("succeeded", 0.9))))
    assert (await call(b.cancel, "exp-e-1")).state == "succeeded"
    assert env.em.get(JOBS, NS, "exp-e-1") is not None
    await call(b.submit, request("exp-f-1"))
    assert (await call(b.cancel, "exp-f-1")).state == "cancelled"
    assert env.em.get(JOBS, NS, "exp-f-1") is None


async def test_missing_image_is_refused_with_what_to_set(env):
    b = KubernetesBackend(env.kube, NS, "default", LabSpec())
    with pytest.raises(Exception, match="spec.kubernetes.image"):
        await call(b.submit, request())
    assert env.em.items(JOBS, NS) == []


async def test_master_promotion_is_compare_and_swap_on_the_configmap(env, tmp_path):
    """Two promotions from the same read: the second one's write is refused and compared again."""
    from controller.cli import init_lab

    lab = init_lab(tmp_path / "lab", profile="tiny", data="synthetic")
    lab.repo.set_master_metric(1.0)
    store = MasterStore(env.kube, NS, "default")
    await call(store.ensure, lab.repo)
    stale = await call(store.read)
    assert (await call(store.promote, "a", "A = 1\n", "c1", 0.95, "p", 0.0, "t1")).promoted
    # A writer holding the version it read before "a" was promoted is refused (409)...
    assert await call(store._cas, stale, {"master.json": "{}"}) is False
    # ...and a promotion that no longer beats the new master is rejected, not written.
    res = await call(store.promote, "b", "B = 1\n", "c2", 0.97, "p", 0.0, "t2")
    assert not res.promoted and res.master_val_bpb == 0.95
    doc = (await call(store.read)).doc
    assert doc["experiment"] == "a"
    # Promoting "a" again (a retried pass) is recognised, not applied twice.
    again = await call(store.promote, "a", "A = 1\n", "c1", 0.95, "p", 0.0, "t3")
    assert again.promoted and again.master_val_bpb == 1.0
    assert len((await call(store.read)).promotions) == 1
