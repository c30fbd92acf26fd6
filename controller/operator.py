"""The Kubernetes operator: kopf handlers that observe, call `reconcile()` and apply the decision.

It is the cluster's front end to the same functional core as the local loop
(`controller.local`): for an Experiment it observes the world (the object,
its run's Job and Pods, the master ConfigMap, the ledger, the lab repo), asks
the pure `reconcile()` what the status should be and what to do next, writes
the status, posts the decision's Events and carries out its intents, until
nothing is left to do. No handler decides anything about an experiment's
lifecycle itself: create, update, resume, the timer for runs in flight, the
Job and Pod watches and the finalizer all call that one pass.

    kopf event (create | update | resume | timer | Job/Pod change | delete)
        -> GET the Experiment (the handler's copy may lag our own writes)
        -> observe: run (Job + Pods), master ConfigMap, ledger, worktree, slot
        -> reconcile(World) -> Decision(status, intents, events, finalized)
        -> patch status, post Events, apply intents; again until no intents

A Lab's handlers keep what the cluster side of a lab needs: its directory on
the operator's volume (`$AUTOLAB_LAB_DIR/<lab>`: the lab repo with worktrees and
branches, the ledger; created with `autolab init`'s code when missing), the
master ConfigMap `<lab>-master` (the master of record, created from the lab
repo the first time), the master's baseline run (a Job too) and the Lab's
status, which mirrors the master and counts the runs in flight.

Deleting an Experiment runs the finalizer: a run in flight is cancelled (its
Job deleted), the cancellation is recorded in the ledger, and the finalizer
goes when `reconcile` says `finalized`. Jobs and Pods the operator creates
carry ownerReferences and the `app.kubernetes.io/managed-by=autolab` label,
and the operator watches only those.

Run it with `autolab operator` (see `--help`), or `python -m
controller.cli.operator` (what the Deployment does: the same flags, and the
image needs neither torch nor the other commands' extras). Importing this
module registers nothing and is cheap: kopf and the Kubernetes client load
only when an operator starts, and `register()` puts the handlers into the
registry it is given.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import datetime as _dt
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from controller.core.failures import (RECONCILE_ERROR, failing, failure_message, with_failure,
                                      with_recovery)
from controller.core.reconcile import (ACTIVE, TERMINAL, Candidate, Decision, Event,
                                       RunObservation, World, baseline_run_name, reconcile,
                                       reconcile_baseline, run_name)
from controller.core.spec import (API_VERSION, GROUP, VERSION, ExperimentSpec, LabSpec, SpecError,
                                  validate_document)

if TYPE_CHECKING:
    from controller.backends.kubernetes import KubernetesBackend
    from controller.kube.cluster import Kube, MasterRecord, MasterStore, SlotBook
    from controller.lab.repo import LabRepo
    from controller.lab.ledger import Ledger

log = logging.getLogger("autolab.operator")

EXPERIMENTS = (GROUP, VERSION, "experiments")
LABS = (GROUP, VERSION, "labs")
FINALIZER = f"{GROUP}/finalizer"
BASELINE_ATTEMPTS = 3
MAX_STEPS = 10  # reconcile rounds in one pass; a pass normally settles in two or three
MASTER_MAX_AGE = 1.0  # seconds a pass may use a copy of the master ConfigMap
EVENT_MESSAGE_MAX = 1000
USER_AGENT = "autolab-operator/0.1"


def utcnow() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class OperatorConfig:
    """How this operator runs (`from_env`: from AUTOLAB_* variables)."""

    lab_root: Path = Path("/var/lib/autolab")
    resync_seconds: float = 30.0   # timer of runs in flight and of Labs
    retry_seconds: float = 10.0    # back-off of a handler that failed
    server: str | None = None      # plain-HTTP API server (an emulator); None: in-cluster/kubeconfig
    run_image: str | None = None   # for Labs without spec.kubernetes.image
    scanning: bool = True          # kopf's namespace/CRD scanning (needs the ClusterRole)
    watch_timeout: float | None = 300.0
    workers: int | None = None     # threads for the (blocking) handlers; None: kopf's default

    @classmethod
    def from_env(cls) -> "OperatorConfig":
        env = os.environ
        return cls(lab_root=Path(env.get("AUTOLAB_LAB_DIR", "/var/lib/autolab")),
                   resync_seconds=float(env.get("AUTOLAB_RESYNC_SECONDS", "30")),
                   server=env.get("AUTOLAB_KUBE_SERVER") or None,
                   run_image=env.get("AUTOLAB_RUN_IMAGE") or None,
                   scanning=env.get("AUTOLAB_KOPF_SCANNING", "1") != "0")


class LabMissing(LookupError):
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


# --- one lab, as the cluster sees it -------------------------------------------------------------

class LabRuntime:
    """A Lab's cluster state: directory, lab repo, ledger, master ConfigMap, backend, slots."""

    def __init__(self, op: "Operator", namespace: str, lab_obj: dict):
        from controller.backends.kubernetes import KubernetesBackend
        from controller.kube.cluster import MasterStore, SlotBook

        self.op = op
        self.namespace = namespace
        self.name = lab_obj["metadata"]["name"]
        self.root = op.config.lab_root / self.name
        self.lock = threading.RLock()  # the lab repo and the master; materialise is serial
        self.lab_obj = lab_obj
        self.spec = LabSpec.from_dict(lab_obj.get("spec") or {})
        self.book: SlotBook = SlotBook(self.spec.gpu_slots)
        self.store: MasterStore = MasterStore(op.kube, namespace, self.name,
                                              self.spec.surface.rsplit("/", 1)[-1])
        self.backend: KubernetesBackend = KubernetesBackend(op.kube, namespace, self.name,
                                                            self.spec, op.config.run_image)
        self.extra_backends: dict[str, Any] = {}
        self.baseline_failures: dict[str, int] = collections.Counter()
        self.mirrored: dict | None = None
        self._master: tuple[float, MasterRecord | None] = (0.0, None)
        self.repo, self.ledger = self._open()

    @property
    def world_spec(self) -> LabSpec:
        # In a cluster "local" (the schema's default) means this cluster: Jobs.
        if self.spec.backend == "local":
            return dataclasses.replace(self.spec, backend="kubernetes")
        return self.spec

    def _open(self) -> tuple["LabRepo", "Ledger"]:
        from controller.lab.init import make_lab
        from controller.lab.ledger import Ledger
        from controller.lab.paths import LAB_FILE
        from controller.lab.repo import LabRepo

        if not (self.root / LAB_FILE).exists():
            log.info("creating the lab repo of %s in %s", self.name, self.root)
            make_lab(self.root, profile=self.spec.profile, data=self.spec.data, name=self.name,
                     budget=self.spec.budget_seconds)
        repo = LabRepo(self.root, self.spec)
        return repo, Ledger(self.root / "research" / "results.tsv")

    def update(self, lab_obj: dict) -> None:
        self.lab_obj = lab_obj
        spec = LabSpec.from_dict(lab_obj.get("spec") or {})
        if spec != self.spec:
            self.spec = spec
            self.repo.lab = spec
            self.backend.lab = spec
            self.book.resize(spec.gpu_slots)

    def sync(self) -> "MasterRecord":
        """The master ConfigMap (created if missing), with the lab repo brought in step."""
        from controller.kube.cluster import sync_repo_master

        with self.lock:
            rec = self.store.ensure(self.repo)
            sync_repo_master(self.repo, rec)
            self._master = (time.monotonic(), rec)
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

    # -- the checked spec of each experiment, kept beside the lab repo -----------------------------
    def _spec_path(self, uid: str) -> Path:
        return self.root / ".autolab" / "specs" / f"{uid}.json"

    def checked_spec(self, uid: str) -> dict | None:
        p = self._spec_path(uid)
        return json.loads(p.read_text()) if p.exists() else None

    def keep_checked_spec(self, uid: str, spec: dict) -> None:
        from controller.lab.repo import atomic_write

        atomic_write(self._spec_path(uid), json.dumps(spec, sort_keys=True) + "\n")

    def forget_checked_spec(self, uid: str) -> None:
        self._spec_path(uid).unlink(missing_ok=True)

    def backend_for(self, name: str) -> Any:
        if name in ("kubernetes", "local"):
            return self.backend
        if name == "hf":
            if "hf" not in self.extra_backends:
                from controller.backends.hf import HfBackend  # only labs that use it import it
                self.extra_backends["hf"] = HfBackend.from_lab(self.spec, self.root)
            return self.extra_backends["hf"]
        raise SpecError(f"backend {name!r} is not available in the operator; use kubernetes "
                        "(or hf)")

    def duplicate_of(self, name: str, c: Candidate) -> str | None:
        from controller.lab.repo import recorded_duplicate
        hit = recorded_duplicate(self.repo, self.ledger, name, c)
        if hit or c.refusal:
            return hit
        return self.book.claim(name, (c.candidate_hash, c.semantic_hash))


# --- the operator ---------------------------------------------------------------------------------

@dataclass
class Timing:
    handler: str
    seconds: float


class Operator:
    """The state of one running operator and its kopf handlers (bound methods)."""

    def __init__(self, config: OperatorConfig | None = None, kube: "Kube | None" = None):
        self.config = config or OperatorConfig()
        self.kube: Kube | None = kube
        self.labs: dict[tuple[str, str], LabRuntime] = {}
        self._labs_lock = threading.RLock()
        self._locks: dict[tuple[str, str], threading.Lock] = collections.defaultdict(
            threading.Lock)
        self._locks_lock = threading.Lock()
        self.unsettled: set[tuple[str, str]] = set()
        self.phases: dict[tuple[str, str], str | None] = {}  # as this operator last wrote them
        self.timings: collections.deque[Timing] = collections.deque(maxlen=100_000)
        self.hooks: list[Callable[[LabRuntime, str, dict, dict], None]] = []
        self.settings: Any = None  # kopf's, from the startup handler
        self._queued: set[str] = set()  # objects with a resync pass waiting for a thread
        # Experiments whose last pass failed for good, with the generation it failed at: the
        # timer leaves them alone until the object changes (or the operator restarts).
        self.failed: dict[tuple[str, str], int] = {}

    # -- plumbing --------------------------------------------------------------------------------
    def connect(self) -> "Kube":
        """The API client: the configured server, else in-cluster, else the kubeconfig."""
        if self.kube is None:
            from kubernetes import client, config as kconfig

            from controller.kube.cluster import Kube

            cfg = client.Configuration()
            if self.config.server:
                cfg.host = self.config.server.rstrip("/")
            else:
                try:
                    kconfig.load_incluster_config(client_configuration=cfg)
                except kconfig.ConfigException:
                    kconfig.load_kube_config(client_configuration=cfg)
            api = client.ApiClient(cfg)
            api.user_agent = USER_AGENT  # tells our calls apart in the API server's audit log
            self.kube = Kube(api)
        return self.kube

    def lock(self, namespace: str, name: str) -> threading.Lock:
        with self._locks_lock:
            return self._locks[(namespace, name)]

    def runtime(self, namespace: str, lab: str, lab_obj: dict | None = None) -> LabRuntime:
        key = (namespace, lab)
        with self._labs_lock:
            rt = self.labs.get(key)
            if rt is not None:
                if lab_obj is not None:
                    rt.update(lab_obj)
                return rt
            if lab_obj is None:
                lab_obj = self.connect().get_custom(namespace, "labs", lab)
            if lab_obj is None:
                raise LabMissing(f"Lab {lab!r} does not exist in namespace {namespace}; create it "
                                 "(see manifests/lab.yaml) or set spec.lab to an existing one")
            self._validate_lab(lab_obj)
            rt = LabRuntime(self, namespace, lab_obj)
            rt.sync()
            for exp in self.connect().list_custom(namespace, "experiments"):
                try:
                    spec = exp.get("spec") or {}
                    if spec.get("lab", "default") == lab:
                        rt.book.observe(exp["metadata"]["name"], exp.get("status") or {},
                                        _priority(spec))
                except Exception as e:  # one malformed object must not keep the lab down
                    log.warning("Lab %s/%s: skipping Experiment %s while counting slots: %s",
                                namespace, lab, (exp.get("metadata") or {}).get("name"), e)
            self.labs[key] = rt
            return rt

    @staticmethod
    def _validate_lab(lab_obj: dict) -> None:
        meta = lab_obj.get("metadata") or {}
        validate_document({"apiVersion": lab_obj.get("apiVersion", API_VERSION), "kind": "Lab",
                           "metadata": {"name": meta.get("name")},
                           "spec": lab_obj.get("spec") or {}},
                          source=f"Lab {meta.get('namespace')}/{meta.get('name')}", kind="Lab")

    def _event(self, obj: dict, event: Event) -> None:
        import kopf

        kopf.event(_ref(obj), type=event.type, reason=event.reason,
                   message=event.message[:EVENT_MESSAGE_MAX])

    # -- one pass over an Experiment -------------------------------------------------------------
    def reconcile_experiment(self, namespace: str, name: str,
                             deleting: bool = False) -> Decision | None:
        """Observe, reconcile and act until nothing is left to do. None if the object is gone."""
        kube = self.connect()
        obj = kube.get_custom(namespace, "experiments", name)
        if obj is None:
            return None
        lab = (obj.get("spec") or {}).get("lab", "default")
        try:
            rt = self.runtime(namespace, lab if isinstance(lab, str) else "default")
        except SpecError as e:
            raise LabUnusable(str(e)) from None
        try:
            return self._pass(rt, obj, deleting or bool(obj["metadata"].get("deletionTimestamp")))
        except Exception:
            # The slot book is the lab's, shared by all its experiments: a slot granted or a
            # candidate claimed by a pass that failed goes back to what the status says.
            self._restore_book(rt, namespace, name)
            raise

    def _restore_book(self, rt: LabRuntime, namespace: str, name: str) -> None:
        """Put an experiment back into the lab's slot book as the API server has it."""
        try:
            obj = self.connect().get_custom(namespace, "experiments", name)
        except Exception:  # the API is away: the next pass observes it again
            return
        if obj is None:
            rt.book.forget(name)
            return
        st = {k: v for k, v in (obj.get("status") or {}).items() if k != "kopf"}
        _observe_or_forget(rt.book, name, st, _priority(obj.get("spec") or {}))

    def _pass(self, rt: LabRuntime, obj: dict, deleting: bool) -> Decision:
        meta = obj["metadata"]
        name, uid = meta["name"], meta.get("uid", "")
        live = obj.get("spec") or {}
        st = {k: v for k, v in (obj.get("status") or {}).items() if k != "kopf"}
        spec_error = spec = None
        try:
            validate_document({"apiVersion": API_VERSION, "kind": "Experiment",
                               "metadata": {"name": name}, "spec": live},
                              source=f"Experiment {rt.namespace}/{name}", kind="Experiment")
        except SpecError as e:
            spec_error = str(e)
        if spec_error is None:
            spec = ExperimentSpec.from_dict(rt.checked_spec(uid) or live)
        priority = spec.priority if spec else 0
        run: RunObservation | None = None
        job = st.get("job")
        if job and (st.get("phase") in ACTIVE or (deleting and st.get("phase") not in TERMINAL)):
            run = rt.backend_for(job["backend"]).observe(job["name"])
        candidate: Candidate | None = None
        duplicate = None
        promotion = None
        # The master of record; the lab repo is brought in step where it is used (materialise).
        rec = rt.master_record()
        decision: Decision | None = None
        for _ in range(MAX_STEPS):
            slot = None
            if not deleting and self._wants_slot(st, candidate, duplicate) \
                    and rec.doc.get("val_bpb") is not None:
                slot = rt.book.grant(name, priority, st.get("queuedAt") or utcnow())
            job = st.get("job") or {}
            w = World(name=name, spec=spec, lab=rt.world_spec, master=rec.master(), now=utcnow(),
                      status=st, spec_error=spec_error, generation=int(meta.get("generation", 1)),
                      deleting=deleting, candidate=candidate, duplicate_of=duplicate, slot=slot,
                      run=run, promotion=promotion,
                      recorded=rt.ledger.has_run(job.get("name") or run_name(name)),
                      worktree=self._leftovers(rt, name, st))
            decision = reconcile(w)
            if slot is not None and "submit" not in decision.kinds():
                rt.book.release(name)
            if decision.status != st:
                self.connect().patch_status(rt.namespace, "experiments", name, decision.status)
                phase_changed = decision.status.get("phase") != st.get("phase")
                st = decision.status
                rt.book.observe(name, st, priority)
                if phase_changed:
                    self._mirror_lab(rt)
            for event in decision.events:
                self._event(obj, event)
            if not decision.intents:
                break
            for intent in decision.intents:
                a = intent.args
                if intent.kind == "materialise":
                    with rt.lock:
                        rec = rt.sync()
                        candidate = rt.repo.materialise(name, spec)
                        duplicate = rt.duplicate_of(name, candidate)
                    if uid:
                        rt.keep_checked_spec(uid, live)
                elif intent.kind == "submit":
                    run = self._submit(rt, obj, spec, a)
                elif intent.kind == "cancel":
                    run = rt.backend_for(a["backend"]).cancel(a["run"])
                elif intent.kind == "promote":
                    with rt.lock:
                        promotion = rt.store.promote(
                            name, rt.repo.candidate_source(name), st["commit"], a["val_bpb"],
                            st.get("parentHash", ""), rt.spec.min_delta, utcnow())
                        rec = rt.sync()
                    if promotion.promoted:
                        self._event(rt.lab_obj, Event(
                            "Normal", "Promoted", f"{name} is the new master: val_bpb "
                                                  f"{a['val_bpb']:.6f} (was "
                                                  f"{promotion.master_val_bpb})."))
                        self._mirror_lab(rt)
                elif intent.kind == "record":
                    row = dict(a["row"], created_at=utcnow())
                    if rt.ledger.append(row):
                        for hook in self.hooks:
                            hook(rt, name, obj, row)
                elif intent.kind == "cleanup":
                    with rt.lock:
                        rt.repo.cleanup(name, keep_branch=bool(st.get("job")))
                    if st.get("job"):
                        backend = rt.backend_for(st["job"]["backend"])
                        if hasattr(backend, "cleanup"):
                            backend.cleanup(st["job"]["name"])
        assert decision is not None
        key = (rt.namespace, name)
        self.phases[key] = st.get("phase")
        if decision.finalized:
            rt.forget_checked_spec(uid)
            rt.book.forget(name)
            self.unsettled.discard(key)
            self.phases.pop(key, None)
            self.failed.pop(key, None)
        elif st.get("phase") in TERMINAL and decision.intents:
            self.unsettled.add(key)  # the timer comes back for what is left
        else:
            self.unsettled.discard(key)
        return decision

    @staticmethod
    def _wants_slot(st: dict, candidate: Candidate | None, duplicate: str | None) -> bool:
        if st.get("job"):
            return False
        if st.get("phase") == "Queued":
            return True
        return (st.get("phase") == "Pending" and candidate is not None
                and not candidate.refusal and duplicate is None)

    @staticmethod
    def _leftovers(rt: LabRuntime, name: str, st: dict) -> bool:
        if rt.repo.has_worktree(name):
            return True
        job = st.get("job")
        if not job or st.get("phase") not in TERMINAL:
            return False
        backend = rt.backend_for(job["backend"])
        return bool(getattr(backend, "leftovers", lambda _run: False)(job["name"]))

    def _submit(self, rt: LabRuntime, obj: dict, spec: ExperimentSpec | None,
                a: dict) -> RunObservation:
        from controller.backends import RunRequest
        from controller.backends.kubernetes import KubernetesBackend
        from controller.kube.cluster import owner_reference

        assert spec is not None
        name = obj["metadata"]["name"]
        req = RunRequest(run=a["run"], experiment=name, campaign=spec.campaign,
                         candidate_source=rt.repo.candidate_source(name),
                         candidate_path=str(rt.repo.worktree_path(name) / rt.spec.surface),
                         slot=a.get("slot"), profile=rt.spec.profile, data=rt.spec.data,
                         budget_seconds=rt.spec.budget_seconds, gpus=spec.gpus,
                         overrides=spec.hf)
        backend = rt.backend_for(a["backend"])
        if isinstance(backend, KubernetesBackend):
            return backend.submit(req, owner=owner_reference(obj))
        return backend.submit(req)

    # -- one pass over a Lab ---------------------------------------------------------------------
    def reconcile_lab(self, namespace: str, name: str) -> LabRuntime | None:
        lab_obj = self.connect().get_custom(namespace, "labs", name)
        if lab_obj is None:
            return None
        try:
            self._validate_lab(lab_obj)
        except SpecError as e:
            self.connect().patch_status(namespace, "labs", name, {"conditions": [{
                "type": "Ready", "status": "False", "reason": "InvalidSpec", "message": str(e),
                "lastTransitionTime": utcnow()}]})
            self._event(lab_obj, Event("Warning", "InvalidSpec", str(e)))
            raise
        rt = self.runtime(namespace, name, lab_obj)
        rec = rt.sync()
        self._baseline(rt, rec)
        self._mirror_lab(rt)
        return rt

    def _baseline(self, rt: LabRuntime, rec: "MasterRecord") -> None:
        """Measure a master nobody has measured: one Job, through the core's reconcile_baseline."""
        from controller.backends import RunRequest
        from controller.kube.cluster import owner_reference

        m = rec.master()
        if m.val_bpb is not None:
            return
        name = baseline_run_name(m)
        obs = rt.backend.observe(name)
        slot = None
        if obs.state in ("queued", "running"):
            rt.book.hold(name)
        elif obs.state == "missing" and rt.baseline_failures[name] < BASELINE_ATTEMPTS:
            slot = rt.book.hold(name)
        intents = reconcile_baseline(m, obs, slot, rt.ledger.has_run(name))
        if slot is not None and "submit" not in [i.kind for i in intents]:
            rt.book.release(name)
        for intent in intents:
            a = intent.args
            if intent.kind == "submit":
                req = RunRequest(run=name, experiment="baseline", campaign="",
                                 candidate_source=rec.source, candidate_path="", slot=a["slot"],
                                 profile=rt.spec.profile, data=rt.spec.data,
                                 budget_seconds=rt.spec.budget_seconds,
                                 gpus=0 if rt.spec.profile == "tiny" else 1)
                rt.backend.submit(req, owner=owner_reference(rt.lab_obj))
                self._event(rt.lab_obj, Event("Normal", "BaselineSubmitted",
                                              f"The master {m.hash[:12]} has no val_bpb yet; "
                                              f"run {name} measures it first."))
            elif intent.kind == "record":
                rt.ledger.append(dict(a["row"], created_at=utcnow(), backend="kubernetes"))
            elif intent.kind == "set-master-metric":
                rt.store.set_metric(m.hash, a["val_bpb"])
                rt.sync()
                rt.backend.cleanup(name)
                rt.book.release(name)
                self._event(rt.lab_obj, Event("Normal", "BaselineMeasured",
                                              f"The master {m.hash[:12]} measures val_bpb "
                                              f"{a['val_bpb']:.6f}; experiments may run."))
            elif intent.kind == "resubmit-baseline":
                rt.baseline_failures[name] += 1
                left = BASELINE_ATTEMPTS - rt.baseline_failures[name]
                rt.backend.cleanup(name)
                rt.book.release(name)
                self._event(rt.lab_obj, Event(
                    "Warning", "BaselineFailed",
                    f"The baseline run {name} failed: {a.get('reason') or 'no reason given'}; "
                    + (f"trying again ({left} attempts left)." if left > 0 else
                       "no attempts left: fix the cause (see the ledger and the run's logs) and "
                       "restart the operator to try again.")))

    def _mirror_lab(self, rt: LabRuntime) -> None:
        """The Lab's status: the master of record and the runs in flight."""
        rec = rt.store.read()
        if rec is None:
            return
        d = rec.doc
        status: dict[str, Any] = {
            "master": {"hash": d["hash"][:12], "fullHash": d["hash"], "val_bpb": d.get("val_bpb"),
                       "experiment": d.get("experiment"), "promotedAt": d.get("promotedAt"),
                       "configMap": rt.store.name},
            "running": rt.book.in_flight(),
            "observedGeneration": int(rt.lab_obj["metadata"].get("generation", 1)),
        }
        m = rec.master()
        name = baseline_run_name(m)
        if m.val_bpb is None and rt.baseline_failures[name] >= BASELINE_ATTEMPTS:
            status["conditions"] = [{"type": "Ready", "status": "False", "reason": "BaselineFailed",
                                     "message": f"the baseline run {name} failed "
                                                f"{BASELINE_ATTEMPTS} times; no experiment runs "
                                                "until the master is measured",
                                     "lastTransitionTime": utcnow()}]
        elif m.val_bpb is None:
            status["conditions"] = [{"type": "Ready", "status": "False",
                                     "reason": "MeasuringBaseline",
                                     "message": f"run {name} measures the master first",
                                     "lastTransitionTime": utcnow()}]
        else:
            status["conditions"] = [{"type": "Ready", "status": "True", "reason": "Measured",
                                     "message": "the master has a val_bpb; experiments run",
                                     "lastTransitionTime": utcnow()}]
        if rt.mirrored is not None and _same_status(rt.mirrored, status):
            return
        self.connect().patch_status(rt.namespace, "labs", rt.name, status)
        rt.mirrored = status

    # -- kopf handlers ---------------------------------------------------------------------------
    def _timed(self, handler: str, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        try:
            return fn()
        finally:
            self.timings.append(Timing(handler, time.perf_counter() - t0))

    def configure(self, settings: Any, **_: Any) -> None:
        import kopf

        self.connect()
        self.settings = settings
        settings.persistence.finalizer = FINALIZER
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
        settings.posting.reporting_component = "autolab-operator"
        settings.posting.event_name_prefix = "autolab-"
        selector = "app.kubernetes.io/managed-by=autolab"
        settings.watching.label_selectors[("batch", "jobs")] = selector
        settings.watching.label_selectors[("v1", "pods")] = selector
        settings.watching.server_timeout = self.config.watch_timeout
        settings.scanning.disabled = not self.config.scanning
        if self.config.workers:
            settings.execution.max_workers = self.config.workers

    def login(self, **_: Any) -> Any:
        import kopf

        return kopf.ConnectionInfo(server=self.config.server, insecure=True)

    def experiment_changed(self, namespace: str, name: str, **_: Any) -> None:
        def work() -> None:
            with self.lock(namespace, name):
                self._guarded(namespace, name)
        self._timed("experiment", work)

    async def experiment_tick(self, namespace: str, name: str, status: Any, meta: Any = None,
                              **_: Any) -> None:
        """The resync timer: runs in flight, and anything a failed pass left undone."""
        if (status or {}).get("phase") in TERMINAL and (namespace, name) not in self.unsettled:
            return  # settled: nothing to look at (checked here, in the loop, at no cost)
        failed_at = self.failed.get((namespace, name))
        if failed_at is not None and failed_at == (meta or {}).get("generation"):
            return  # failed for good at this generation: its status says why
        self._in_background("timer", self.lock(namespace, name),
                            lambda: self._guarded(namespace, name), f"{namespace}/{name}")

    def _in_background(self, handler: str, lock: threading.Lock, fn: Callable[[], Any],
                       what: str) -> None:
        """Run a timer's pass on kopf's executor, skipped if a pass of that object is running.

        The timer returns at once: kopf waits for a running timer before it lets an object
        go, and a deletion should not wait for a resync. The object's lock keeps the pass
        and the finalizer apart. At most one pass per object waits for a thread, so when
        the timers outpace the threads (thousands of runs in flight) nothing piles up.
        """
        import asyncio
        import contextvars
        import functools

        if what in self._queued:
            return  # one pass of this object is waiting for a thread already: enough
        self._queued.add(what)

        def work() -> None:
            self._queued.discard(what)
            if not lock.acquire(blocking=False):
                return  # a pass is running; it sees what this one would
            try:
                fn()
            except Exception as e:  # kopf is not waiting for this one: say it here
                import kopf

                expected = isinstance(e, (LookupError, SpecError, kopf.TemporaryError,
                                          kopf.PermanentError))
                log.warning("resync of %s failed (the next one tries again): %s", what, e,
                            exc_info=not expected)
            finally:
                lock.release()
        # On kopf's executor, as its sync handlers are, with its context (for posting Events).
        call = functools.partial(contextvars.copy_context().run, self._timed, handler, work)
        executor = self.settings.execution.executor if self.settings is not None else None
        try:
            asyncio.get_running_loop().run_in_executor(executor, call)
        except RuntimeError:  # the executor is shut down: the operator is stopping
            self._queued.discard(what)

    def _guarded(self, namespace: str, name: str) -> Decision | None:
        """One pass, with its failure kept to this experiment and told on it.

        A Lab that is missing or invalid: try again later. A known failure (a SpecError:
        something in the objects that a person must fix) is told on the experiment's status
        and Events and becomes kopf's PermanentError: trying again changes nothing until the
        object does. Anything else is kopf's to retry, with back-off, and the timer's.
        """
        import kopf

        key = (namespace, name)
        try:
            decision = self.reconcile_experiment(namespace, name)
        except LabUnusable as e:
            raise kopf.TemporaryError(f"{e}; the experiment waits until its Lab is fixed",
                                      delay=self.config.resync_seconds) from None
        except LabMissing as e:
            raise kopf.TemporaryError(str(e), delay=self.config.retry_seconds) from None
        except SpecError as e:
            message = failure_message(name, e)
            self._tell_failure(namespace, name, message)
            raise kopf.PermanentError(message) from None
        except Exception:
            self.unsettled.add(key)  # the timer tries again, whatever the phase
            raise
        self.failed.pop(key, None)
        if decision is not None and not decision.finalized and failing(decision.status):
            recovered = with_recovery(decision.status, utcnow())
            if recovered is not None:
                self.connect().patch_status(namespace, "experiments", name, recovered)
        return decision

    def _tell_failure(self, namespace: str, name: str, message: str) -> None:
        """Put a failure on the experiment's status and Events (once per message)."""
        try:
            obj = self.connect().get_custom(namespace, "experiments", name)
            if obj is None:
                return
            self.failed[(namespace, name)] = (obj.get("metadata") or {}).get("generation")
            st = {k: v for k, v in (obj.get("status") or {}).items() if k != "kopf"}
            new = with_failure(st, message, utcnow())
            if new is not None:
                self.connect().patch_status(namespace, "experiments", name, new)
                self._event(obj, Event("Warning", RECONCILE_ERROR, message))
        except Exception as e:  # telling it must not hide what failed
            log.warning("could not tell the failure of %s/%s on it: %s", namespace, name, e)

    def experiment_deleted(self, namespace: str, name: str, body: Any, **_: Any) -> None:
        import kopf

        def work() -> None:
            with self.lock(namespace, name):
                try:
                    decision = self.reconcile_experiment(namespace, name, deleting=True)
                except LabMissing as e:
                    # Nowhere to record it: let it go rather than block the deletion forever.
                    kopf.warn(_ref(_plain(body)), reason="LabMissing",
                              message=f"{e}; the deletion is not recorded in any ledger.")
                    return
                except SpecError as e:
                    # Known and lasting: trying again would block the deletion forever.
                    kopf.warn(_ref(_plain(body)), reason=RECONCILE_ERROR,
                              message=f"{failure_message(name, e)}; the object goes without "
                                      "a ledger row (its Job, if any, goes with it).")
                    self.failed.pop((namespace, name), None)
                    return
                if decision is not None and not decision.finalized:
                    raise kopf.TemporaryError(
                        f"experiment {name}: waiting for its run to stop and its record to be "
                        "written before it goes", delay=self.config.retry_seconds)
        self._timed("delete", work)

    def run_changed(self, type: str | None, body: Any, namespace: str, **_: Any) -> None:
        """A Job or Pod of ours changed: pass over its Experiment (or its Lab, for a baseline)."""
        from controller.kube.cluster import LABEL_BASELINE, LABEL_EXPERIMENT, LABEL_LAB

        if type is None or (type == "ADDED" and body.get("kind") == "Job"):
            return  # the initial listing (resume covers it), or a Job we just created
        meta = body.get("metadata") or {}
        labels = meta.get("labels") or {}
        if body.get("kind") == "Pod" and type != "DELETED":
            st = body.get("status") or {}
            terminated = any((cs.get("state") or {}).get("terminated")
                             for cs in st.get("containerStatuses") or [])
            if st.get("phase") == "Pending" and not terminated:
                return  # still queued, as the Experiment already says

        experiment = labels.get(LABEL_EXPERIMENT)
        key = (namespace, experiment or "")
        if experiment and self.phases.get(key) in TERMINAL and key not in self.unsettled:
            return  # its result is recorded; a Job or Pod going away changes nothing

        def work() -> None:
            if experiment:
                with self.lock(namespace, experiment):
                    self._guarded(namespace, experiment)
            elif labels.get(LABEL_BASELINE) and labels.get(LABEL_LAB):
                with self.lock(namespace, f"lab:{labels[LABEL_LAB]}"):
                    self.reconcile_lab(namespace, labels[LABEL_LAB])
        self._timed("run", work)

    def lab_changed(self, namespace: str, name: str, **_: Any) -> None:
        import kopf

        def work() -> None:
            with self.lock(namespace, f"lab:{name}"):
                try:
                    self.reconcile_lab(namespace, name)
                except SpecError as e:
                    raise kopf.PermanentError(str(e)) from None
        self._timed("lab", work)

    async def lab_tick(self, namespace: str, name: str, **_: Any) -> None:
        self._in_background("lab-timer", self.lock(namespace, f"lab:{name}"),
                            lambda: self.reconcile_lab(namespace, name), f"Lab {namespace}/{name}")

    def shutdown(self, **_: Any) -> None:
        if self.kube is not None:
            self.kube.api.close()


def _observe_or_forget(book: "SlotBook", name: str, st: dict, priority: int) -> None:
    """Put one experiment into a slot book as its last written status says."""
    try:
        book.observe(name, st, priority)
    except Exception:  # a status too broken to read: hold nothing for it
        book.forget(name)


def _priority(spec: dict) -> int:
    p = spec.get("priority", 0)
    return p if isinstance(p, int) else 0


def _same_status(a: dict, b: dict) -> bool:
    def strip(s: dict) -> dict:
        s = copy.deepcopy(s)
        for c in s.get("conditions", []):
            c.pop("lastTransitionTime", None)
        return s
    return strip(a) == strip(b)


def register(op: Operator, registry: Any, login: bool = True) -> Any:
    """Put the operator's handlers into a kopf registry (the default one, or a test's)."""
    import kopf

    r = op.config.resync_seconds
    retry = op.config.retry_seconds
    ours = {"app.kubernetes.io/managed-by": "autolab"}
    kopf.on.startup(registry=registry)(op.configure)
    kopf.on.cleanup(registry=registry)(op.shutdown)
    if login:
        if op.config.server:
            kopf.on.login(registry=registry)(op.login)
        else:
            kopf.on.login(registry=registry)(kopf.login_via_client)
    kopf.on.create(*EXPERIMENTS, id="experiment-create", backoff=retry,
                   registry=registry)(op.experiment_changed)
    kopf.on.update(*EXPERIMENTS, id="experiment-update", backoff=retry,
                   registry=registry)(op.experiment_changed)
    kopf.on.resume(*EXPERIMENTS, id="experiment-resume", backoff=retry,
                   registry=registry)(op.experiment_changed)
    kopf.on.delete(*EXPERIMENTS, id="experiment-delete", backoff=retry,
                   registry=registry)(op.experiment_deleted)
    kopf.timer(*EXPERIMENTS, id="experiment-resync", interval=r, initial_delay=r,
               registry=registry)(op.experiment_tick)
    kopf.on.create(*LABS, id="lab-create", backoff=retry, registry=registry)(op.lab_changed)
    kopf.on.update(*LABS, id="lab-update", backoff=retry, registry=registry)(op.lab_changed)
    kopf.on.resume(*LABS, id="lab-resume", backoff=retry, registry=registry)(op.lab_changed)
    kopf.timer(*LABS, id="lab-resync", interval=r, initial_delay=r,
               registry=registry)(op.lab_tick)
    kopf.on.event("batch", "v1", "jobs", id="job-changed", labels=ours,
                  registry=registry)(op.run_changed)
    kopf.on.event("v1", "pods", id="pod-changed", labels=ours,
                  registry=registry)(op.run_changed)
    return registry
