"""The Operator: its passes over an Experiment and a Lab, and the kopf handlers that call them.

Every handler hands its object to the one engine pass (`reconcile_experiment`,
`reconcile_lab`) on a thread of its own, keeps a failure to its object (told on the object,
kopf's PermanentError for what a person must fix, a retry for the rest), and `register()`
puts the handlers into the kopf registry it is given.
"""


from __future__ import annotations

import collections
import copy
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from controller.core.failures import RECONCILE_ERROR, failure_message, with_failure
from controller.core.intents import Decision, Event
from controller.core.reconcile import BASELINE_ATTEMPTS, TERMINAL
from controller.core.spec import API_VERSION, SpecError, validate_document
from controller.engine import noise_record
from controller.lab.clock import utcnow
from controller.operator.runtime import (CHECK_POOL_START_SECONDS, COMPONENT, EVENT_MESSAGE_MAX,
                                        EXPERIMENTS, FINALIZER, HANDLER_WORKERS, LABS,
                                        MASTER_MAX_AGE, QUEUE_SHOWN, USER_AGENT, LabMissing,
                                        LabRuntime, LabUnusable, OperatorConfig, _noise_status,
                                        _plain, _ref, event_name, log, object_log,
                                        transition_key)

if TYPE_CHECKING:
    from controller.kube.cluster import Kube


def generation_diffbase() -> Any:
    """kopf's diff base, kept in this process: for each object, the `metadata.generation` it
    last handled.

    kopf tells a creation from an update from an event with nothing new by comparing the
    object with a base it stored when it last handled it. Its default base is a copy of the
    object's spec, labels and annotations, written into an annotation of the object after
    every handled change. For this operator that copy costs and serves nothing:

    - every Experiment paid one more PATCH and one more watch event for it, after its pass,
      while a batch of specs waited for their Jobs;
    - it copied the whole diff into the object's annotations, which the API server limits to
      256 KiB in all: a diff of quotes or non-ASCII text, JSON-escaped there, can pass the
      CRD's 128 Ki-character limit and still not fit, and kopf could never mark it handled;
    - no handler reads kopf's diff. Each pass reads the object and reconciles it whole, and
      what it reads of the object is the spec, whose changes the API server counts in
      `metadata.generation` (a custom resource with a status subresource bumps it for a
      change of anything but metadata and status).

    So the base is the generation, in memory. A restarted operator has none: every object is
    new to it, and the creation handler makes one pass over each, which is what the resume
    handler would have done. An object's base goes when its deletion has been handled (a Lab,
    which has no deletion handler, leaves a few bytes behind). Objects an older operator
    handled keep its annotations, which nothing reads any more. Built on kopf's documented
    extension point (a `kopf.DiffBaseStorage` subclass in
    `settings.persistence.diffbase_storage`); kopf loads only when an operator starts.
    """
    import kopf

    class GenerationDiffBase(kopf.DiffBaseStorage):
        def __init__(self) -> None:
            super().__init__()
            self.bases: dict[str, Any] = {}

        def build(self, *, body: Any, extra_fields: Any = None) -> Any:
            if extra_fields:  # a handler that watches a field outside the spec (none here)
                return super().build(body=body, extra_fields=extra_fields)
            return {"metadata": {"generation": body.get("metadata", {}).get("generation")}}

        def fetch(self, *, body: Any) -> Any:
            return self.bases.get(body.get("metadata", {}).get("uid"))

        def store(self, *, body: Any, patch: Any, essence: Any) -> None:
            meta = body.get("metadata", {})  # the patch stays empty
            if meta.get("deletionTimestamp"):  # going: every event of it is a deletion now
                self.bases.pop(meta.get("uid"), None)
            else:
                self.bases[meta.get("uid")] = essence

    return GenerationDiffBase()


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
        self.settings: Any = None  # kopf's, from the startup handler
        self.closed = False  # set by the cleanup handler
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
            # One connection per handler thread (urllib3 drops what does not fit its pool).
            cfg.connection_pool_maxsize = max(cfg.connection_pool_maxsize,
                                              self.config.workers or HANDLER_WORKERS)
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
                                        _priority(spec),
                                        str(exp["metadata"].get("creationTimestamp") or ""))
                except Exception as e:  # one malformed object must not keep the lab down
                    object_log(namespace, str((exp.get("metadata") or {}).get("name"))).warning(
                        "not counted in the slots of Lab %s: %s", lab, e)
            self.labs[key] = rt
            return rt

    @staticmethod
    def _validate_lab(lab_obj: dict) -> None:
        meta = lab_obj.get("metadata") or {}
        validate_document({"apiVersion": lab_obj.get("apiVersion", API_VERSION), "kind": "Lab",
                           "metadata": {"name": meta.get("name")},
                           "spec": lab_obj.get("spec") or {}},
                          source=f"Lab {meta.get('namespace')}/{meta.get('name')}", kind="Lab")

    def _event(self, obj: dict, event: Event, fact: tuple[str, ...] | None = None) -> bool:
        """Post `event` about `obj`, named after `fact` (default: the object's uid, the
        Event's type, reason and message). False if it was posted before (409)."""
        from kubernetes.client.exceptions import ApiException

        ref = _ref(obj)
        meta = ref["metadata"]
        namespace = meta.get("namespace")
        if fact is None:
            fact = (meta.get("uid") or "", event.type, event.reason, event.message)
        now = utcnow()
        body = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": event_name(meta["name"], *fact), "namespace": namespace},
            "involvedObject": {"apiVersion": ref["apiVersion"], "kind": ref["kind"],
                               "name": meta["name"], "namespace": namespace,
                               **({"uid": meta["uid"]} if meta.get("uid") else {})},
            "type": event.type, "reason": event.reason,
            "message": event.message[:EVENT_MESSAGE_MAX],
            "source": {"component": COMPONENT}, "reportingComponent": COMPONENT,
            "reportingInstance": self._instance(),
            "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        }
        try:
            self.connect().create_event(namespace, body)
        except ApiException as e:
            if e.status == 409:  # told before (by this operator or one that died after it)
                return False
            raise
        return True

    def _instance(self) -> str:
        posting = getattr(self.settings, "posting", None)
        return str(getattr(posting, "reporting_instance", None) or os.environ.get("POD_ID")
                   or socket.gethostname())[:128]

    # -- one pass over an Experiment -------------------------------------------------------------
    def reconcile_experiment(self, namespace: str, name: str, deleting: bool = False,
                             seen: dict | None = None) -> Decision | None:
        """One engine pass over the Experiment. None if the object is gone.

        The pass reads the object first: kopf's copy may not hold what an earlier pass of
        this process wrote. `seen` is kopf's copy of an object no pass of this process has
        read or written (its first creation handler), which is as fresh as a read."""
        obj = seen if seen is not None else self.connect().get_custom(namespace, "experiments",
                                                                      name)
        if obj is None:
            return None
        lab = (obj.get("spec") or {}).get("lab", "default")
        try:
            rt = self.runtime(namespace, lab if isinstance(lab, str) else "default")
        except SpecError as e:
            raise LabUnusable(str(e)) from None
        if seen is not None and name in rt.statuses.known:  # a pass has been here: read it
            obj = self.connect().get_custom(namespace, "experiments", name)
            if obj is None:
                return None
        decision = rt.engine.reconcile(rt.statuses.observed(obj), deleting=deleting)
        key = (namespace, name)
        st = decision.status
        self.phases[key] = st.get("phase")
        if decision.finalized:
            rt.statuses.refs.pop(name, None)
            rt.statuses.known.pop(name, None)
            self.unsettled.discard(key)
            self.phases.pop(key, None)
            self.failed.pop(key, None)
        elif st.get("phase") in TERMINAL and decision.intents:
            self.unsettled.add(key)  # the timer comes back for what is left
        else:
            self.unsettled.discard(key)
        return decision

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
        rt.sync()
        rt.engine.baseline()
        self._mirror_lab(rt)
        return rt

    def _mirror_lab(self, rt: LabRuntime) -> None:
        """The Lab's status: the master of record, the runs in flight and the queue.

        The master as read at most MASTER_MAX_AGE ago: a promotion or a baseline refreshes
        it before it tells the Lab, and a phase change (most calls) does not move it.
        """
        rec = rt.master_record()
        d = rec.doc
        status: dict[str, Any] = {
            "master": {"hash": d["hash"][:12], "fullHash": d["hash"], "val_bpb": d.get("val_bpb"),
                       "experiment": d.get("experiment"), "promotedAt": d.get("promotedAt"),
                       "configMap": rt.store.name},
            "running": rt.book.in_flight(),
            "queue": rt.book.queue()[:QUEUE_SHOWN],
            "noise": _noise_status(noise_record(rt.engine)),
            "observedGeneration": int(rt.lab_obj["metadata"].get("generation", 1)),
        }
        m = rec.master()
        if m.val_bpb is None and rt.engine.baseline_failures.get(m.hash, 0) >= BASELINE_ATTEMPTS:
            status["conditions"] = [{"type": "Ready", "status": "False", "reason": "BaselineFailed",
                                     "message": f"the baseline of master {m.hash[:12]} failed "
                                                f"{BASELINE_ATTEMPTS} times; no experiment runs "
                                                "until the master is measured (see the ledger "
                                                "and the Lab's events; restart the operator to "
                                                "try again)",
                                     "lastTransitionTime": utcnow()}]
        elif m.val_bpb is None:
            status["conditions"] = [{"type": "Ready", "status": "False",
                                     "reason": "MeasuringBaseline",
                                     "message": f"a baseline run measures master {m.hash[:12]} "
                                                "first",
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

        self.settings = settings
        settings.persistence.finalizer = FINALIZER
        settings.persistence.progress_storage = kopf.StatusProgressStorage()
        settings.persistence.diffbase_storage = generation_diffbase()
        settings.posting.reporting_component = "autolab-operator"
        settings.posting.event_name_prefix = "autolab-"
        selector = "app.kubernetes.io/managed-by=autolab"
        settings.watching.label_selectors[("batch", "jobs")] = selector
        settings.watching.label_selectors[("v1", "pods")] = selector
        settings.watching.server_timeout = self.config.watch_timeout
        settings.scanning.disabled = not self.config.scanning
        # Passes wait on the API server and the check pool far more than they compute: kopf's
        # default (cores + 4 threads) let ~15 of them a second through on 2 cores.
        settings.execution.max_workers = self.config.workers or HANDLER_WORKERS
        from controller.lab.check_pool import shared_check_pool

        # The pre-run checks' processes, started and ready before the first events: a batch of
        # specs waiting at start-up (resume) would otherwise wait for their imports, which
        # also take the CPU the first passes need.
        if not shared_check_pool().start(wait=CHECK_POOL_START_SECONDS):
            log.warning("the check pool's processes were not ready after %.0f s; going on",
                        CHECK_POOL_START_SECONDS)

    def login(self, **_: Any) -> Any:
        import kopf

        return kopf.ConnectionInfo(server=self.config.server, insecure=True)

    def experiment_changed(self, namespace: str, name: str, reason: Any = None,
                           retry: int = 0, body: Any = None, **_: Any) -> None:
        # A new object's first handler call: kopf's copy is the object as created (a read
        # would give the same; see `reconcile_experiment`).
        seen = copy.deepcopy(dict(body)) if reason == "create" and not retry and body else None

        def work() -> None:
            with self.lock(namespace, name):
                self._guarded(namespace, name, seen)
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
                            lambda: self._guarded(namespace, name), f"{namespace}/{name}",
                            object_log(namespace, name))

    def _in_background(self, handler: str, lock: threading.Lock, fn: Callable[[], Any],
                       what: str, olog: logging.LoggerAdapter) -> None:
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
                olog.warning("resync failed (the next one tries again): %s", e,
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

    def _guarded(self, namespace: str, name: str, seen: dict | None = None) -> Decision | None:
        """One pass, with its failure kept to this experiment and told on it.

        A Lab that is missing or invalid: try again later. A known failure (a SpecError:
        something in the objects that a person must fix) is told on the experiment's status
        and Events and becomes kopf's PermanentError: trying again changes nothing until the
        object does. Anything else is kopf's to retry, with back-off, and the timer's.
        """
        import kopf

        key = (namespace, name)
        try:
            decision = self.reconcile_experiment(namespace, name, seen=seen)
        except LabUnusable as e:
            raise kopf.TemporaryError(f"{e}; the experiment waits until its Lab is fixed",
                                      delay=self.config.resync_seconds) from None
        except LabMissing as e:
            raise kopf.TemporaryError(str(e), delay=self.config.retry_seconds) from None
        except SpecError as e:
            raise kopf.PermanentError(self._tell_failure(namespace, name, e)) from None
        except Exception:
            self.unsettled.add(key)  # the timer tries again, whatever the phase
            raise
        self.failed.pop(key, None)
        return decision

    def _tell_failure(self, namespace: str, name: str, error: Exception) -> str:
        """Put a failure on the experiment's status and Events (once per message)."""
        message = failure_message(name, error)
        try:
            obj = self.connect().get_custom(namespace, "experiments", name)
            if obj is None:
                return message
            self.failed[(namespace, name)] = (obj.get("metadata") or {}).get("generation")
            # Told without the Lab's engine: the failure may be that the Lab cannot be used.
            st = {k: v for k, v in (obj.get("status") or {}).items() if k != "kopf"}
            new = with_failure(st, message, utcnow())
            if new is not None:  # the Event first, named after the transition (see _event)
                self._event(obj, Event("Warning", RECONCILE_ERROR, message),
                            fact=((obj.get("metadata") or {}).get("uid") or "", "transition",
                                  transition_key(st), "Warning", RECONCILE_ERROR))
                self.connect().patch_status(namespace, "experiments", name, new)
        except Exception as e:  # telling it must not hide what failed
            object_log(namespace, name).warning("could not tell its failure on it: %s", e)
        return message

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

    def run_matters(self, type: str | None, body: Any, namespace: str, **_: Any) -> bool:
        """Whether a Job's or Pod's event is worth a pass: kopf's `when` filter, asked in its
        event loop, so that the many that are not (a Job just created, a Pod still queued) cost
        no handler thread."""
        from controller.kube.cluster import LABEL_EXPERIMENT

        if type is None or (type == "ADDED" and body.get("kind") == "Job"):
            return False  # the initial listing (resume covers it), or a Job we just created
        if body.get("kind") == "Pod" and type != "DELETED":
            st = body.get("status") or {}
            terminated = any((cs.get("state") or {}).get("terminated")
                             for cs in st.get("containerStatuses") or [])
            if st.get("phase") == "Pending" and not terminated:
                return False  # still queued, as the Experiment already says
        experiment = ((body.get("metadata") or {}).get("labels") or {}).get(LABEL_EXPERIMENT)
        key = (namespace, experiment or "")
        # its result is recorded; a Job or Pod going away changes nothing
        return not (experiment and self.phases.get(key) in TERMINAL and key not in self.unsettled)

    def run_changed(self, body: Any, namespace: str, **_: Any) -> None:
        """A Job or Pod of ours changed (and `run_matters`): pass over its Experiment (or its
        Lab, for a baseline)."""
        from controller.kube.cluster import LABEL_BASELINE, LABEL_EXPERIMENT, LABEL_LAB

        labels = (body.get("metadata") or {}).get("labels") or {}
        experiment = labels.get(LABEL_EXPERIMENT)

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
                            lambda: self.reconcile_lab(namespace, name), f"Lab {namespace}/{name}",
                            object_log(namespace, name, "Lab"))

    def shutdown(self, **_: Any) -> None:
        self.closed = True  # a Lab's mirror still waiting writes nothing
        if self.kube is not None:
            self.kube.api.close()


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
    kopf.on.event("batch", "v1", "jobs", id="job-changed", labels=ours, when=op.run_matters,
                  registry=registry)(op.run_changed)
    kopf.on.event("v1", "pods", id="pod-changed", labels=ours, when=op.run_matters,
                  registry=registry)(op.run_changed)
    return registry
