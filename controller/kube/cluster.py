"""What a lab keeps in a Kubernetes cluster: the API it talks through, the master of record, slots.

Three pieces the operator builds on, each small enough to read in one go:

- `Kube`: the few calls the operator makes, through the official `kubernetes`
  client, answering plain dicts (the objects as the API server sent them), so
  nothing here depends on the client's generated models. Writes are merge
  patches; a 404 on a read is `None` (`unless_gone`), every other error is the
  client's `ApiException`. The calls of every pass go below the generated methods, to the
  `ApiClient` they use (`Kube.request`: its authentication, TLS, retries and
  errors): a generated method first validates its arguments with pydantic and
  turns a dict body into the client's model and back, ~4 ms of CPU for a Job.

- `MasterStore`: the ConfigMap `<lab>-master`, the master of record in a
  cluster. It holds `train.py` (the promoted surface), `master.json` (hash,
  semanticHash, commit, val_bpb, experiment, parent, promotedAt) and
  `promotions.json` (the last promotions, newest last). A promotion is a merge
  patch that names the `resourceVersion` it read: if another writer got there
  first the API server answers 409, and the store reads again and compares
  again (the core's `promotion_refused`), so two winners finishing together never
  overwrite each other. The operator's lab repo follows it (`sync_repo_master`),
  never the other way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from controller.core.errors import MachineError
from controller.core.hashing import candidate_hash, semantic_hash
from controller.core.reconcile import Master, PromotionResult, promotion_refused
from controller.core.spec import GROUP, VERSION
from controller.lab.files import atomic_write
from controller.lab.master import MASTER_BRANCH, read_places
from controller.lab.repo import LabRepo

MERGE_PATCH = "application/merge-patch+json"
CUSTOM_OBJECT = "/apis/{group}/{version}/namespaces/{namespace}/{plural}/{name}"
MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_LAB = f"{GROUP}/lab"
LABEL_EXPERIMENT = f"{GROUP}/experiment"
LABEL_RUN = f"{GROUP}/run"
LABEL_BASELINE = f"{GROUP}/baseline"
LABEL_CAMPAIGN = f"{GROUP}/campaign"
OURS = {MANAGED_BY: "autolab"}
MASTER_KEYS = ("hash", "semanticHash", "commit", "val_bpb", "experiment", "parent", "promotedAt",
               "places")
PROMOTIONS_KEPT = 20
CAS_ATTEMPTS = 20


class ClusterError(MachineError, RuntimeError):
    """Something in the cluster is not as the operator needs it; the message says what to do."""


T = TypeVar("T")
GONE = 404  # the API server's answer for an object that is not there (never made, or deleted)


def unless_gone(call: Callable[[], T], also: tuple[int, ...] = ()) -> T | None:
    """What `call` answers, or None when the object it reads or writes is not there (404, and
    the statuses in `also`). Every other error is the client's `ApiException`."""
    try:
        return call()
    except ApiException as e:
        if e.status == GONE or e.status in also:
            return None
        raise


def deleted(call: Callable[[], object]) -> bool:
    """Run a delete: True if it deleted something, False if it was gone already (404)."""
    def delete() -> bool:
        call()
        return True
    return unless_gone(delete) is True


def _load(resp: Any) -> dict:
    return json.loads(resp.data)


class Kube:
    """The operator's calls to the API server, answering dicts."""

    def __init__(self, api: k8s.ApiClient):
        self.api = api
        self.core = k8s.CoreV1Api(api)
        self.batch = k8s.BatchV1Api(api)
        self.custom = k8s.CustomObjectsApi(api)

    def request(self, method: str, path: str, body: Any = None,
                content_type: str = "application/json", **path_params: str) -> dict:
        """One call to the API server: `path` with `{name}` fields filled from `path_params`
        (quoted as the generated methods quote them); the answer as a dict; ApiException for
        an error answer, as the generated methods raise it."""
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        call = self.api.param_serialize(method=method, resource_path=path, path_params=path_params,
                                        header_params=headers, body=body,
                                        auth_settings=["BearerToken"])
        resp = self.api.call_api(*call)
        resp.read()
        if not 200 <= resp.status <= 299:
            raise ApiException.from_response(http_resp=resp, body=None, data=None)
        return json.loads(resp.data)

    # -- our resources ---------------------------------------------------------------------------
    def get_custom(self, namespace: str, plural: str, name: str) -> dict | None:
        return unless_gone(lambda: self.request("GET", CUSTOM_OBJECT, namespace=namespace,
                                                plural=plural, name=name, group=GROUP,
                                                version=VERSION))

    def list_custom(self, namespace: str, plural: str) -> list[dict]:
        return _load(self.custom.list_namespaced_custom_object(
            GROUP, VERSION, namespace, plural, _preload_content=False)).get("items") or []

    def patch_status(self, namespace: str, plural: str, name: str, status: dict) -> dict | None:
        """The object with its new status; None if it was deleted meanwhile (nothing left to
        describe)."""
        return unless_gone(lambda: self.request(
            "PATCH", CUSTOM_OBJECT + "/status", {"status": status}, MERGE_PATCH,
            namespace=namespace, plural=plural, name=name, group=GROUP, version=VERSION))

    # -- config maps -----------------------------------------------------------------------------
    def get_configmap(self, namespace: str, name: str) -> dict | None:
        return unless_gone(lambda: self.request(
            "GET", "/api/v1/namespaces/{namespace}/configmaps/{name}", namespace=namespace,
            name=name))

    def create_configmap(self, namespace: str, body: dict) -> dict:
        return self.request("POST", "/api/v1/namespaces/{namespace}/configmaps", body,
                            namespace=namespace)

    def patch_configmap(self, namespace: str, name: str, body: dict) -> dict:
        return _load(self.core.patch_namespaced_config_map(
            name, namespace, body, _content_type=MERGE_PATCH, _preload_content=False))

    def delete_configmap(self, namespace: str, name: str) -> bool:
        return deleted(lambda: self.core.delete_namespaced_config_map(
            name, namespace, _preload_content=False))

    # -- jobs and pods ---------------------------------------------------------------------------
    def get_job(self, namespace: str, name: str) -> dict | None:
        return unless_gone(lambda: _load(self.batch.read_namespaced_job(
            name, namespace, _preload_content=False)))

    def create_job(self, namespace: str, body: dict) -> dict:
        return self.request("POST", "/apis/batch/v1/namespaces/{namespace}/jobs", body,
                            namespace=namespace)

    def create_event(self, namespace: str, body: dict) -> dict:
        return self.request("POST", "/api/v1/namespaces/{namespace}/events", body,
                            namespace=namespace)

    def create_secret(self, namespace: str, body: dict) -> dict:
        return self.request("POST", "/api/v1/namespaces/{namespace}/secrets", body,
                            namespace=namespace)

    def delete_job(self, namespace: str, name: str) -> bool:
        return deleted(lambda: self.batch.delete_namespaced_job(
            name, namespace, propagation_policy="Background", _preload_content=False))

    def list_pods(self, namespace: str, labels: dict[str, str]) -> list[dict]:
        selector = ",".join(f"{k}={v}" for k, v in labels.items())
        items = _load(self.core.list_namespaced_pod(namespace, label_selector=selector,
                                                    _preload_content=False)).get("items") or []
        return [p for p in items  # the selector again, for API servers that ignore it
                if all(((p.get("metadata") or {}).get("labels") or {}).get(k) == v
                       for k, v in labels.items())]

    def pod_log_tail(self, namespace: str, name: str, container: str,
                     limit_bytes: int = 16384) -> str:
        resp = unless_gone(lambda: self.core.read_namespaced_pod_log(  # 400: never started
            name, namespace, container=container, limit_bytes=limit_bytes,
            _preload_content=False), also=(400,))
        return "" if resp is None else resp.data.decode("utf-8", errors="replace")


def owner_reference(obj: dict) -> dict:
    """An ownerReference to `obj`, so deleting it lets the cluster collect what it owns."""
    meta = obj["metadata"]
    return {"apiVersion": obj["apiVersion"], "kind": obj["kind"], "name": meta["name"],
            "uid": meta["uid"], "controller": True, "blockOwnerDeletion": True}


# --- the master of record -----------------------------------------------------------------------

@dataclass(frozen=True)
class MasterRecord:
    """The master ConfigMap as read: its master.json, the source, the promotions, the version."""

    doc: dict
    source: str
    promotions: list[dict]
    resource_version: str

    def master(self) -> Master:
        d = self.doc
        return Master(hash=d["hash"], semantic_hash=d["semanticHash"], commit=d.get("commit", ""),
                      val_bpb=d.get("val_bpb"), experiment=d.get("experiment"),
                      places=read_places(d.get("places")))


class MasterStore:
    """The ConfigMap `<lab>-master`: read it, create it, promote onto it with compare-and-swap."""

    def __init__(self, kube: Kube, namespace: str, lab: str, surface_name: str = "train.py"):
        self.kube = kube
        self.namespace = namespace
        self.lab = lab
        self.name = f"{lab}-master"
        self.surface_name = surface_name

    def read(self) -> MasterRecord | None:
        cm = self.kube.get_configmap(self.namespace, self.name)
        if cm is None:
            return None
        data = cm.get("data") or {}
        try:
            doc = json.loads(data["master.json"])
            source = data[self.surface_name]
        except (KeyError, ValueError) as e:
            raise ClusterError(f"ConfigMap {self.namespace}/{self.name} is not a master "
                               f"(data.master.json and data.{self.surface_name} are needed: {e}); "
                               "delete it and the operator writes it again from the lab "
                               "repo") from None
        return MasterRecord(doc=doc, source=source,
                            promotions=json.loads(data.get("promotions.json") or "[]"),
                            resource_version=cm["metadata"].get("resourceVersion", ""))

    def require(self) -> MasterRecord:
        rec = self.read()
        if rec is None:
            raise ClusterError(f"the master ConfigMap {self.namespace}/{self.name} is missing; "
                               "the operator creates it when it sees the Lab")
        return rec

    def ensure(self, repo: LabRepo) -> MasterRecord:
        """The ConfigMap, created from the lab repo's master when the cluster has none yet."""
        rec = self.read()
        if rec is not None:
            return rec
        local = repo.master_doc()
        doc = {k: local.get(k) for k in MASTER_KEYS}
        body = {"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": self.name, "namespace": self.namespace,
                             "labels": {**OURS, LABEL_LAB: self.lab}},
                "data": {self.surface_name: repo.master_source(),
                         "master.json": json.dumps(doc, indent=1),
                         "promotions.json": "[]"}}
        try:
            self.kube.create_configmap(self.namespace, body)
        except ApiException as e:
            if e.status != 409:  # 409: someone else wrote it first; theirs stands
                raise
        return self.require()

    def _cas(self, rec: MasterRecord, data: dict) -> bool:
        """Write `data` if the ConfigMap is still at `rec`'s version; False if it moved on."""
        try:
            self.kube.patch_configmap(self.namespace, self.name, {
                "metadata": {"resourceVersion": rec.resource_version}, "data": data})
            return True
        except ApiException as e:
            if e.status == 409:
                return False
            raise

    def promote(self, experiment: str, source: str, commit: str, val_bpb: float,
                parent: str, min_delta: float, now: str,
                against: float | None = None, places: dict | None = None) -> PromotionResult:
        """Make `source` the master if `val_bpb` still beats it; safe against concurrent winners."""
        for _ in range(CAS_ATTEMPTS):
            rec = self.require()
            d = rec.doc
            previous = next((p.get("previous", {}).get("val_bpb") for p in rec.promotions
                             if p.get("experiment") == experiment), None)
            settled = promotion_refused(d, experiment, val_bpb, min_delta, previous, parent,
                                        against)
            if settled is not None:
                return settled
            entry = {"hash": candidate_hash(source), "semanticHash": semantic_hash(source),
                     "commit": commit, "val_bpb": val_bpb, "experiment": experiment,
                     "parent": parent, "promotedAt": now,
                     "places": {str(k): v for k, v in (places or {}).items()}}
            promotion = {"experiment": experiment, "hash": entry["hash"], "val_bpb": val_bpb,
                         "promotedAt": now,
                         "previous": {"hash": d["hash"], "val_bpb": d.get("val_bpb"),
                                      "experiment": d.get("experiment")}}
            data = {self.surface_name: source, "master.json": json.dumps(entry, indent=1),
                    "promotions.json": json.dumps((rec.promotions + [promotion])[-PROMOTIONS_KEPT:],
                                                  indent=1)}
            if self._cas(rec, data):
                return PromotionResult(True, d.get("val_bpb"))
        raise ClusterError(f"could not promote {experiment}: the master ConfigMap "
                           f"{self.namespace}/{self.name} changed {CAS_ATTEMPTS} times while "
                           "promoting; the next pass tries again")

    def set_metric(self, master_hash: str, val_bpb: float, places: dict | None = None) -> bool:
        """Record the baseline of the master `master_hash` (its val_bpb, and its value at place
        1 where it ran there), if it is still the master."""
        for _ in range(CAS_ATTEMPTS):
            rec = self.require()
            d = rec.doc
            if d["hash"] != master_hash or (d.get("val_bpb") is not None
                                            and (places is None or d.get("places"))):
                return False
            doc = dict(d, val_bpb=d.get("val_bpb") if d.get("val_bpb") is not None else val_bpb)
            if places:
                doc["places"] = {**{str(k): v for k, v in places.items()}, **(d.get("places") or {})}
            if self._cas(rec, {"master.json": json.dumps(doc, indent=1)}):
                return True
        raise ClusterError(f"could not record the baseline of {master_hash[:12]}: the master "
                           "ConfigMap kept changing")

    def set_place(self, master_hash: str, place: int, val_bpb: float) -> bool:
        """Keep the master's value at `place`, if `master_hash` is still the master and the
        place has none (compare-and-swap on the ConfigMap's version, as a promotion)."""
        for _ in range(CAS_ATTEMPTS):
            rec = self.require()
            places = rec.doc.get("places") or {}
            if rec.doc["hash"] != master_hash or str(place) in places:
                return False
            doc = dict(rec.doc, places={**places, str(place): val_bpb})
            if self._cas(rec, {"master.json": json.dumps(doc, indent=1)}):
                return True
        raise ClusterError(f"could not keep the master's value at place {place}: the master "
                           "ConfigMap kept changing")


def sync_repo_master(repo: LabRepo, rec: MasterRecord) -> bool:
    """Bring the lab repo's master (branch and master.json) in step with the ConfigMap.

    The ConfigMap is the master of record. Its commit is normally one of this
    repo's (the operator materialised it); when it is not (a fresh volume), the
    ConfigMap's source is committed onto the repo's master so the checks of new
    experiments run against the right file. Returns True if anything changed.
    """
    d = rec.doc
    local = repo.master_doc()
    if local["hash"] == d["hash"]:
        changed = False
        if local.get("val_bpb") is None and d.get("val_bpb") is not None:
            repo.set_master_metric(d["val_bpb"])
            changed = True
        theirs, ours = read_places(d.get("places")), read_places(local.get("places"))
        for place, val in sorted(theirs.items()):
            if place not in ours:
                changed = repo.set_place(d["hash"], place, val) or changed
        return changed
    commit = d.get("commit") or ""
    if not commit or not _has_surface(repo, commit, d["hash"]):
        commit = _commit_source(repo, local["commit"], rec.source,
                                f"Adopt master {d['hash'][:12]} from the master ConfigMap")
    entry = {k: d.get(k) for k in MASTER_KEYS}
    entry["commit"] = commit
    with repo._master_lock:  # the repo's own lock, shared with its promote()
        current = repo.master_doc()
        history = [h for h in current.get("history", []) if h["hash"] != d["hash"]]
        repo.git("update-ref", f"refs/heads/{MASTER_BRANCH}", commit)
        atomic_write(repo.master_file, json.dumps({**entry, "history": history + [dict(entry)]},
                                                  indent=2) + "\n")
    return True


def _has_surface(repo: LabRepo, commit: str, want_hash: str) -> bool:
    shown = repo.git("show", f"{commit}:{repo.lab.surface}", check=False)
    return shown.returncode == 0 and candidate_hash(shown.stdout) == want_hash


def _commit_source(repo: LabRepo, base: str, source: str, message: str) -> str:
    wt = repo.state / "worktrees" / ".adopt-master"
    repo.git("worktree", "remove", "--force", str(wt), check=False)
    wt.parent.mkdir(parents=True, exist_ok=True)
    repo.git("worktree", "add", "--quiet", "--detach", str(wt), base)
    try:
        (wt / repo.lab.surface).write_text(source, encoding="utf-8")
        repo.git("commit", "--quiet", "--allow-empty", "-a", "-m", message, cwd=wt)
        return repo.git("rev-parse", "HEAD", cwd=wt).stdout.strip()
    finally:
        repo.git("worktree", "remove", "--force", str(wt), check=False)
