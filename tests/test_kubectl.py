"""kubectl against the API emulator: docs/cluster.md's walk-through, answered as a real server would.

Every test runs the real `kubectl` (with `--kubeconfig` written into tmp_path)
against `controller.kube.emulator`, served on a free port by a thread of this
process. What a user types works with its defaults (server-side validation
on, tables, watches), and the refusals read as they would on a cluster: an
unknown field, a changed Experiment spec, a name that is not a DNS label, a
stale resourceVersion.
"""

from __future__ import annotations

import asyncio
import json
import queue
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import kmock
import pytest
import yaml

from controller.kube.emulator import Emulator
from test_operator import cluster  # noqa: F401  (the emulator + CRDs fixture, used below)

KUBECTL = shutil.which("kubectl")
pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed: these tests "
                                                        "run the real kubectl against the emulator")

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "manifests" / "examples" / "warmdown-03.yaml"
NAME = "warmdown-03"
NS = "autolab"


def kubeconfig(path: Path, url: str) -> Path:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
        "clusters": [{"name": "emulator", "cluster": {"server": url}}],
        "users": [{"name": "me", "user": {}}],
        "contexts": [{"name": "emulator",
                      "context": {"cluster": "emulator", "user": "me", "namespace": NS}}]}))
    return path


def kubectl_args(config: Path, cache: Path, *args: str) -> list[str]:
    return [KUBECTL, f"--kubeconfig={config}", f"--cache-dir={cache}", *args]


class Api:
    """The emulator on its own event loop in a thread, and kubectl pointed at it."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self.thread = threading.Thread(target=self.loop.run_until_complete,
                                       args=(self._serve(ready),), daemon=True)
        self.thread.start()
        assert ready.wait(20), "the emulator did not start"
        self.config = kubeconfig(tmp / "kubeconfig", self.url)

    async def _serve(self, ready: threading.Event) -> None:
        self.stopping = asyncio.Event()
        async with Emulator() as em, kmock.Server(em) as server:
            self.em, self.url = em, str(server.url).rstrip("/")
            ready.set()
            await self.stopping.wait()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.stopping.set)
        self.thread.join(20)

    def args(self, *args: str) -> list[str]:
        return kubectl_args(self.config, self.tmp / "cache", *args)

    def run(self, *args: str, stdin: str | None = None,
            ok: bool = True) -> subprocess.CompletedProcess:
        p = subprocess.run(self.args(*args), input=stdin, capture_output=True, text=True,
                           timeout=60)
        if ok:
            assert p.returncode == 0, f"kubectl {' '.join(args)}: {p.stderr}"
        return p

    def fails(self, *args: str, stdin: str | None = None) -> str:
        p = self.run(*args, stdin=stdin, ok=False)
        assert p.returncode != 0, f"kubectl {' '.join(args)} succeeded: {p.stdout}"
        return p.stderr

    def json(self, *args: str) -> Any:
        return json.loads(self.run(*args, "-o", "json").stdout)

    def installed(self) -> "Api":
        """docs/cluster.md's first steps: CRDs, the namespace, an example Experiment."""
        self.run("apply", "-k", str(REPO / "crds"))
        self.run("create", "namespace", NS)
        self.run("apply", "-f", str(EXAMPLE))
        return self

    def status(self, name: str, status: dict) -> None:
        self.run("patch", "exp", name, "--subresource=status", "--type=merge",
                 "-p", json.dumps({"status": status}))


@pytest.fixture()
def api(tmp_path: Path):
    a = Api(tmp_path)
    yield a
    a.close()


def example(**changes: Any) -> str:
    doc = yaml.safe_load(EXAMPLE.read_text())
    for path, value in changes.items():
        node = doc
        *parents, leaf = path.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return yaml.safe_dump(doc)


def lines(text: str) -> list[list[str]]:
    return [line.split() for line in text.strip().splitlines()]


# --- 1. install and apply with validation on ----------------------------------------------------

def test_the_readme_install_works_with_validation_on(api):
    out = api.run("apply", "-k", str(REPO / "crds")).stdout
    assert "customresourcedefinition.apiextensions.k8s.io/experiments.autolab.dev created" in out
    assert api.run("create", "namespace", NS).stdout.strip() == f"namespace/{NS} created"
    assert api.run("apply", "-f", str(EXAMPLE)).stdout.strip() == \
        f"experiment.autolab.dev/{NAME} created"
    # Applying the same again changes nothing; so does re-installing the CRDs.
    assert api.run("apply", "-f", str(EXAMPLE)).stdout.strip() == \
        f"experiment.autolab.dev/{NAME} unchanged"
    assert "unchanged" in api.run("apply", "-k", str(REPO / "crds")).stdout
    assert lines(api.run("get", "namespace", NS).stdout)[1][:2] == [NS, "Active"]
    exp = api.json("get", "exp", NAME)
    assert exp["kind"] == "Experiment" and exp["apiVersion"] == "autolab.dev/v1alpha1"
    assert exp["metadata"]["generation"] == 1 and exp["metadata"]["uid"]


def test_an_unknown_field_is_refused_by_default_warned_of_or_pruned(api):
    api.installed()
    typo = example(metadata__name="typo", spec__budgetSeconds=60)
    err = api.fails("apply", "-f", "-", stdin=typo)
    assert 'strict decoding error: unknown field "spec.budgetSeconds"' in err
    assert api.run("get", "exp", "typo", ok=False).returncode != 0

    warned = api.run("apply", "--validate=warn", "-f", "-", stdin=typo)
    assert 'Warning: unknown field "spec.budgetSeconds"' in warned.stderr
    assert "budgetSeconds" not in api.json("get", "exp", "typo")["spec"]  # pruned
    quiet = api.run("apply", "--validate=false", "-f", "-",
                    stdin=example(metadata__name="quiet", spec__budgetSeconds=60))
    assert "Warning" not in quiet.stderr and "budgetSeconds" not in \
        api.json("get", "exp", "quiet")["spec"]
    # What the schema keeps open (status, under x-kubernetes-preserve-unknown-fields) stays.
    api.status("quiet", {"phase": "Queued", "kopf": {"progress": {}}})
    assert api.json("get", "exp", "quiet")["status"]["kopf"] == {"progress": {}}


def test_defaults_of_the_schema_are_filled_in(api):
    api.installed()
    api.run("apply", "-f", "-", stdin=example(metadata__name="no-lab", spec__lab=None))
    assert api.json("get", "exp", "no-lab")["spec"]["lab"] == "default"


# --- 2. get: kinds, tables, printer columns -----------------------------------------------------

def test_get_shows_the_printer_columns_and_wide_adds_the_priority_ones(api):
    api.installed()
    api.status(NAME, {"phase": "Succeeded", "outcome": "Promoted",
                      "metrics": {"val_bpb": 0.9512}, "delta": -0.0123})
    head, row = lines(api.run("get", "exp").stdout)
    assert head == ["NAME", "PHASE", "OUTCOME", "VAL_BPB", "DELTA", "CAMPAIGN", "AGE"]
    assert row[:6] == [NAME, "Succeeded", "Promoted", "0.9512", "-0.0123", "schedule-tuning"]
    assert row[6].endswith("s")
    wide = api.run("-n", NS, "get", "exp", "-o", "wide").stdout.splitlines()
    assert wide[0].split()[-2:] == ["LAB", "HYPOTHESIS"]
    assert "default" in wide[1] and "A shorter warmdown" in wide[1]
    assert lines(api.run("get", "exp", NAME).stdout)[1][0] == NAME   # one object: a table too
    assert api.json("get", "exp")["kind"] == "List"                  # kubectl's own -o json list
    raw = json.loads(api.run("get", "--raw",
                             f"/apis/autolab.dev/v1alpha1/namespaces/{NS}/experiments").stdout)
    assert raw["kind"] == "ExperimentList" and raw["items"][0]["kind"] == "Experiment"


def test_get_of_the_built_in_kinds_shows_their_usual_columns(api):
    api.installed()
    api.run("create", "configmap", "c", "--from-literal=a=1", "--from-literal=b=2")
    api.run("create", "secret", "generic", "s", "--from-literal=key=v")
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
           "spec": {"containers": [{"name": "run", "image": "x"}], "nodeName": "gpu-1"},
           "status": {"phase": "Running", "containerStatuses": [
               {"name": "run", "ready": True, "restartCount": 1, "image": "x", "imageID": "",
                "state": {"running": {}}}]}}
    api.run("create", "-f", "-", stdin=json.dumps(pod))
    assert lines(api.run("get", "configmap", "c").stdout)[1][:2] == ["c", "2"]
    assert lines(api.run("get", "secret", "s").stdout)[1][:3] == ["s", "Opaque", "1"]
    head, row = lines(api.run("get", "pods", "-o", "wide").stdout)
    assert head[:5] == ["NAME", "READY", "STATUS", "RESTARTS", "AGE"] and "NODE" in head
    assert row[:4] == ["p", "1/1", "Running", "1"] and "gpu-1" in row
    assert lines(api.run("get", "crd").stdout)[0] == ["NAME", "CREATED", "AT"]


# --- 3. watch, describe, explain ----------------------------------------------------------------

def test_get_watch_streams_each_change_as_a_row(api):
    api.installed()
    proc = subprocess.Popen(api.args("get", "exp", "-w", "--output-watch-events"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [seen.put(x) for x in proc.stdout], daemon=True).start()

    def until(word: str) -> str:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                line = seen.get(timeout=0.5)
            except queue.Empty:
                continue
            if word in line:
                return line
        raise AssertionError(f"kubectl get -w never printed {word!r}")
    try:
        assert until(NAME).split()[0] == "ADDED"
        api.status(NAME, {"phase": "Queued"})
        assert until("Queued").split()[:2] == ["MODIFIED", NAME]
        api.run("delete", "exp", NAME)
        assert until("DELETED").split()[1] == NAME
    finally:
        proc.terminate()
        proc.wait(10)


def test_describe_shows_the_events_of_that_object_only(api):
    api.installed()
    uid = api.json("get", "exp", NAME)["metadata"]["uid"]

    def event(name: str, about: str, message: str, uid: str = "") -> str:
        return json.dumps({"apiVersion": "v1", "kind": "Event", "metadata": {"name": name},
                           "type": "Normal", "reason": "Queued", "message": message,
                           "involvedObject": {"apiVersion": "autolab.dev/v1alpha1",
                                              "kind": "Experiment", "name": about,
                                              "namespace": NS, "uid": uid},
                           "lastTimestamp": "2026-01-01T00:00:00Z"})
    api.run("create", "-f", "-", stdin=event("e1", NAME, "checks passed; waiting for a GPU", uid))
    api.run("create", "-f", "-", stdin=event("e2", "someone-else", "not about this one"))
    described = api.run("describe", "exp", NAME).stdout
    assert "checks passed; waiting for a GPU" in described
    assert "not about this one" not in described
    listed = api.run("get", "events", f"--field-selector=involvedObject.name={NAME}").stdout
    assert "checks passed" in listed and "not about this one" not in listed
    assert "is not a known field selector" in api.fails("get", "exp",
                                                        "--field-selector=spec.lab=default")


def test_explain_teaches_the_spec_from_the_crd(api):
    api.run("apply", "-k", str(REPO / "crds"))
    out = api.run("explain", "experiment.spec").stdout
    assert "KIND:       Experiment" in out and "VERSION:    v1alpha1" in out
    assert "hypothesis\t<string> -required-" in out
    assert "One sentence: what the change should do to val_bpb" in out
    assert "Name of the Lab this experiment belongs to" in \
        api.run("explain", "exp.spec.lab").stdout


# --- 4. delete ----------------------------------------------------------------------------------

def test_delete_waits_for_finalizers_and_then_the_object_goes(api):
    api.installed()
    api.run("patch", "exp", NAME, "--type=merge",
            "-p", '{"metadata": {"finalizers": ["autolab.dev/finalizer"]}}')
    api.run("delete", "exp", NAME, "--wait=false")
    marked = api.json("get", "exp", NAME)
    assert marked["metadata"]["deletionTimestamp"]
    err = api.fails("patch", "exp", NAME, "--type=merge",
                    "-p", '{"metadata": {"finalizers": ["autolab.dev/finalizer", "other"]}}')
    assert "no new finalizers can be added if the object is being deleted" in err
    api.run("patch", "exp", NAME, "--type=json",
            "-p", '[{"op": "remove", "path": "/metadata/finalizers"}]')
    assert "NotFound" in api.fails("get", "exp", NAME)
    # Without finalizers a delete is immediate; deleting the namespace deletes what is in it.
    api.run("apply", "-f", "-", stdin=example(metadata__name="second"))
    api.run("delete", "namespace", NS)
    assert api.json("get", "exp")["items"] == []
    assert "NotFound" in api.fails("get", "namespace", NS)


async def test_kubectl_delete_returns_within_2s_with_the_operator_running(cluster, tmp_path):
    """The finalizer runs at once on deletionTimestamp's MODIFIED event, not at the next resync."""
    from test_operator import LAB, experiment, operator, seed_lab

    # The finalizer records the cancellation; the ledger's Trackio sync that follows runs in
    # the background (it took 2-4 s here inside the finalizer before), so it is on here too.
    c = cluster
    config = kubeconfig(tmp_path / "kubeconfig", c.url)
    seed_lab(c.root, 1.0)
    await c.apply("labs", LAB)
    async with operator(c, resync_seconds=30):  # a resync must not be what ends the delete
        await c.apply("experiments", experiment("short-lived", "MATRIX_LR = 0.02",
                                                "MATRIX_LR = 0.04"))
        await c.until("a phase and the finalizer", lambda: (
            c.phase("short-lived") in ("Pending", "Queued")
            and (c.get("autolab.dev/v1alpha1/experiments", "short-lived") or {})
            .get("metadata", {}).get("finalizers")))
        started = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            *kubectl_args(config, tmp_path / "cache", "-n", NS, "delete", "exp", "short-lived",
                          "--timeout=20s"),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await proc.communicate()
        took = time.monotonic() - started
    assert proc.returncode == 0, err.decode()
    assert out.decode().strip() == 'experiment.autolab.dev "short-lived" deleted'
    assert c.get("autolab.dev/v1alpha1/experiments", "short-lived") is None
    assert took < 2, f"kubectl delete took {took:.1f}s"


# --- 5. what a real server refuses --------------------------------------------------------------

def test_an_experiment_spec_cannot_change_but_a_lab_spec_can(api):
    api.installed()
    err = api.fails("apply", "-f", "-", stdin=example(spec__hypothesis="Something else."))
    assert err.strip() == (
        f'The Experiment "{NAME}" is invalid: spec: Invalid value: "object": the spec of an '
        "Experiment cannot change once applied (it is one measured run of one diff); to try "
        "something else, create a new Experiment with a new metadata.name")
    # Labels and annotations are not the spec: they may change.
    api.run("label", "exp", NAME, "team=schedules")
    lab = yaml.safe_load((REPO / "manifests" / "lab.yaml").read_text())
    api.run("apply", "-f", "-", stdin=json.dumps(lab))
    lab["spec"]["budgetSeconds"] = int(lab["spec"].get("budgetSeconds", 300)) + 60
    assert "configured" in api.run("apply", "-f", "-", stdin=json.dumps(lab)).stdout
    assert api.json("get", "lab", lab["metadata"]["name"])["metadata"]["generation"] == 2


INVALID = {
    "a name that is not a DNS label": (
        {"metadata__name": "Warmdown_0.3"},
        "metadata.name: Invalid value: \"Warmdown_0.3\": metadata.name in body should match"),
    "too many GPUs": ({"spec__resources": {"gpus": 64}},
                      "spec.resources.gpus: Invalid value: 64: spec.resources.gpus in body "
                      "should be less than or equal to"),
    "an unknown backend": ({"spec__backend": "slurm"},
                           'spec.backend: Unsupported value: "slurm": supported values:'),
    "a fractional priority": ({"spec__priority": 1.5},
                              'spec.priority: Invalid value: "number": spec.priority in body '
                              'must be of type integer: "number"'),
    "no hypothesis": ({"spec__hypothesis": None}, "spec.hypothesis: Required value"),
}


@pytest.mark.parametrize("what", list(INVALID), ids=list(INVALID))
def test_the_schema_is_enforced_with_the_messages_kubectl_prints(api, what):
    api.run("apply", "-k", str(REPO / "crds"))
    changes, message = INVALID[what]
    changes = {"metadata__name": "fresh", **changes}
    err = api.fails("apply", "-f", "-", stdin=example(**changes))
    assert f'The Experiment "{changes["metadata__name"]}" is invalid: ' in err
    assert message in err


def test_a_diff_past_the_annotations_limit_is_refused_by_apply_and_taken_by_create(api):
    """Client-side `kubectl apply` keeps a copy of the whole object in the annotation
    `kubectl.kubernetes.io/last-applied-configuration`, and a server holds an object's
    annotations to 256 KiB. A diff of 100,000 three-byte characters is within the CRD's 128 Ki
    characters but not within that: apply is refused as a real server refuses it, and
    `kubectl create` (no copy) takes it, as docs/cluster.md says."""
    api.run("apply", "-k", str(REPO / "crds"))
    api.run("create", "namespace", NS)
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"]["name"] = "wide"
    doc["spec"]["diff"] += "+# " + "\u20ac" * 100_000 + "\n"  # three bytes each
    text = json.dumps(doc, ensure_ascii=False)
    err = api.fails("apply", "-f", "-", stdin=text)
    assert "metadata.annotations: Too long" in err, err
    assert "created" in api.run("create", "-f", "-", stdin=text).stdout
    assert len(api.json("get", "exp", "wide")["spec"]["diff"]) > 100_000


def test_a_stale_resource_version_is_a_conflict(api):
    api.installed()
    exp = api.json("get", "exp", NAME)
    api.run("label", "exp", NAME, "round=1")                       # someone else writes
    err = api.fails("replace", "-f", "-", stdin=json.dumps(exp))  # PUT with the old version
    assert "the object has been modified; please apply your changes to the latest version" in err
    stale = json.dumps({"metadata": {"resourceVersion": exp["metadata"]["resourceVersion"]},
                        "status": {"phase": "Queued"}})
    assert "Conflict" in api.fails("patch", "exp", NAME, "--subresource=status", "--type=merge",
                                   "-p", stale)
    fresh = api.json("get", "exp", NAME)
    fresh["metadata"]["labels"]["round"] = "2"
    assert "replaced" in api.run("replace", "-f", "-", stdin=json.dumps(fresh)).stdout
    # A PUT of a custom resource must name a version (kubectl replace fills it in; --raw not).
    del fresh["metadata"]["resourceVersion"]
    err = api.fails("replace", "--raw",
                    f"/apis/autolab.dev/v1alpha1/namespaces/{NS}/experiments/{NAME}",
                    "-f", "-", stdin=json.dumps(fresh))
    assert "must be specified for an update" in err


def test_status_is_written_only_through_its_subresource(api):
    api.installed()
    api.status(NAME, {"phase": "Queued"})
    out = api.run("patch", "exp", NAME, "--type=merge", "-p", '{"status": {"phase": "Hacked"}}')
    assert "(no change)" in out.stdout
    api.run("patch", "exp", NAME, "--subresource=status", "--type=merge",
            "-p", '{"spec": {"priority": 5}, "status": {"phase": "Running"}}')
    exp = api.json("get", "exp", NAME)
    assert exp["status"]["phase"] == "Running" and exp["spec"]["priority"] == 0
    assert exp["metadata"]["generation"] == 1  # status and metadata writes leave it


def test_dry_run_on_the_server_stores_nothing(api):
    api.installed()
    out = api.run("apply", "--dry-run=server", "-f", "-", stdin=example(metadata__name="maybe"))
    assert "created (server dry run)" in out.stdout
    assert "NotFound" in api.fails("get", "exp", "maybe")


def test_a_crd_with_a_rule_the_emulator_cannot_evaluate_is_refused(api):
    crd = yaml.safe_load((REPO / "crds" / "lab.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    spec["x-kubernetes-validations"] = [{"rule": "self.budgetSeconds > 0"}]
    err = api.fails("apply", "-f", "-", stdin=json.dumps(crd))
    assert "the emulator evaluates only the rules self == oldSelf" in err


def test_logs_of_a_pod_are_what_the_kubelet_wrote(api):
    api.installed()
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
           "spec": {"containers": [{"name": "run", "image": "x"}]}}
    api.run("create", "-f", "-", stdin=json.dumps(pod))
    api.em.logs[(NS, "p")] = "step 1\nval_bpb: 0.95\n"
    assert api.run("logs", "p").stdout == "step 1\nval_bpb: 0.95\n"
    assert "NotFound" in api.fails("logs", "nobody")
