"""The operator in a cluster: real kopf and the real Kubernetes client against an API emulator.

The tests play the parts of a cluster that are not the API server: they
create the Pod a Job would get and mark it running, then terminated with the
harness's result in its termination message, as the kubelet would. Everything
else is the operator's own code path: the lab repo made by `init_lab`, a diff
against the real bench/train.py, the master ConfigMap, the ledger.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import difflib
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import kmock
import kopf
import pytest
import yaml
from kubernetes import client as k8s

from controller.backends.results import result_signature
from controller.kube.cluster import sync_repo_master
from controller.core.hashing import candidate_hash
from controller.core.reconcile import baseline_run_name
from controller.core.spec import SpecError
from controller.kube.crds import render
from controller.kube.emulator import Emulator
from controller.lab.repo import LabRepo
from controller.lab.ledger import Ledger
from controller.operator import Operator, OperatorConfig, register

REPO = Path(__file__).resolve().parents[1]
NS = "autolab"
EXP = "autolab.dev/v1alpha1/experiments"
LABS = "autolab.dev/v1alpha1/labs"
JOBS = "batch/v1/jobs"
CMS = "v1/configmaps"
IMAGE = "registry.example/autolab-bench:1"


# --- the cluster --------------------------------------------------------------------------------

class Cluster:
    """The emulator, a client for the test's own calls, and helpers to play the kubelet."""

    def __init__(self, em: Emulator, url: str, api: k8s.ApiClient, root: Path):
        self.em = em
        self.url = url
        self.api = api
        self.root = root
        self.core = k8s.CoreV1Api(api)
        self.custom = k8s.CustomObjectsApi(api)

    async def call(self, fn: Callable, *args: Any, **kw: Any) -> Any:
        # The emulator serves on this event loop: blocking calls go to a thread.
        return await asyncio.to_thread(fn, *args, **kw)

    async def apply(self, plural: str, doc: dict) -> dict:
        return await self.call(self.custom.create_namespaced_custom_object, "autolab.dev",
                               "v1alpha1", NS, plural, doc)

    async def delete(self, plural: str, name: str) -> None:
        await self.call(self.custom.delete_namespaced_custom_object, "autolab.dev", "v1alpha1",
                        NS, plural, name)

    def get(self, resource: str, name: str) -> dict | None:
        return self.em.get(resource, NS, name)

    def phase(self, name: str) -> str | None:
        obj = self.get(EXP, name)
        return ((obj or {}).get("status") or {}).get("phase")

    async def until(self, what: str, check: Callable[[], Any], timeout: float = 30) -> Any:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            value = check()
            if value:
                return value
            await asyncio.sleep(0.05)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}")

    async def start_pod(self, job_name: str, node: str = "gpu-node-1") -> str:
        """Create the Pod the Job controller would, scheduled and running."""
        job = self.get(JOBS, job_name)
        assert job is not None, f"no Job {job_name}"
        name = f"{job_name}-x7k2p"
        template = job["spec"]["template"]
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": name, "namespace": NS,
                            "labels": {**template["metadata"]["labels"], "job-name": job_name,
                                       "batch.kubernetes.io/job-name": job_name},
                            "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job",
                                                 "name": job_name,
                                                 "uid": job["metadata"]["uid"],
                                                 "controller": True}]},
               "spec": {**template["spec"], "nodeName": node},
               "status": {"phase": "Running", "containerStatuses": [{
                   "name": "run", "image": IMAGE, "imageID": "", "ready": True,
                   "restartCount": 0, "state": {"running": {"startedAt": "2026-11-29T10:00:00Z"}}}]}}
        await self.call(self.core.create_namespaced_pod, NS, pod)
        return name

    async def finish_pod(self, pod: str, result: dict, exit_code: int) -> None:
        """The containers exit: stage and train (the init containers), then the evaluator, whose
        termination message is the harness's result, signed with the key in the run's Secret
        for the candidate its Job was made for."""
        job = self.get(JOBS, pod.rsplit("-", 1)[0])
        run = job["metadata"]["name"]
        secret = self.get("v1/secrets", f"{run}-key")
        result = {**result, "run": run, "limits": {"train_phase_seconds": 300.0},
                  "candidate_sha1": job["metadata"]["annotations"]["autolab.dev/candidate-sha1"]}
        result["signature"] = result_signature(base64.b64decode(secret["data"]["key"]), result)
        phase = "Succeeded" if exit_code == 0 else "Failed"

        def done(name: str, code: int, started: str, finished: str, message: str = "") -> dict:
            return {"name": name, "image": IMAGE, "imageID": "", "ready": False,
                    "restartCount": 0, "state": {"terminated": {
                        "exitCode": code, "reason": "Completed" if code == 0 else "Error",
                        "message": message, "startedAt": started, "finishedAt": finished}}}

        await self.call(self.core.patch_namespaced_pod_status, pod, NS, {"status": {
            "phase": phase,
            "initContainerStatuses": [
                done("stage", 0, "2026-11-29T09:59:00Z", "2026-11-29T09:59:10Z"),
                done("train", 0, "2026-11-29T09:59:10Z", "2026-11-29T10:01:10Z")],
            "containerStatuses": [done("run", exit_code, "2026-11-29T10:01:10Z",
                                       "2026-11-29T10:01:30Z", json.dumps(result))]}},
                        _content_type="application/merge-patch+json")

    def ledger(self, lab: str = "default") -> list[dict]:
        return Ledger(self.root / lab / "research" / "results.tsv").rows()

    def operator_requests(self) -> list[Any]:
        return [r for r in self.em.requests
                if (r.headers.get("User-Agent") or "").startswith(("kopf/", "autolab-operator"))]


@pytest.fixture()
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    async with Emulator() as em, kmock.Server(em) as server:
        url = str(server.url).rstrip("/")
        api = k8s.ApiClient(k8s.Configuration(host=url))
        ext = k8s.ApiextensionsV1Api(api)
        for name, text in render().items():  # the CRDs, installed as kubectl apply -k crds/ would
            doc = yaml.safe_load(text)
            if doc.get("kind") == "CustomResourceDefinition":
                await asyncio.to_thread(ext.create_custom_resource_definition, doc)
        yield Cluster(em, url, api, tmp_path / "labs")
        api.close()


@contextlib.asynccontextmanager
async def operator(c: Cluster, resync_seconds: float = 0.3) -> AsyncIterator[Operator]:
    """A real kopf operator, on its own event loop in a thread, talking HTTP to the emulator.

    Stopping it cancels it, as a crash would; its handler threads are waited for, so nothing
    of it is left writing when the next one starts. resync_seconds: `autolab operator`'s is 30,
    for a test that must not be rescued by a resync.
    """
    op = Operator(OperatorConfig(lab_root=c.root, resync_seconds=resync_seconds, retry_seconds=0.3,
                                 server=c.url, scanning=False, watch_timeout=None))
    registry = register(op, kopf.OperatorRegistry())
    settings = kopf.OperatorSettings()
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    task = loop.create_task(kopf.operator(registry=registry, settings=settings,
                                          standalone=True, namespaces=[NS], ready_flag=ready))

    def run() -> None:
        try:
            loop.run_until_complete(task)
        except asyncio.CancelledError:
            pass
        finally:
            loop.run_until_complete(loop.shutdown_default_executor())
            loop.close()

    thread = threading.Thread(target=run, name="kopf", daemon=True)
    thread.start()
    assert await asyncio.to_thread(ready.wait, 30), "the operator did not start"
    try:
        yield op
    finally:
        loop.call_soon_threadsafe(task.cancel)
        await asyncio.to_thread(thread.join, 30)
        await asyncio.to_thread(settings.execution.executor.shutdown, True)


# --- the specs ----------------------------------------------------------------------------------

SURFACE = (REPO / "bench" / "train.py").read_text()
SEED_HASH = candidate_hash(SURFACE)


def edit(old: str, new: str) -> str:
    assert old in SURFACE, f"{old!r} is not in bench/train.py any more; update the test"
    changed = SURFACE.replace(old, new, 1)
    return "".join(difflib.unified_diff(SURFACE.splitlines(True), changed.splitlines(True),
                                        "a/train.py", "b/train.py"))


def experiment(name: str, old: str, new: str, **spec: Any) -> dict:
    return {"apiVersion": "autolab.dev/v1alpha1", "kind": "Experiment",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"lab": "default", "campaign": "operator-test",
                     "hypothesis": f"{new} trains better in the same budget.",
                     "parent": SEED_HASH[:12], "diff": edit(old, new), **spec}}


LAB = {"apiVersion": "autolab.dev/v1alpha1", "kind": "Lab",
       "metadata": {"name": "default", "namespace": NS},
       "spec": {"backend": "kubernetes", "profile": "tiny", "data": "synthetic",
                "budgetSeconds": 60, "capacity": {"gpuSlots": 2},
                "promotion": {"minDelta": 0},  # one run decides (margins: test_noise.py)
                "kubernetes": {"image": IMAGE, "cachePVC": "autolab-cache", "backoffLimit": 2,
                               "nodeSelector": {"nvidia.com/gpu.present": "true"},
                               "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists",
                                                "effect": "NoSchedule"}],
                               "priorityClassName": "autolab-runs"}}}


def result(val_bpb: float | None, status: str = "succeeded", reason: str = "") -> dict:
    out: dict[str, Any] = {"version": 1, "status": status, "reason": reason,
                           "exit_code": 0 if status == "succeeded" else 1,
                           "candidate_sha1": "0" * 40, "profile": "tiny", "source": "synthetic",
                           "curve": None}
    if val_bpb is not None:
        out["metrics"] = {"val_bpb": val_bpb, "training_seconds": 60.1, "total_seconds": 75.0,
                          "peak_vram_mb": 1024.0, "mfu_percent": 12.5, "total_tokens_M": 3.2,
                          "num_steps": 120, "num_params_M": 1.5, "depth": 2}
    return out


def seed_lab(root: Path, val_bpb: float) -> None:
    """A lab repo whose master was measured already (`autolab init` + a baseline)."""
    from controller.local import init_lab

    lab = init_lab(root / "default", profile="tiny", data="synthetic", name="default",
                   min_delta=0)
    lab.repo.set_master_metric(val_bpb)


# --- the tests ----------------------------------------------------------------------------------

async def test_experiment_runs_as_a_gpu_job_and_its_result_is_recorded_and_promoted(cluster):
    c = cluster
    async with operator(c):
        await c.apply("labs", LAB)
        # The master has no metric yet: its baseline runs first, as a Job of its own.
        master = await c.until("the master ConfigMap", lambda: c.get(CMS, "default-master"))
        doc = json.loads(master["data"]["master.json"])
        assert doc["hash"] == SEED_HASH and doc["val_bpb"] is None
        assert master["data"]["train.py"] == SURFACE
        baseline = baseline_run_name("default", LabRepo(c.root / "default", _lab_spec()).master())
        await c.until("the baseline Job", lambda: c.get(JOBS, baseline))
        await c.apply("experiments", experiment("higher-lr", "MATRIX_LR = 0.02",
                                                "MATRIX_LR = 0.03"))
        await c.until("the experiment to wait for the baseline", lambda: any(
            cond.get("reason") == "WaitingForBaseline"
            for cond in (c.get(EXP, "higher-lr") or {}).get("status", {}).get("conditions", [])))
        assert c.get(JOBS, "exp-higher-lr-1") is None
        pod = await c.start_pod(baseline)
        await c.finish_pod(pod, result(1.0), exit_code=0)
        await c.until("the baseline metric in the master ConfigMap", lambda: json.loads(
            c.get(CMS, "default-master")["data"]["master.json"])["val_bpb"] == 1.0)

        # Now the experiment gets its Job: a GPU, the candidate mounted, the failure policy.
        job = await c.until("the experiment's Job", lambda: c.get(JOBS, "exp-higher-lr-1"))
        exp = c.get(EXP, "higher-lr")
        assert exp["status"]["phase"] == "Queued"
        assert exp["status"]["job"]["name"] == "exp-higher-lr-1"
        assert job["metadata"]["ownerReferences"][0]["uid"] == exp["metadata"]["uid"]
        assert job["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "autolab"
        assert job["metadata"]["labels"]["autolab.dev/experiment"] == "higher-lr"
        spec = job["spec"]
        assert spec["backoffLimit"] == 2 and spec["activeDeadlineSeconds"] == 60 + 1800
        assert spec["podFailurePolicy"]["rules"][0] == {
            "action": "FailJob",
            "onExitCodes": {"containerName": "run", "operator": "In", "values": [3]}}
        assert spec["podFailurePolicy"]["rules"][1]["onPodConditions"] == [
            {"type": "DisruptionTarget"}]
        pod_spec = spec["template"]["spec"]
        assert pod_spec["restartPolicy"] == "Never"
        assert pod_spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        assert pod_spec["priorityClassName"] == "autolab-runs"
        (container,) = pod_spec["containers"]
        assert container["image"] == IMAGE
        assert container["resources"] == {"requests": {"nvidia.com/gpu": "1"},
                                          "limits": {"nvidia.com/gpu": "1"}}
        assert container["terminationMessagePolicy"] == "File"
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in pod_spec["volumes"]}
        assert mounts["candidate"]["readOnly"] is True
        assert volumes["candidate"]["configMap"]["name"] == "exp-higher-lr-1-surface"
        assert volumes["cache"]["persistentVolumeClaim"]["claimName"] == "autolab-cache"
        surface = c.get(CMS, "exp-higher-lr-1-surface")
        assert surface["data"]["train.py"] == SURFACE.replace("MATRIX_LR = 0.02",
                                                              "MATRIX_LR = 0.03", 1)

        pod = await c.start_pod("exp-higher-lr-1")
        await c.until("Running", lambda: c.phase("higher-lr") == "Running")
        await c.finish_pod(pod, result(0.95), exit_code=0)
        await c.until("Succeeded", lambda: c.phase("higher-lr") == "Succeeded")
        st = c.get(EXP, "higher-lr")["status"]
        assert st["outcome"] == "Promoted"
        assert st["metrics"]["val_bpb"] == 0.95 and st["delta"] == pytest.approx(-0.05)
        assert st["job"]["worker"] == f"k8s:gpu-node-1/{pod}"

        # The ledger has its row; the master ConfigMap and the lab repo have the candidate.
        rows = await c.until("the ledger row", lambda: {
            r["run_id"]: r for r in c.ledger() if r["run_id"] == "exp-higher-lr-1"} and {
            r["run_id"]: r for r in c.ledger()})
        assert rows["exp-higher-lr-1"]["status"] == "succeeded"
        assert rows["exp-higher-lr-1"]["promoted"] == "1"
        assert rows[baseline]["status"] == "baseline" and rows[baseline]["val_bpb"] == "1.0"
        master = c.get(CMS, "default-master")
        doc = json.loads(master["data"]["master.json"])
        assert doc["experiment"] == "higher-lr" and doc["val_bpb"] == 0.95
        assert doc["hash"] == st["candidateHash"] == candidate_hash(master["data"]["train.py"])
        assert json.loads(master["data"]["promotions.json"])[-1]["previous"]["val_bpb"] == 1.0
        assert LabRepo(c.root / "default", _lab_spec()).master().hash == doc["hash"]
        await c.until("the Lab's status to mirror the master", lambda: (
            (c.get("autolab.dev/v1alpha1/labs", "default").get("status") or {})
            .get("master", {}).get("val_bpb") == 0.95))
        # The run's Job and its ConfigMap go once the result is recorded.
        await c.until("the Job and its ConfigMap cleaned up", lambda: (
            c.get(JOBS, "exp-higher-lr-1") is None
            and c.get(CMS, "exp-higher-lr-1-surface") is None))
        reasons = [e["reason"] for e in c.em.items("v1/events", NS)
                   if e["involvedObject"]["name"] == "higher-lr"]
        assert {"Submitted", "RunStarted", "Promoted"} <= set(reasons)

        # A candidate that fails: exit code 3, the Job fails at once, Failed, recorded.
        await c.apply("experiments", experiment("no-warmdown", "WARMDOWN_RATIO = 0.5",
                                                "WARMDOWN_RATIO = 0.0"))
        await c.until("its Job", lambda: c.get(JOBS, "exp-no-warmdown-1"))
        pod = await c.start_pod("exp-no-warmdown-1")
        await c.finish_pod(pod, result(None, "failed", "loss is NaN at step 12"), exit_code=3)
        await c.until("Failed", lambda: c.phase("no-warmdown") == "Failed")
        st = c.get(EXP, "no-warmdown")["status"]
        assert st["reason"] == "CandidateFailed" and "NaN" in st["message"]
        row = await c.until("its ledger row", lambda: {
            r["run_id"]: r for r in c.ledger()}.get("exp-no-warmdown-1"))
        assert row["status"] == "failed"

        # Deleting a running experiment cancels its Job and records the cancellation.
        await c.apply("experiments", experiment("deeper", "DEPTH = 8", "DEPTH = 10"))
        await c.until("its Job", lambda: c.get(JOBS, "exp-deeper-1"))
        await c.start_pod("exp-deeper-1")
        await c.until("Running", lambda: c.phase("deeper") == "Running")
        await c.delete("experiments", "deeper")
        await c.until("the Experiment gone", lambda: c.get(EXP, "deeper") is None)
        assert c.get(JOBS, "exp-deeper-1") is None
        row = {r["run_id"]: r for r in c.ledger()}["exp-deeper-1"]
        assert row["status"] == "cancelled" and row["experiment_id"] == "deeper"

        # Made again under that name (another program): refused, not run as exp-deeper-1 (a
        # run of that name is the old one, and its row is written) nor judged on the old row.
        await c.apply("experiments", experiment("deeper", "DEPTH = 8", "DEPTH = 12"))
        await c.until("Invalid", lambda: c.phase("deeper") == "Invalid")
        assert "was used before" in c.get(EXP, "deeper")["status"]["message"]
        assert c.get(JOBS, "exp-deeper-1") is None
        assert [r for r in c.ledger() if r["experiment_id"] == "deeper"] == [row]
    _assert_rbac_allows(c.operator_requests())
    # The same after-record hooks as on one machine: a research note per experiment, Trackio.
    notes = c.root / "default" / "research" / "experiments"
    assert "0.95" in (notes / "higher-lr.md").read_text()
    assert "NaN" in (notes / "no-warmdown.md").read_text()
    assert (c.root / "default" / ".autolab" / "trackio").is_dir()


async def test_two_labs_in_one_namespace_measure_their_baselines_in_separate_jobs(cluster):
    c = cluster
    second = {**LAB, "metadata": {"name": "second", "namespace": NS}}
    async with operator(c):
        await c.apply("labs", LAB)
        await c.apply("labs", second)

        def baselines() -> dict[str, str] | None:
            jobs = {j["metadata"]["labels"]["autolab.dev/lab"]: j["metadata"]["name"]
                    for j in c.em.items(JOBS, NS) if j["metadata"]["name"].startswith("baseline-")}
            return jobs if len(jobs) == 2 else None
        jobs = await c.until("a baseline Job per Lab", baselines)
        assert jobs["default"] != jobs["second"]
        assert jobs["second"] == baseline_run_name(
            "second", LabRepo(c.root / "second", _lab_spec()).master())
        # One Lab's baseline finishing is recorded by that Lab alone; the other's Job stays.
        pod = await c.start_pod(jobs["default"])
        await c.finish_pod(pod, result(1.0), exit_code=0)
        await c.until("the first Lab measured", lambda: json.loads(
            c.get(CMS, "default-master")["data"]["master.json"])["val_bpb"] == 1.0)
        await asyncio.sleep(1.0)  # a few resyncs of both Labs
        assert c.get(JOBS, jobs["second"]) is not None
        assert json.loads(c.get(CMS, "second-master")["data"]["master.json"])["val_bpb"] is None
        second_rows = Ledger(c.root / "second" / "research" / "results.tsv").rows()
        assert [r["run_id"] for r in second_rows] == []


async def test_an_hf_lab_takes_its_token_from_the_labs_secret(cluster):
    """spec.hf.tokenSecret: the operator reads HF_TOKEN from that Secret for the Lab's runs."""
    c = cluster
    await c.call(c.core.create_namespaced_secret, NS, {
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "hf-token", "namespace": NS},
        "data": {"HF_TOKEN": base64.b64encode(b"hf_from_the_secret").decode()}})
    op = Operator(OperatorConfig(lab_root=c.root, server=c.url, scanning=False))
    lab = {**LAB, "spec": {**LAB["spec"], "backend": "hf", "capacity": {"gpuSlots": 3},
                           "hf": {"tokenSecret": "hf-token"}}}
    await c.apply("labs", lab)
    rt = await asyncio.to_thread(op.runtime, NS, "default")
    backend = await asyncio.to_thread(rt.engine.backend, "hf")
    assert backend.token() == "hf_from_the_secret"
    # An HF lab runs gpuSlots jobs at once, whatever GPUs the operator's machine has.
    assert rt.engine.slot_ids() == ["hf-0", "hf-1", "hf-2"]
    missing = {**lab, "metadata": {"name": "other", "namespace": NS},
               "spec": {**lab["spec"], "hf": {"tokenSecret": "no-such-secret"}}}
    await c.apply("labs", missing)
    rt = await asyncio.to_thread(op.runtime, NS, "other")
    with pytest.raises(SpecError, match="no-such-secret.*create it"):
        await asyncio.to_thread(rt.engine.backend, "hf")


async def test_restarted_operator_adopts_its_job_and_records_the_result_once(cluster):
    c = cluster
    seed_lab(c.root, 1.0)  # measured already: no baseline run
    await c.apply("labs", LAB)
    await c.apply("experiments", experiment("warmdown-03", "WARMDOWN_RATIO = 0.5",
                                            "WARMDOWN_RATIO = 0.3"))
    async with operator(c):
        job = await c.until("the Job", lambda: c.get(JOBS, "exp-warmdown-03-1"))
    uid = job["metadata"]["uid"]
    # The status write that followed the create is lost, as in a crash between the two.
    await c.call(c.custom.patch_namespaced_custom_object_status, "autolab.dev", "v1alpha1", NS,
                 "experiments", "warmdown-03", {"status": {"job": None, "phase": "Queued"}},
                 _content_type="application/merge-patch+json")
    async with operator(c):
        await c.until("the Job adopted", lambda: (c.get(EXP, "warmdown-03")["status"]
                                                  .get("job", {}).get("id") == uid))
        pod = await c.start_pod("exp-warmdown-03-1")
        await c.finish_pod(pod, result(1.02), exit_code=0)
        await c.until("Succeeded", lambda: c.phase("warmdown-03") == "Succeeded")
    async with operator(c):
        await asyncio.sleep(1.5)  # a few resync periods of a third operator
    creates = [r for r in c.em.requests if r.method == "POST" and r.resource is not None
               and r.resource.plural == "jobs"]
    assert len(creates) == 2, "the second operator tried once, got 409 and adopted"
    assert c.get(EXP, "warmdown-03")["status"]["outcome"] == "Rejected"
    assert [r["run_id"] for r in c.ledger()].count("exp-warmdown-03-1") == 1


async def test_two_winners_built_on_one_master_never_erase_each_other(cluster):
    """Both beat the master they were built on and finish together. One is promoted; the other
    lacks its change, so it is not promoted over it: it is rebased onto the new master to be
    measured there (FollowUp), and since both change the same line the rebase ends it Conflict,
    never Rejected for MasterMoved. The master history stays a line, each master the one
    before plus one experiment. (Two that rebase cleanly both land: tests/test_race.py.)"""
    c = cluster
    seed_lab(c.root, 1.0)
    await c.apply("labs", LAB)
    async with operator(c):
        await c.apply("experiments", experiment("lr-03", "MATRIX_LR = 0.02", "MATRIX_LR = 0.03"))
        await c.apply("experiments", experiment("lr-04", "MATRIX_LR = 0.02", "MATRIX_LR = 0.04"))
        await c.until("both Jobs", lambda: c.get(JOBS, "exp-lr-03-1") and c.get(JOBS, "exp-lr-04-1"))
        pods = [await c.start_pod("exp-lr-03-1"), await c.start_pod("exp-lr-04-1")]
        await asyncio.gather(c.finish_pod(pods[0], result(0.97), 0),
                             c.finish_pod(pods[1], result(0.96), 0))
        await c.until("both decided", lambda: {c.phase("lr-03"), c.phase("lr-04")} == {
            "Succeeded", "Conflict"})
    statuses = {n: c.get(EXP, n)["status"] for n in ("lr-03", "lr-04")}
    winners = [n for n, st in statuses.items() if st.get("outcome") == "Promoted"]
    assert len(winners) == 1, statuses
    (loser,) = set(statuses) - set(winners)
    assert (statuses[loser]["phase"], statuses[loser]["reason"]) == ("Conflict",
                                                                     "RebaseConflict")
    master = json.loads(c.get(CMS, "default-master")["data"]["master.json"])
    assert master["experiment"] == winners[0]
    promotions = json.loads(c.get(CMS, "default-master")["data"]["promotions.json"])
    assert [p["experiment"] for p in promotions] == winners
    assert promotions[0]["previous"]["hash"] == SEED_HASH  # built on the master it replaced


async def test_a_spec_applied_after_another_writer_moved_the_master_is_checked_against_it(cluster):
    """Someone else promotes into the master ConfigMap (a hand edit, an operator being
    replaced) a moment before a spec is applied, while the operator holds a copy of the master
    it read in the last second. The spec's checks read the master again (a read begun after
    they asked, shared by the checks that ask meanwhile): its candidate is built on the moved
    master, runs, and is promoted over it; the master history stays a line. (Checked against
    the copy instead, it ran on the old master and its win was refused as MasterMoved.)"""
    from controller.kube.cluster import Kube, MasterStore

    c = cluster
    seed_lab(c.root, 1.0)
    await c.apply("labs", LAB)
    async with operator(c):
        await c.apply("experiments", experiment("warm", "EMBEDDING_LR = 0.3", "EMBEDDING_LR = 0.2"))
        await c.until("its Job", lambda: c.get(JOBS, "exp-warm-1"))  # the master was just read
        by_hand = SURFACE.replace("WARMDOWN_RATIO = 0.5", "WARMDOWN_RATIO = 0.4", 1)
        store = MasterStore(Kube(c.api), NS, "default")
        moved = await c.call(store.promote, "by-hand", by_hand, "f" * 40, 0.97, SEED_HASH, 0.0,
                             "2026-12-04T00:00:00Z")
        assert moved.promoted
        await c.apply("experiments", experiment("after", "MATRIX_LR = 0.02", "MATRIX_LR = 0.05"))
        await c.until("its Job", lambda: c.get(JOBS, "exp-after-1"), timeout=60)
        surface = c.get(CMS, "exp-after-1-surface")["data"]["train.py"]
        assert "WARMDOWN_RATIO = 0.4" in surface and "MATRIX_LR = 0.05" in surface
        pod = await c.start_pod("exp-after-1")
        await c.finish_pod(pod, result(0.90), 0)  # beats the seed and the hand edit
        await c.until("its outcome", lambda: (c.get(EXP, "after").get("status") or {}).get(
            "outcome"), timeout=60)
    st = c.get(EXP, "after")["status"]
    assert st["outcome"] == "Promoted" and st["parentHash"] == candidate_hash(by_hand), st
    data = c.get(CMS, "default-master")["data"]
    assert data["train.py"] == surface
    promotions = json.loads(data["promotions.json"])
    assert [p["experiment"] for p in promotions] == ["by-hand", "after"]
    assert promotions[1]["previous"]["hash"] == promotions[0]["hash"]


async def test_duplicate_of_a_run_in_flight_spends_no_gpu(cluster):
    c = cluster
    seed_lab(c.root, 1.0)
    await c.apply("labs", LAB)
    async with operator(c):
        await c.apply("experiments", experiment("first", "MATRIX_LR = 0.02", "MATRIX_LR = 0.05"))
        await c.until("its Job", lambda: c.get(JOBS, "exp-first-1"))
        again = experiment("again", "MATRIX_LR = 0.02", "MATRIX_LR = 0.05  # same idea")
        await c.apply("experiments", again)
        await c.until("Duplicate", lambda: c.phase("again") == "Duplicate")
    assert c.get(EXP, "again")["status"]["duplicateOf"] == "first"
    assert c.get(JOBS, "exp-again-1") is None


@pytest.mark.parametrize("gpu_slots", [None, 2], ids=["cluster-queues", "gpuSlots"])
async def test_an_experiment_gets_its_job_with_few_requests(cluster, gpu_slots):
    """Every request costs the operator and the API server CPU, and every write of the
    Experiment wakes kopf's watch: with a batch of specs that is what bounds apply -> Job.
    Where the cluster queues the runs (no gpuSlots), a new Experiment's status is stored
    once: the checks' outcome, the submitted run and the run queued in one write, made after
    the Job (not Pending while it is checked, nor the run submitted before its Job exists:
    the backend adopts a Job of that name). With gpuSlots the run's slot is stored before
    its Job (the slot book is rebuilt from the statuses), then the run queued. Never
    "waiting for a slot" unless it waits. The Events of those transitions are posted (none
    for Pending, which is not stored), the object kopf has just handed over is not read
    again, and nothing just made is read back. kopf itself writes the Experiment once, to
    add the finalizer: its diff base is kept in memory, not in an annotation."""
    c = cluster
    seed_lab(c.root, 1.0)
    lab = json.loads(json.dumps(LAB))
    if gpu_slots is None:
        del lab["spec"]["capacity"]
    await c.apply("labs", lab)
    async with operator(c, resync_seconds=30):
        await c.until("the Lab's status", lambda: (c.get(LABS, "default") or {}).get("status"))
        first = len(c.em.requests)
        await c.apply("experiments", experiment("few", "MATRIX_LR = 0.02", "MATRIX_LR = 0.05"))
        await c.until("its run's id on its status",
                      lambda: ((c.get(EXP, "few") or {}).get("status") or {}).get("job", {}).get("id"))
        await asyncio.sleep(0.5)  # anything the pass still had to say
    calls = [r for r in c.em.requests[first:]
             if (r.headers.get("User-Agent") or "").startswith("autolab-operator")]
    kopfs = [r for r in c.em.requests[first:] if (r.headers.get("User-Agent") or "").startswith("kopf/")]

    def method(r: Any) -> str:
        return str(getattr(r.method, "value", r.method)).upper()

    statuses = [r.data["status"] for r in calls
                if method(r) == "PATCH" and r.url.path.endswith("/experiments/few/status")]
    assert [(s.get("phase"), s.get("reason")) for s in statuses] == (
        [("Queued", "RunQueued")] if gpu_slots is None
        else [("Queued", "ChecksPassed"), (None, "RunQueued")])
    assert statuses[0]["job"]["slot"] == ("cluster" if gpu_slots is None else "slot-0")
    conditions = {cond["type"]: cond for cond in statuses[0]["conditions"]}
    assert conditions["Checked"]["reason"] == "ChecksPassed"
    assert conditions["Scheduled"]["reason"] == "Submitted", "never stored as waiting: a slot was free"
    assert statuses[0]["job"]["name"] == "exp-few-1" and statuses[-1]["job"]["id"]
    writes = [r.data for r in kopfs if method(r) == "PATCH" and "/experiments/few" in r.url.path]
    assert len(writes) == 1 and "finalizers" in json.dumps(writes[0]), writes
    assert not (c.get(EXP, "few")["metadata"].get("annotations") or {}), "no diff base on it"
    events = [r.data["reason"] for r in calls if method(r) == "POST"
              and r.url.path.endswith("/events") and r.data["involvedObject"]["name"] == "few"]
    assert events == ["ChecksPassed", "Submitted"]
    # Where the cluster queues the run, its Job comes before the Events that tell the submit
    # (they and the status wait for it); on the lab's slots the slot is stored, and told,
    # first.
    posted = ["Job" if r.url.path.endswith("/jobs") else r.data["reason"] for r in calls
              if method(r) == "POST" and (r.url.path.endswith("/jobs") or (
                  r.url.path.endswith("/events") and r.data["involvedObject"]["name"] == "few"))]
    assert posted == (["Job", "ChecksPassed", "Submitted"] if gpu_slots is None
                      else ["ChecksPassed", "Submitted", "Job"]), posted
    reads = [(method(r), r.url.path) for r in calls if method(r) == "GET"]
    assert not [r for r in reads if "/jobs" in r[1] or "/pods" in r[1]
                or r[1].endswith("/experiments/few")], reads


async def test_a_diff_that_escapes_past_the_annotations_limit_gets_its_job_and_one_pass(cluster):
    """An API server holds an object's annotations to 256 KiB in all. kopf's default diff base
    is a JSON copy of the spec in an annotation, where each non-ASCII character takes six
    bytes (`\\u00e9`): a diff of 50,000 of them, well within the CRD's 128 Ki characters, made
    kopf's write after the pass 422 Invalid, so kopf never marked the Experiment handled and
    passed over it again at each of its events. The base is kept in the operator's memory: the
    Experiment gets its Job, once, and one pass."""
    c = cluster
    seed_lab(c.root, 1.0)
    await c.apply("labs", LAB)
    async with operator(c, resync_seconds=30) as op:
        await c.until("the Lab's status", lambda: (c.get(LABS, "default") or {}).get("status"))
        wide = experiment("wide", "MATRIX_LR = 0.02", "MATRIX_LR = 0.05  # " + "\u00e9" * 50_000,
                          hypothesis="A wider comment trains the same.")
        assert len(wide["spec"]["diff"]) < 128 * 1024
        await c.apply("experiments", wide)
        await c.until("its run's id on its status",
                      lambda: ((c.get(EXP, "wide") or {}).get("status") or {}).get("job", {}).get("id"))
        await asyncio.sleep(1.0)  # what kopf would do after the pass: its write, the next event
        passes = [t for t in op.timings if t.handler == "experiment"]
    refused = [r for r in c.em.requests if "/experiments/wide" in r.url.path
               and str(getattr(r.method, "value", r.method)).upper() == "PATCH"
               and not r.url.path.endswith("/status")
               and "annotations" in json.dumps(r.data)]
    assert c.get(JOBS, "exp-wide-1") is not None
    assert len(passes) == 1, f"{len(passes)} passes over one new Experiment"
    assert not refused, "kopf wrote a diff base onto the object"


def test_a_burst_of_lab_changes_is_a_few_writes_off_the_callers_threads_the_last_the_latest(caplog):
    """Each phase change asks for the Lab's status to be mirrored. The pass that tells it goes
    on at once (its Job is not held up by the Lab's write); the changes told while the writer
    waits or writes are left to it, which writes once more: a batch of 53 changes is a few
    writes, never an older state after a newer one, the last holding the latest. A write that
    fails is logged, and the next change is written."""
    from types import SimpleNamespace

    from controller.operator import ClusterEvents

    lab = {"running": 0}
    written: list[int] = []
    writing, go_on = threading.Event(), threading.Event()

    def mirror(rt: Any) -> None:
        seen = lab["running"]  # what the writer reads of the lab
        if seen == -1:
            raise OSError("the API server went away")
        writing.set()
        assert go_on.wait(10)
        written.append(seen)

    rt = SimpleNamespace(namespace=NS, name="default", mirror_lock=threading.Lock(), mirroring=False,
                         mirror_wanted=False, op=SimpleNamespace(_mirror_lab=mirror, closed=False))
    events = ClusterEvents(rt)  # type: ignore[arg-type]

    def idle() -> bool:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with rt.mirror_lock:
                if not rt.mirroring:
                    return True
            time.sleep(0.01)
        return False

    for running in range(1, 51):
        lab["running"] = running
        events.lab_changed()  # returns at once, though the write below waits for go_on
    assert writing.wait(10) and written == []
    for running in range(51, 54):
        lab["running"] = running
        events.lab_changed()  # told during the write: left to the writer
    go_on.set()
    assert idle()
    assert 1 <= len(written) <= 3 and written == sorted(written) and written[-1] == 53, written

    lab["running"] = -1
    with caplog.at_level(logging.WARNING, logger="autolab"):
        events.lab_changed()
        assert idle()
    assert "the Lab's status was not mirrored (the API server went away)" in caplog.text
    lab["running"] = 54
    events.lab_changed()
    assert idle() and written[-1] == 54


ENTRYPOINTS = {
    # The image's entrypoint (manifests/operator.yaml), configured from the environment.
    "python -m controller.cli.operator": [sys.executable, "-m", "controller.cli.operator",
                                          "--standalone", f"--namespace={NS}"],
    # The command people run.
    "autolab operator": [str(Path(sys.executable).parent / "autolab"), "operator", "--standalone",
                         f"--namespace={NS}", "--no-scanning", "--resync=0.5"],
}


@pytest.mark.parametrize("entrypoint", list(ENTRYPOINTS))
async def test_operator_entrypoints_serve_a_lab(cluster, entrypoint):
    c = cluster
    env = {**os.environ, "AUTOLAB_KUBE_SERVER": c.url, "AUTOLAB_LAB_DIR": str(c.root),
           "AUTOLAB_KOPF_SCANNING": "0", "AUTOLAB_RESYNC_SECONDS": "0.5"}
    proc = await asyncio.create_subprocess_exec(
        *ENTRYPOINTS[entrypoint], env=env, cwd=str(REPO), stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE)
    try:
        await c.apply("labs", LAB)
        await c.until("the master ConfigMap", lambda: c.get(CMS, "default-master"), timeout=60)
        await c.until("the baseline Job", lambda: any(
            j["metadata"]["name"].startswith("baseline-") for j in c.em.items(JOBS, NS)))
    finally:
        if proc.returncode is None:
            proc.terminate()
        _, err = await asyncio.wait_for(proc.communicate(), timeout=30)
    assert proc.returncode in (0, 130), err.decode()[-2000:]
    # Lines about one object say which, as `kopf run`'s do: kopf's own and the operator's.
    lab_lines = [line for line in err.decode().splitlines() if f"[{NS}/default] " in line]
    assert any("Handler 'lab-create' succeeded" in line for line in lab_lines), \
        err.decode()[-2000:]
    assert any("creating the lab repo" in line for line in lab_lines), err.decode()[-2000:]


def test_repo_follows_a_master_configmap_it_has_never_seen(tmp_path):
    """A fresh volume under an existing master ConfigMap: the repo adopts the ConfigMap's source."""
    from controller.local import init_lab
    from controller.kube.cluster import MasterRecord
    from controller.core.hashing import semantic_hash

    lab = init_lab(tmp_path / "lab", profile="tiny", data="synthetic")
    newer = SURFACE.replace("DEPTH = 8", "DEPTH = 6", 1)
    rec = MasterRecord(doc={"hash": candidate_hash(newer), "semanticHash": semantic_hash(newer),
                            "commit": "f" * 40, "val_bpb": 0.9, "experiment": "shallower",
                            "parent": SEED_HASH, "promotedAt": "2026-11-29T10:00:00Z"},
                       source=newer, promotions=[], resource_version="7")
    assert sync_repo_master(lab.repo, rec) is True
    m = lab.repo.master()
    assert (m.hash, m.val_bpb, m.experiment) == (candidate_hash(newer), 0.9, "shallower")
    assert lab.repo.master_source() == newer
    assert sync_repo_master(lab.repo, rec) is False


def _lab_spec():
    from controller.core.spec import LabSpec

    return LabSpec.from_dict(LAB["spec"])


# --- RBAC: every call the operator made is one its Role or ClusterRole grants ------------------

def _assert_rbac_allows(requests: list[Any]) -> None:
    docs = list(yaml.safe_load_all((REPO / "manifests" / "rbac.yaml").read_text()))
    rules = [rule for d in docs if d and d["kind"] in ("Role", "ClusterRole")
             for rule in d["rules"]]
    assert requests, "the operator made no calls?"
    denied = set()
    for r in requests:
        if r.resource is None or r.resource.group is None:
            continue  # discovery (/api, /apis, /version): allowed to every authenticated user
        if r.resource.plural is None:
            continue
        verb = {"GET": "get" if r.name else "list", "POST": "create", "PATCH": "patch",
                "DELETE": "delete", "PUT": "update"}[str(r.method).split(".")[-1].upper()]
        if r.params.get("watch") == "true":
            verb = "watch"
        resource = r.resource.plural + (f"/{r.subresource}" if r.subresource else "")
        if not any(r.resource.group in rule.get("apiGroups", [])
                   and resource in rule.get("resources", []) and verb in rule.get("verbs", [])
                   for rule in rules):
            denied.add((r.resource.group, resource, verb))
    assert not denied, f"manifests/rbac.yaml does not grant: {sorted(denied)}"
    for rule in rules:
        assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"]
