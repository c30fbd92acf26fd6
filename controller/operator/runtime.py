"""One Lab as the cluster sees it: the engine's seams, and the LabRuntime that holds them.

Statuses live in the custom resources (`ClusterStatuses`), the master in the ConfigMap
`<lab>-master` with the lab repo kept in step (`ClusterMaster`), events are Kubernetes Events
named once per fact, and the Lab's status mirrors the master (`ClusterEvents`). A
`LabRuntime` is a Lab's directory on the operator's volume, its master ConfigMap and its
engine.
"""


from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from controller.core.errors import InputError
from controller.core.intents import Event, Promotion
from controller.core.patch import merge_patch
from controller.core.reconcile import Master, PromotionResult
from controller.core.spec import API_VERSION, GROUP, VERSION, LabSpec, SpecError, validate_document
from controller.engine import Engine, Observed

if TYPE_CHECKING:
    from controller.kube.cluster import MasterRecord, MasterStore
    from controller.operator.handlers import Operator

log = logging.getLogger("autolab.operator")

EXPERIMENTS = (GROUP, VERSION, "experiments")
LABS = (GROUP, VERSION, "labs")
FINALIZER = f"{GROUP}/finalizer"
MASTER_MAX_AGE = 1.0  # seconds a pass may use a copy of the master ConfigMap
QUEUE_SHOWN = 50  # the Lab's status.queue: its first names (the object stays small)
EVENT_MESSAGE_MAX = 1000
EVENT_NAME_MAX = 253  # a DNS subdomain
COMPONENT = "autolab-operator"  # who tells the Events (`kubectl describe`'s From)
USER_AGENT = "autolab-operator/0.1"
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
HANDLER_WORKERS = 32  # threads running handlers at once (each mostly waits on I/O)
# The Lab's status follows its Experiments' phases this long after a change at most (plus one
# write): the changes told meanwhile are one write. A batch of 50 specs told it ~100 times,
# each write a request and a watch event the operator's one process paid for while the
# batch's Jobs waited; and the write was made on a pass's thread, before that pass's Job.
MIRROR_DELAY = 0.25
CHECK_POOL_START_SECONDS = 60.0  # start-up waits at most this long for the check pool


def configure_logging(verbose: bool = False) -> None:
    """The operator's log on stderr, per-object lines prefixed `[namespace/name]` as in `kopf
    run` (kopf's prefixing formatter reads the `k8s_ref` of kopf's lines and of ours)."""
    import kopf

    kopf.configure(verbose=verbose, log_format=LOG_FORMAT, log_prefix=True)


def object_log(namespace: str | None, name: str, kind: str = "Experiment") -> logging.LoggerAdapter:
    """The operator's log for lines about one object: they carry its `k8s_ref`, as kopf's do."""
    return logging.LoggerAdapter(log, {"k8s_ref": {"kind": kind, "namespace": namespace,
                                                   "name": name}})


@dataclass
class OperatorConfig:
    """How this operator runs (`autolab operator`'s flags; see controller/cli/operator.py)."""

    lab_root: Path = Path("/var/lib/autolab")
    resync_seconds: float = 30.0   # timer of runs in flight and of Labs
    retry_seconds: float = 10.0    # back-off of a handler that failed
    server: str | None = None      # plain-HTTP API server (an emulator); None: in-cluster/kubeconfig
    run_image: str | None = None   # for Labs without spec.kubernetes.image
    scanning: bool = True          # kopf's namespace/CRD scanning (needs the ClusterRole)
    watch_timeout: float | None = 300.0
    workers: int | None = None     # threads for the (blocking) handlers; None: HANDLER_WORKERS


class LabMissing(InputError, LookupError):
    """An Experiment names a Lab that does not exist in its namespace."""


class LabUnusable(LabMissing):
    """An Experiment names a Lab whose spec is invalid: it waits until the Lab is fixed."""


def _plain(body: Any) -> dict:
    """A kopf body (or any mapping) as an independent plain dict."""
    return json.loads(json.dumps(body, default=dict))


def _ref(obj: dict) -> dict:
    """What kopf needs to post an Event about `obj`."""
    meta = obj.get("metadata") or {}
    return {"apiVersion": obj.get("apiVersion", API_VERSION), "kind": obj.get("kind"),
            "metadata": {"name": meta.get("name"), "namespace": meta.get("namespace"),
                         "uid": meta.get("uid")}}


def _stored_form(value: Any) -> Any:
    """`value` as an API server gives it back after a merge patch: no null members (a merge
    patch removes them), whole floats as integers (a Go server may write 1.0 as 1)."""
    if isinstance(value, dict):
        return {k: _stored_form(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_stored_form(v) for v in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def transition_key(status: dict | None) -> str:
    """Names the transition that leaves `status`: the same status read back names the same one."""
    text = json.dumps(_stored_form(status or {}), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def event_name(object_name: str, *fact: str) -> str:
    """The Event that tells `fact` about an object: `<object>.<16 hex>`, the same every time."""
    digest = hashlib.sha256("\n".join(fact).encode()).hexdigest()[:16]
    return f"{object_name[:EVENT_NAME_MAX - len(digest) - 1]}.{digest}"


# --- one lab, as the cluster sees it: the engine's seams -------------------------------------------

class ClusterStatuses:
    """StatusStore: Experiment objects, their status in the custom resource's status."""

    def __init__(self, rt: "LabRuntime"):
        self.rt = rt
        self.refs: dict[str, dict] = {}   # name -> what kopf needs to post Events about it
        self.known: dict[str, dict] = {}  # name -> its status as last read or written

    def read(self, name: str) -> Observed | None:
        obj = self.rt.op.connect().get_custom(self.rt.namespace, "experiments", name)
        return None if obj is None else self.observed(obj)

    def observed(self, obj: dict) -> Observed:
        """An Experiment object as the engine takes it (what a handler just read)."""
        from controller.kube.cluster import owner_reference

        meta = obj["metadata"]
        name = meta["name"]
        self.refs[name] = _ref(obj)
        status = {k: v for k, v in (obj.get("status") or {}).items() if k != "kopf"}
        self.known[name] = status
        live = obj.get("spec") or {}
        error = None
        try:
            validate_document({"apiVersion": API_VERSION, "kind": "Experiment",
                               "metadata": {"name": name}, "spec": live},
                              source=f"Experiment {self.rt.namespace}/{name}", kind="Experiment")
        except SpecError as e:
            error = str(e)
        return Observed(name=name, key=meta.get("uid") or name, spec=live, status=status,
                        generation=int(meta.get("generation", 1)),
                        deleting=bool(meta.get("deletionTimestamp")), spec_error=error,
                        owner=owner_reference(obj) if meta.get("uid") else None,
                        created=str(meta.get("creationTimestamp") or ""))

    def write_status(self, name: str, status: dict, previous: dict | None = None) -> None:
        # A merge patch keeps what it does not mention: a key the new status dropped is sent
        # as null, which removes it (RFC 7386).
        patch = merge_patch(previous, status) if previous is not None else status
        self.rt.op.connect().patch_status(self.rt.namespace, "experiments", name, patch)
        self.known[name] = status
        self.rt.op.phases[(self.rt.namespace, name)] = status.get("phase")

    def finalized(self, name: str) -> None:
        pass  # kopf removes the finalizer when the delete handler returns


class ClusterMaster:
    """MasterOfRecord: the ConfigMap `<lab>-master`, the lab repo kept in step with it."""

    def __init__(self, rt: "LabRuntime"):
        self.rt = rt

    def master(self) -> Master:
        return self.rt.master_record().master()

    def master_source(self) -> str:
        return self.rt.master_record().source

    def before_checks(self, asked_at: float | None = None) -> None:
        # Many handler threads ask at once: one read of the ConfigMap begun after a thread
        # asked serves it as well as its own would (each read and sync is under the lock).
        if asked_at is not None and self.rt.synced_from >= asked_at:
            return
        self.rt.sync()

    def promote_candidate(self, promotion: Promotion) -> PromotionResult:
        p = promotion
        result = self.rt.store.promote(p.name, p.source, p.commit, p.val_bpb, p.parent, p.margin,
                                       p.now, p.against, p.places)
        self.rt.sync()
        return result

    def set_master_metric(self, val_bpb: float, places: dict | None = None,
                          master_hash: str | None = None) -> None:
        self.rt.store.set_metric(master_hash or self.master().hash, val_bpb, places)
        self.rt.sync()

    def set_place(self, master_hash: str, place: int, val_bpb: float) -> bool:
        kept = self.rt.store.set_place(master_hash, place, val_bpb)
        if kept:
            self.rt.sync()
        return bool(kept)


class ClusterEvents:
    """EventSink: Kubernetes Events on the Experiment and the Lab; the Lab's status mirrored.

    An Experiment's Event is named after the transition it tells (the status it leaves,
    which the engine has not written over yet) and its reason; a Lab's after its reason and
    message. Telling one twice is one Event.
    """

    def __init__(self, rt: "LabRuntime"):
        self.rt = rt

    def experiment(self, name: str, event: Event) -> None:
        ref = self.rt.statuses.refs.get(name) or {
            "apiVersion": API_VERSION, "kind": "Experiment",
            "metadata": {"name": name, "namespace": self.rt.namespace}}
        uid = ref["metadata"].get("uid") or ""
        self.rt.op._event(ref, event, fact=(
            uid, "transition", transition_key(self.rt.statuses.known.get(name)), event.type,
            event.reason))

    def lab(self, event: Event) -> None:
        self.rt.op._event(self.rt.lab_obj, event)

    def lab_changed(self) -> None:
        """Mirror the Lab's status soon, off the caller's thread, one writer at a time.

        The first change of a burst starts the writer; the changes told while it waits
        (MIRROR_DELAY) or writes are left to it, and it reads the lab again and writes once
        more: the last write holds the latest state, and a burst of changes is a few writes.
        A write that fails is logged; the Lab's timer mirrors its status again.
        """
        rt = self.rt
        with rt.mirror_lock:
            rt.mirror_wanted = True
            if rt.mirroring:
                return
            rt.mirroring = True
        threading.Thread(target=self._mirror, name=f"mirror {rt.namespace}/{rt.name}",
                         daemon=True).start()

    def _mirror(self) -> None:
        rt = self.rt
        try:
            while True:
                time.sleep(MIRROR_DELAY)
                with rt.mirror_lock:
                    if not rt.mirror_wanted or rt.op.closed:
                        rt.mirroring = False
                        return
                    rt.mirror_wanted = False
                rt.op._mirror_lab(rt)
        except Exception as e:  # noqa: BLE001 - a thread of its own: nobody else would see it
            object_log(rt.namespace, rt.name, "Lab").warning(
                "the Lab's status was not mirrored (%s); its timer tries again", e)
            with rt.mirror_lock:
                rt.mirroring = False


def _noise_status(doc: dict | None) -> dict | None:
    """The Lab status's `noise`: what `autolab noise` measured on the current master."""
    if doc is None:
        return None
    return {k: doc.get(k) for k in ("master", "acrossSeeds", "paired", "detectable", "cap",
                                    "budgetSeconds", "measuredAt")}


class LabRuntime:
    """A Lab in the cluster: its directory, its master ConfigMap, and its engine."""

    def __init__(self, op: "Operator", namespace: str, lab_obj: dict):
        from controller.kube.cluster import MasterStore as ConfigMapMaster, owner_reference
        from controller.lab.init import make_lab
        from controller.lab.paths import LabPaths

        self.op = op
        self.namespace = namespace
        self.name = lab_obj["metadata"]["name"]
        self.root = op.config.lab_root / self.name
        self.lab_obj = lab_obj
        self.spec = LabSpec.from_dict(lab_obj.get("spec") or {})
        self.mirrored: dict | None = None
        self.mirror_lock = threading.Lock()  # ClusterEvents.lab_changed: one writer at a time,
        self.mirroring = False               # this one writing,
        self.mirror_wanted = False           # and a change told since it read the lab
        self._master: tuple[float, MasterRecord | None] = (0.0, None)
        self.synced_from = float("-inf")  # when the read of the last sync() began (monotonic)
        paths = LabPaths.of(self.root)
        if not paths.lab_file.exists():
            object_log(namespace, self.name, "Lab").info("creating the lab repo in %s", self.root)
            make_lab(self.root, profile=self.spec.profile, data=self.spec.data, name=self.name,
                     budget=self.spec.budget_seconds)
        self.store: MasterStore = ConfigMapMaster(op.kube, namespace, self.name,
                                              self.spec.surface.rsplit("/", 1)[-1])
        self.statuses = ClusterStatuses(self)
        self.engine = Engine(paths=paths, lab_name=self.name, lab=self.spec,
                             statuses=self.statuses, master=ClusterMaster(self),
                             events=ClusterEvents(self), backends={},
                             make_backend=self._make_backend, visible_slots=_no_local_gpus,
                             local_means="kubernetes", checks_on_pool=True,
                             lab_owner=owner_reference(lab_obj)
                             if (lab_obj.get("metadata") or {}).get("uid") else None)
        self.repo = self.engine.repo
        self.ledger = self.engine.ledger
        if self.spec.backend in ("local", "kubernetes"):
            # Read once here (one thread), not by the first batch of Jobs at once: every
            # handler thread missed the cache together and parsed prepare.py in turn. The
            # backend's module too: imported by the first pass to submit, it held the GIL.
            import controller.backends.kubernetes  # noqa: F401
            from controller.lab.profiles import profiles

            with contextlib.suppress(Exception):
                profiles()

    def _make_backend(self, name: str) -> Any:
        if name == "kubernetes":
            from controller.backends.kubernetes import KubernetesBackend

            return KubernetesBackend(self.op.kube, self.namespace, self.name, self.spec,
                                     self.op.config.run_image)
        if name == "hf":
            from controller.backends.hf import HfBackend, token_from_secret

            from controller.backends.hf import HfBackendError

            secret = (self.spec.hf or {}).get("tokenSecret")
            token = None
            if secret:
                try:
                    token = token_from_secret(secret, self.namespace, self.op.connect().core)
                except HfBackendError:
                    raise
                except Exception as e:  # not found, forbidden: say which Secret and what to do
                    raise HfBackendError(
                        f"cannot read the Secret {self.namespace}/{secret} named by the Lab's "
                        f"spec.hf.tokenSecret ({getattr(e, 'reason', None) or e}); create it "
                        f"with `kubectl -n {self.namespace} create secret generic {secret} "
                        "--from-literal=HF_TOKEN=hf_...`") from None
            return HfBackend.from_lab(self.spec, self.root, token=token, lab_name=self.name)
        raise SpecError(f"backend {name!r} is not available in the operator; use kubernetes "
                        "(or hf)")

    @property
    def book(self) -> Any:
        return self.engine.book

    def update(self, lab_obj: dict) -> None:
        self.lab_obj = lab_obj
        spec = LabSpec.from_dict(lab_obj.get("spec") or {})
        if spec != self.spec:
            self.spec = spec
            self.engine.set_lab(spec)

    def sync(self) -> "MasterRecord":
        """The master ConfigMap (created if missing), with the lab repo brought in step."""
        from controller.kube.cluster import sync_repo_master

        with self.engine.lock:
            started = time.monotonic()
            rec = self.store.ensure(self.repo)
            sync_repo_master(self.repo, rec)
            self._master = (time.monotonic(), rec)
            self.synced_from = started
            return rec

    def master_record(self, max_age: float = MASTER_MAX_AGE) -> "MasterRecord":
        """The master ConfigMap as read at most `max_age` seconds ago.

        Many passes a second need the master only to compare against it; a promotion
        compares again under compare-and-swap, so a second-old copy decides nothing wrong.
        """
        read_at, rec = self._master
        if rec is None or time.monotonic() - read_at > max_age:
            rec = self.store.read() or self.sync()
            self._master = (time.monotonic(), rec)
        return rec


def _no_local_gpus(_configured: int) -> list[str]:
    return ["cpu"]  # the operator's own machine runs nothing


