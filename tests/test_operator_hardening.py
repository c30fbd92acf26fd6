"""The operator against a server that behaves like a real one: what it asks for, what it tells.

Real kopf, the real client and the operator's own code against the API emulator,
with the test playing the kubelet (and Kueue). Each test attacks one promise:

- the run Pods of every Job the operator makes (runs and baselines) get no
  service-account token and no service links: the candidate is hostile code;
- every request the operator makes is one its Role grants (the RBAC of the real
  traffic), and every ownerReference it sets with `blockOwnerDeletion` names an
  owner whose `<plural>/finalizers` it may update (the OwnerReferencesPermission
  admission plugin refuses the object otherwise);
- an experiment whose Job waits for Kueue's admission says so in its status;
- an Event is neither lost nor told twice when posting it fails, or when the
  operator dies between the Event and the status that records it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, AsyncIterator

import aiohttp.web
import kmock
import pytest
import yaml
from kmock._internal import rendering
from kubernetes import client as k8s

from controller.kube.crds import render
from controller.kube.emulator import Emulator
from test_operator import (EXP, JOBS, LAB, NS, REPO, Cluster, experiment, operator, result,
                           seed_lab)

EVENTS = "v1/events"
OURS = ("kopf/", "autolab-operator")  # the User-Agents of kopf's calls and the operator's


Fault = Callable[[str, str, Any], bool]  # (method, path, JSON body) -> fail it?


class FaultyEmulator(Emulator):
    """The emulator, failing the requests a test picks with 500, as an overloaded server does
    (before the emulator sees them: it neither serves nor records them; `faulted` does)."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.faults: list[Fault] = []
        self.faulted: list[tuple[str, str, Any]] = []

    async def __call__(self, raw: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        if self.faults:
            body = await raw.read()
            try:
                data = json.loads(body) if body else None
            except ValueError:
                data = None
            if any(fault(raw.method, raw.path, data) for fault in list(self.faults)):
                self.faulted.append((raw.method, raw.path, data))
                return aiohttp.web.json_response(
                    {"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure",
                     "code": 500, "reason": "InternalError",
                     "message": "the test failed this request"}, status=500)
        return await super().__call__(raw)


@pytest.fixture()
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    async with FaultyEmulator() as em, kmock.Server(em) as server:
        url = str(server.url).rstrip("/")
        api = k8s.ApiClient(k8s.Configuration(host=url))
        ext = k8s.ApiextensionsV1Api(api)
        for text in render().values():
            doc = yaml.safe_load(text)
            if doc.get("kind") == "CustomResourceDefinition":
                await asyncio.to_thread(ext.create_custom_resource_definition, doc)
        yield Cluster(em, url, api, tmp_path / "labs")
        api.close()


def ours(em: Emulator) -> list[rendering.Request]:
    return [r for r in em.requests if (r.headers.get("User-Agent") or "").startswith(OURS)]


def created(em: Emulator, plural: str) -> list[dict]:
    """The bodies of the operator's creates of `plural`, as it sent them."""
    return [r.data for r in ours(em) if r.method == "POST" and r.resource is not None
            and r.resource.plural == plural and isinstance(r.data, dict)]


def events(c: Cluster, name: str, reason: str | None = None) -> list[dict]:
    return [e for e in c.em.items(EVENTS, NS) if e["involvedObject"]["name"] == name
            and reason in (None, e["reason"])]


async def lab_with_a_measured_baseline_and_an_experiment(c: Cluster) -> None:
    """A Lab from scratch (its baseline Job runs and is measured), then an experiment that
    runs, wins and is promoted, then one deleted while its Job runs."""
    await c.apply("labs", LAB)
    baseline = await c.until("the baseline Job", lambda: next(
        (j["metadata"]["name"] for j in c.em.items(JOBS, NS)
         if j["metadata"]["name"].startswith("baseline-")), None))
    await c.finish_pod(await c.start_pod(baseline), result(1.0), exit_code=0)
    await c.apply("experiments", experiment("higher-lr", "MATRIX_LR = 0.02", "MATRIX_LR = 0.03"))
    await c.until("its Job", lambda: c.get(JOBS, "exp-higher-lr-1"), timeout=60)
    await c.finish_pod(await c.start_pod("exp-higher-lr-1"), result(0.95), exit_code=0)
    await c.until("Succeeded", lambda: c.phase("higher-lr") == "Succeeded", timeout=60)
    await c.until("the run's objects cleaned up", lambda: c.get(JOBS, "exp-higher-lr-1") is None)
    await c.apply("experiments", experiment("no-warmdown", "WARMDOWN_RATIO = 0.5",
                                            "WARMDOWN_RATIO = 0.0"))
    await c.until("its Job", lambda: c.get(JOBS, "exp-no-warmdown-1"), timeout=60)
    await c.start_pod("exp-no-warmdown-1")
    await c.until("Running", lambda: c.phase("no-warmdown") == "Running")
    await c.delete("experiments", "no-warmdown")
    await c.until("the deleted experiment gone", lambda: c.get(EXP, "no-warmdown") is None,
                  timeout=60)


async def test_no_run_pod_gets_a_service_account_token_or_service_links(cluster):
    """The candidate is hostile: its Pod must hold no credential of the cluster and no map
    of its services, in every Job the operator makes, baselines included."""
    c = cluster
    async with operator(c):
        await lab_with_a_measured_baseline_and_an_experiment(c)
    jobs = created(c.em, "jobs")
    names = [j["metadata"]["name"] for j in jobs]
    assert any(n.startswith("baseline-") for n in names) and "exp-higher-lr-1" in names, names
    for job in jobs:
        pod = job["spec"]["template"]["spec"]
        where = job["metadata"]["name"]
        assert pod.get("automountServiceAccountToken") is False, where
        assert pod.get("enableServiceLinks") is False, where
        assert "serviceAccountName" not in pod and "serviceAccount" not in pod, where
        for container in pod["initContainers"] + pod["containers"]:
            assert not any("valueFrom" in e for e in container.get("env") or []), where
            assert "envFrom" not in container, where


# --- RBAC: what the operator does, against what manifests/rbac.yaml grants ---------------------

VERBS = {kmock.action.LIST: "list", kmock.action.WATCH: "watch", kmock.action.FETCH: "get",
         kmock.action.CREATE: "create", kmock.action.DELETE: "delete"}


def verb(r: rendering.Request) -> str:
    if r.action == kmock.action.UPDATE:
        return "update" if r.method == "PUT" else "patch"
    return VERBS[r.action]


def rbac() -> tuple[list[dict], list[dict]]:
    docs = [d for d in yaml.safe_load_all((REPO / "manifests" / "rbac.yaml").read_text()) if d]
    (role,) = [d for d in docs if d["kind"] == "Role"]
    cluster_rules = [rule for d in docs if d["kind"] == "ClusterRole" for rule in d["rules"]]
    return role["rules"], cluster_rules


def grants(rules: list[dict], group: str, resource: str, verb_: str) -> bool:
    return any(group in rule["apiGroups"] and resource in rule["resources"]
               and verb_ in rule["verbs"] for rule in rules)


async def test_the_role_grants_every_request_the_operator_makes_and_every_owner_it_names(cluster):
    c = cluster
    async with operator(c):
        await lab_with_a_measured_baseline_and_an_experiment(c)
    role, cluster_role = rbac()
    used = set()
    for r in ours(c.em):
        if r.resource is None or not r.resource.plural:
            continue  # discovery (/api, /apis, /version): every authenticated user may
        resource = r.resource.plural + (f"/{r.subresource}" if r.subresource else "")
        used.add((r.resource.group or "", resource, verb(r), r.namespace is not None))
    assert {("batch", "jobs", "create", True), ("", "events", "create", True),
            ("autolab.dev", "experiments/status", "patch", True)} <= used, used
    refused = sorted((g, res, v) for g, res, v, namespaced in used
                     if not grants(cluster_role, g, res, v)
                     and not (namespaced and grants(role, g, res, v)))
    assert not refused, f"manifests/rbac.yaml does not grant what the operator does: {refused}"

    # blockOwnerDeletion: the API server lets only who may update the owner's finalizers set it.
    plurals = {(doc["spec"]["group"], doc["spec"]["names"]["kind"]): doc["spec"]["names"]["plural"]
               for doc in map(yaml.safe_load, render().values())
               if doc.get("kind") == "CustomResourceDefinition"}
    owners = set()
    for plural in ("jobs", "configmaps", "secrets"):
        for body in created(c.em, plural):
            for ref in body["metadata"].get("ownerReferences") or []:
                group = ref["apiVersion"].rpartition("/")[0]
                owners.add((group, ref["kind"], bool(ref.get("blockOwnerDeletion"))))
    assert {("autolab.dev", "Experiment", True), ("autolab.dev", "Lab", True)} <= owners, owners
    for group, kind, blocks in owners:
        if blocks:
            assert grants(role, group, f"{plurals[(group, kind)]}/finalizers", "update"), kind


# --- Kueue: a suspended Job waits for admission, and the status says so ---------------------------

async def test_a_job_that_waits_for_kueue_says_so_in_the_experiments_status(cluster):
    c = cluster
    seed_lab(c.root, 1.0)
    lab = {**LAB, "spec": {**LAB["spec"], "kubernetes": {**LAB["spec"]["kubernetes"],
                                                         "queue": "gpu-queue"}}}
    await c.apply("labs", lab)
    async with operator(c):
        await c.apply("experiments", experiment("queued", "MATRIX_LR = 0.02", "MATRIX_LR = 0.03"))
        job = await c.until("its Job", lambda: c.get(JOBS, "exp-queued-1"), timeout=60)
        assert job["spec"]["suspend"] is True
        st = await c.until("the status to say it waits for admission", lambda: (
            (c.get(EXP, "queued").get("status") or {}).get("reason") == "WaitingForAdmission"
            and c.get(EXP, "queued")["status"]))
        assert st["phase"] == "Queued"
        assert "gpu-queue" in st["message"] and "free slot" not in st["message"], st["message"]

        # Kueue admits it: the Job is resumed, and the experiment waits for its Pod, then runs.
        await c.call(k8s.BatchV1Api(c.api).patch_namespaced_job, "exp-queued-1", NS,
                     {"spec": {"suspend": False}})
        st = await c.until("the status to leave the admission wait", lambda: (
            (c.get(EXP, "queued").get("status") or {}).get("reason") == "RunQueued"
            and c.get(EXP, "queued")["status"]))
        assert "gpu-queue" not in st["message"]
        await c.start_pod("exp-queued-1")
        await c.until("Running", lambda: c.phase("queued") == "Running")


# --- Events: told once, whatever fails in between -----------------------------------------------

def event_post(reason: str) -> Fault:
    def match(method: str, path: str, data: Any) -> bool:
        return (method == "POST" and path.endswith("/events") and isinstance(data, dict)
                and data.get("reason") == reason)
    return match


def status_write(name: str, phase: str) -> Fault:
    def match(method: str, path: str, data: Any) -> bool:
        return (method == "PATCH" and path.endswith(f"/experiments/{name}/status")
                and isinstance(data, dict) and (data.get("status") or {}).get("phase") == phase)
    return match


def sent(c: Cluster, fault: Fault) -> list[rendering.Request]:
    """The operator's requests that `fault` picks, as the emulator served them."""
    return [r for r in ours(c.em) if fault(r.method, r.url.path, r.data)]


async def test_an_event_that_cannot_be_posted_is_not_lost_when_the_operator_restarts(cluster):
    """The Events API fails, the operator is replaced, the API comes back: the transition is
    told once. (An Event queued behind a status already written would die with the operator.)"""
    c = cluster
    seed_lab(c.root, 1.0)
    await c.apply("labs", LAB)
    failing = event_post("RunStarted")
    async with operator(c):
        await c.apply("experiments", experiment("told", "MATRIX_LR = 0.02", "MATRIX_LR = 0.03"))
        await c.until("its Job", lambda: c.get(JOBS, "exp-told-1"), timeout=60)
        c.em.faults.append(failing)
        await c.start_pod("exp-told-1")
        await c.until("the Event tried", lambda: c.em.faulted)
        await asyncio.sleep(0.5)  # a retry or two, while it still fails
        # Not told, so not recorded either: the next pass makes the transition again.
        assert c.phase("told") == "Queued"
    c.em.faults.remove(failing)
    async with operator(c):
        await c.until("Running", lambda: c.phase("told") == "Running", timeout=60)
        await asyncio.sleep(1.0)  # a few resync periods: nothing tells it again
    assert len(events(c, "told", "RunStarted")) == 1
    assert len(events(c, "told", "Submitted")) == 1


async def test_an_operator_that_dies_between_the_event_and_the_status_tells_it_once(cluster):
    c = cluster
    seed_lab(c.root, 1.0)
    await c.apply("labs", LAB)
    dying = status_write("told", "Running")
    async with operator(c):
        await c.apply("experiments", experiment("told", "MATRIX_LR = 0.02", "MATRIX_LR = 0.03"))
        await c.until("its Job", lambda: c.get(JOBS, "exp-told-1"), timeout=60)
        c.em.faults.append(dying)  # from here on, the status that says Running never lands
        await c.start_pod("exp-told-1")
        await c.until("the Event told", lambda: events(c, "told", "RunStarted"))
        await c.until("the status write tried", lambda: c.em.faulted)
    assert c.phase("told") == "Queued"  # the operator is gone; its transition was not recorded
    c.em.faults.remove(dying)
    async with operator(c):
        await c.until("Running", lambda: c.phase("told") == "Running", timeout=60)
        await asyncio.sleep(1.0)
    assert len(sent(c, event_post("RunStarted"))) >= 2, "the second operator told it again"
    assert len(events(c, "told", "RunStarted")) == 1
    assert len(events(c, "told", "Submitted")) == 1


async def test_an_operator_that_dies_between_the_job_and_its_status_adopts_the_job(cluster):
    """Where the cluster queues the runs (no gpuSlots), a new Experiment's first status is
    written after its Job. An operator that dies in between leaves a Job and no status; the
    next one decides the same run, finds the Job (409 on its create) and adopts it: one Job,
    its uid on the status, each transition told once."""
    c = cluster
    seed_lab(c.root, 1.0)
    lab = json.loads(json.dumps(LAB))
    del lab["spec"]["capacity"]
    await c.apply("labs", lab)
    dying = status_write("adopt", "Queued")
    c.em.faults.append(dying)  # the status after the Job never lands
    async with operator(c):
        await c.apply("experiments", experiment("adopt", "MATRIX_LR = 0.02", "MATRIX_LR = 0.03"))
        await c.until("the status write tried", lambda: c.em.faulted, timeout=60)
    job = c.get(JOBS, "exp-adopt-1")
    assert job is not None and c.phase("adopt") is None  # the Job made, nothing recorded
    c.em.faults.remove(dying)
    async with operator(c):
        st = await c.until("the run's id on its status", lambda: (
            (c.get(EXP, "adopt") or {}).get("status") or {}).get("job", {}).get("id"), timeout=60)
        await asyncio.sleep(0.5)
    assert st == job["metadata"]["uid"], "the first Job adopted, not another made"
    creates = [r for r in ours(c.em) if str(getattr(r.method, "value", r.method)).upper() == "POST"
               and r.url.path.endswith("/jobs")]
    assert len(creates) >= 2, "the second operator submitted again"
    assert c.get(JOBS, "exp-adopt-1")["metadata"]["uid"] == job["metadata"]["uid"]
    assert c.phase("adopt") == "Queued"
    assert len(events(c, "adopt", "ChecksPassed")) == 1
    assert len(events(c, "adopt", "Submitted")) == 1


async def test_a_lab_event_told_by_every_retry_of_a_failing_pass_appears_once(cluster):
    """The baseline Job cannot be created for a while (and the operator is replaced meanwhile):
    every retry tells BaselineSubmitted before it submits; the Lab shows it once."""
    c = cluster
    await c.apply("labs", LAB)

    def baseline_create(method: str, path: str, data: Any) -> bool:
        return (method == "POST" and path.endswith("/jobs") and isinstance(data, dict)
                and data["metadata"]["name"].startswith("baseline-"))

    c.em.faults.append(baseline_create)
    async with operator(c):
        await c.until("a few tries", lambda: len(c.em.faulted) >= 3)
    c.em.faults.remove(baseline_create)
    async with operator(c):
        await c.until("the baseline Job", lambda: created(c.em, "jobs"), timeout=60)
        await asyncio.sleep(1.0)
    told = [e for e in c.em.items(EVENTS, NS) if e["involvedObject"]["kind"] == "Lab"
            and e["reason"] == "BaselineSubmitted"]
    assert len(sent(c, lambda m, p, d: m == "POST" and p.endswith("/events") and isinstance(
        d, dict) and d.get("reason") == "BaselineSubmitted")) >= 2
    assert len(told) == 1, told
