"""The Engine: observe -> reconcile() -> carry out, for one lab (the policies it carries out
are written once, in `controller/engine/__init__.py`)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import threading
import time
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Callable, Iterable

from controller.backends import Backend, RunRequest
from controller.core.errors import MachineError
from controller.core.evaluation import evaluation_limit
from controller.core.failures import (RECONCILE_ERROR, failing, failure_message, with_failure,
                                      with_recovery)
from controller.core.intents import (AcquireSlot, Cancel, ClaimTest, Cleanup, CleanupRun,
                                     Decision, Event, Materialise, Promote, Promotion, Record,
                                     ResubmitBaseline, SetMasterMetric, SetPlace, Submit)
from controller.core.reconcile import (BASELINE_ATTEMPTS, Candidate, Master, PromotionResult,
                                       RunObservation, World, baseline_run_name, carried_values,
                                       reconcile, reconcile_baseline, run_name)
from controller.core.slots import UNLIMITED, SlotBook
from controller.core.status import PENDING, ExperimentStatus
from controller.core.spec import ExperimentSpec, LabSpec, next_name
from controller.lab.clock import utcnow
from controller.engine.campaign import Campaign
from controller.engine.seams import (DEFAULT_HOOKS, EventSink, Hook, MasterOfRecord, Observed,
                                     StatusStore)
from controller.lab.ledger import Ledger
from controller.lab.memory import near_duplicates
from controller.lab.paths import LabPaths
from controller.lab.profiles import ProfileError, lab_profile
from controller.lab.check_pool import CheckPool, shared_check_pool
from controller.lab.checks import recorded_duplicate
from controller.lab.files import atomic_write
from controller.lab.repo import LabRepo

MAX_STEPS = 10  # reconcile rounds in one pass; a pass normally settles in two or three
BASELINE_GPUS = 1  # what a default experiment asks (ExperimentSpec.gpus)


def capacity(backend: str, lab: LabSpec, visible: Callable[[int], list[str]]) -> list[str] | None:
    """The slot ids of a backend: None where the backend schedules by itself."""
    if backend == "hf":
        return [f"hf-{i}" for i in range(max(1, lab.gpu_slots))]
    if backend == "kubernetes":
        return [f"slot-{i}" for i in range(lab.gpu_slots)] if lab.gpu_slots > 0 else None
    return visible(lab.gpu_slots)


def _priority(spec: dict | None) -> int:
    p = (spec or {}).get("priority", 0)
    return p if isinstance(p, int) else 0


class BaselineFailed(MachineError, RuntimeError):
    """The master could not be measured in BASELINE_ATTEMPTS attempts: a person must look."""


@dataclass
class BaselineState:
    run: str | None = None         # this attempt's run name
    state: str = "measured"        # measured | running | waiting | failed
    message: str = ""


@dataclass
class _Pass:
    """One pass over one experiment: what it learned so far, and its status as it goes."""

    obs: Observed
    spec: ExperimentSpec | None
    spec_doc: dict | None
    spec_error: str | None
    deleting: bool
    schedule: bool
    st: dict                   # its status now
    written: dict              # its status as stored
    untold: list[Event] = field(default_factory=list)  # events of transitions not stored yet
    run: RunObservation | None = None
    candidate: Candidate | None = None
    duplicate: str | None = None
    near: tuple[str, ...] = ()
    promotion: PromotionResult | None = None
    slot: str | None = None
    now: str = ""              # the time of the step's World
    waiting: bool = False      # no slot yet: the pass ends, a later one asks again

    @property
    def name(self) -> str:
        return self.obs.name

    @property
    def priority(self) -> int:
        return self.spec.priority if self.spec else 0


# --- the engine --------------------------------------------------------------------------------

@dataclass
class Engine:
    """Decides for one lab. Front ends give it their seams and backends; it does the rest."""

    paths: LabPaths
    lab_name: str
    lab: LabSpec
    statuses: StatusStore
    events: EventSink
    backends: dict[str, Backend]
    make_backend: Callable[[str], Backend]  # builds a backend the first time one is named
    visible_slots: Callable[[int], list[str]]
    master: MasterOfRecord | None = None    # None: the lab repo is the master of record
    local_means: str = "local"              # in a cluster, "local" (the default) means its Jobs
    lab_owner: dict | None = None           # in a cluster: the Lab's ownerReference
    hooks: tuple[Hook, ...] = DEFAULT_HOOKS
    checks: CheckPool | None = None         # where checks run at once (None: the shared pool)
    checks_on_pool: bool = False            # every check on the pool, not only `precheck`'s
    repo: LabRepo = field(init=False)
    ledger: Ledger = field(init=False)
    book: SlotBook = field(init=False)
    lock: threading.RLock = field(init=False)  # the lab repo and the master: one at a time
    baseline_failures: dict[str, int] = field(init=False)
    _changes: dict[str, dict[str, str]] = field(init=False)
    _prechecks: dict[str, tuple[ExperimentSpec, Future]] = field(init=False)
    _started_next: dict[str, tuple[str, str]] = field(init=False)
    _profile_eval_limits: dict[str, float | None] = field(init=False)
    campaign: Campaign = field(init=False)

    def __post_init__(self) -> None:
        self.repo = LabRepo(self.paths.root, self.lab)
        if self.master is None:
            self.master = self.repo
        self.ledger = Ledger(self.paths.ledger)
        self.book = SlotBook(self.slot_ids())
        self.lock = threading.RLock()
        self.campaign = Campaign(self.paths, self.lock)
        self.baseline_failures = {}
        self._changes = {}  # experiment -> the constants it changed (near-duplicate lookups)
        self._prechecks = {}  # experiment -> (the spec, its check started by precheck())
        self._started_next = {}  # slot -> (the run being evaluated there, who was started next)
        self._profile_eval_limits = {}  # profile -> its eval_timeout (the pinned harness's)

    # -- configuration ---------------------------------------------------------------------------
    def set_lab(self, lab: LabSpec) -> None:
        if lab != self.lab:
            self.lab = lab
            self.repo.lab = lab
            self.backends.clear()  # built again, from the new spec, when next named
            self.book.resize(self.slot_ids())

    def slot_ids(self) -> list[str] | None:
        return capacity(self.default_backend, self.lab, self.visible_slots)

    @property
    def default_backend(self) -> str:
        """The lab's backend, where its baseline runs and whose capacity its slots are."""
        return self.local_means if self.lab.backend == "local" else self.lab.backend

    def backend(self, name: str) -> Backend:
        name = self.local_means if name == "local" else name
        if name not in self.backends:
            self.backends[name] = self.make_backend(name)
        return self.backends[name]

    # -- the slot book -----------------------------------------------------------------------------
    def observe_all(self, observed: list[tuple[str, dict, int, str]]) -> None:
        """Fill the slot book afresh from (name, status, priority, created) as written."""
        book = SlotBook(self.slot_ids())
        for name, status, priority, created in observed:
            try:
                book.observe(name, status, priority, created)
            except Exception:  # a status too broken to read holds nothing
                book.forget(name)
        book.carry(self.book)
        self.book = book

    def duplicate_of(self, name: str, c: Candidate) -> str | None:
        """What a checked candidate repeats: the master, a measured run, or a run in flight."""
        hit = recorded_duplicate(self.repo, self.ledger, name, c)
        if hit or c.refusal:
            return hit
        return self.book.claim(name, (c.candidate_hash, c.semantic_hash))

    # -- the pre-run checks -----------------------------------------------------------------------
    def _pool(self) -> CheckPool:
        return self.checks or shared_check_pool()

    def precheck(self, observed: Iterable[Observed]) -> int:
        """Start the pre-run checks of new experiments on the check pool, ahead of their passes.

        Each pass then takes its result instead of checking (`_materialise`), so a batch of
        new specs is checked on every core while the passes, and with them the duplicate
        lookups and claims, stay one at a time and in the front end's order. Only experiments
        whose pass is about to check them are started (Pending, a spec that reads); one alone
        is checked by its pass. Returns how many were started.
        """
        todo: list[tuple[str, ExperimentSpec]] = []
        for obs in observed:
            if obs.deleting or obs.status.get("phase") not in (None, PENDING):
                continue
            try:
                spec, _, error = self.spec_of(obs)
            except Exception:  # its own pass meets the problem and tells it
                continue
            if spec is not None and error is None:
                todo.append((obs.name, spec))
        if len(todo) < 2:
            return 0
        pool = self._pool()
        for name, spec in todo:
            self._prechecks[name] = (spec, pool.submit(self.repo, name, spec))
        return len(todo)

    def drop_prechecks(self) -> None:
        """Forget the checks no pass took (each has finished: nothing runs on behind the caller).

        What such a check made (a branch, its candidate marker) is cleaned up with its
        experiment, as after a controller that died between a check and its status.
        """
        while self._prechecks:
            _, (_, future) = self._prechecks.popitem()
            with contextlib.suppress(Exception):
                future.result()

    def _materialise(self, name: str, spec: ExperimentSpec) -> tuple[Candidate, str | None]:
        """The pre-run checks, then the duplicate lookup.

        The checks run outside the engine's lock (on the pool: a check started by `precheck`,
        or every check where `checks_on_pool`, as in the operator, whose handlers run passes
        of many experiments at once); the duplicate lookup and the in-flight claim run under
        it, after `before_checks`, and only if the master is still the one the candidate was
        checked against; otherwise it is checked again, under the lock, as it always was.
        """
        future: Future | None = None
        kept = self._prechecks.pop(name, None)
        if kept is not None and kept[0] == spec:
            future = kept[1]
        elif kept is not None:  # of another spec: let it end before its branch is made anew
            with contextlib.suppress(Exception):
                kept[1].result()
        if future is None and self.checks_on_pool:
            future = self._pool().submit(self.repo, name, spec)
        if future is not None:
            try:
                candidate, against = future.result()
            except BrokenProcessPool:  # a worker died: check here instead
                candidate, against = None, None
            if candidate is not None:
                asked_at = time.monotonic()
                with self.lock:
                    self._master_in_step(asked_at)
                    if against == self.repo.master().commit:
                        return candidate, self.duplicate_of(name, candidate)
        asked_at = time.monotonic()
        with self.lock:
            self._master_in_step(asked_at)
            candidate = self.repo.materialise(name, spec)
            return candidate, self.duplicate_of(name, candidate)

    def _master_in_step(self, asked_at: float) -> None:
        """Bring the lab repo's master in step with a master of record that mirrors another."""
        self.master.before_checks(asked_at)

    # -- the checked spec ---------------------------------------------------------------------------
    def checked_spec(self, key: str) -> dict | None:
        p = self.paths.checked_spec(key)
        return json.loads(p.read_text()) if p.exists() else None

    def _keep_checked_spec(self, key: str, spec: dict) -> None:
        atomic_write(self.paths.checked_spec(key), json.dumps(spec, sort_keys=True) + "\n")

    def spec_of(self, obs: Observed) -> tuple[ExperimentSpec | None, dict | None, str | None]:
        """The spec that runs (the checked copy once there is one), its dict, and any refusal.

        Once checked, the copy is what runs: a later edit that breaks the live spec is ignored
        (reconcile() says SpecChangeIgnored), as a later edit that keeps it valid is.
        """
        checked = self.checked_spec(obs.key)
        if obs.spec_error and checked is None:
            return None, obs.spec, obs.spec_error
        doc = checked or obs.spec
        if doc is None:
            return None, None, None
        try:
            spec = ExperimentSpec.from_dict(doc)
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            return None, doc, f"spec: {e}"
        return spec, doc, None

    # -- one experiment ------------------------------------------------------------------------------
    def reconcile(self, obs: Observed, deleting: bool = False,
                  schedule: bool = True) -> Decision:
        """Observe the rest of its world, reconcile and act until nothing is left to do.

        `obs` is the experiment as its front end just read it (under the front end's own
        guard: a file lock, the operator's per-object lock): the pass never reads it again,
        it writes over it. `schedule=False` leaves a slot request unanswered this time (a
        front end that checks a batch of new specs first, so their priorities are weighed
        together, then schedules).
        """
        name = obs.name
        try:
            decision = self._pass(obs, deleting or obs.deleting, schedule)
        except Exception:
            # The slot book is the lab's: what a failed pass granted or claimed goes back to
            # what the written status says.
            self._restore(name)
            raise
        if not decision.finalized and failing(decision.status):
            recovered = with_recovery(decision.status, utcnow())  # a pass that failed before
            if recovered is not None:
                self.statuses.write_status(name, recovered, decision.status)
        return decision

    def _restore(self, name: str) -> None:
        try:
            obs = self.statuses.read(name)
        except Exception:  # unreadable: the next pass observes it again
            return
        if obs is None:
            self.book.forget(name)
            return
        try:
            self.book.observe(name, obs.status, _priority(obs.spec), obs.created)
        except Exception:
            self.book.forget(name)

    def _tell(self, name: str, events: list[Event]) -> None:
        """Tell `events` about Experiment `name`, and empty the list."""
        for event in events:
            self.events.experiment(name, event)
        events.clear()

    def world(self, name: str, spec: ExperimentSpec | None, status: dict, *,
              slot: str | None = None, observe: bool = True, **seen) -> World:
        """The World of one experiment, as this engine sees it: the one place a World is made.

        `seen`: what the caller learned already (the spec's refusal, its checks, its run, a
        promotion's answer: World's fields by name). `observe=False` leaves out what only a
        recorded experiment has (its ledger row, leftovers, its test): a dry run's World.
        """
        observed: dict = {}
        if observe:
            job = status.get("job") or {}
            observed = dict(recorded=self.ledger.has_run(status.get("run") or job.get("name")
                                                         or run_name(name)),
                            worktree=self._leftovers(name, status),
                            **self._test_of(name, status, slot))
        return World(name=name, spec=spec, lab=self._world_lab(), master=self.master.master(),
                     now=utcnow(), status=status, slot=slot, **seen, **observed)

    def _begin(self, obs: Observed, deleting: bool, schedule: bool) -> _Pass:
        """A pass's start: the spec that runs, and the run its status names, observed."""
        spec, spec_doc, spec_error = self.spec_of(obs)
        fresh = not deleting and obs.status.get("phase") in (None, PENDING) \
            and not obs.status.get("candidateHash")  # not checked yet: no row of its own
        refusal = self.name_refusal(obs.name) if fresh else None
        if refusal:
            spec, spec_error = None, refusal
        p = _Pass(obs=obs, spec=spec, spec_doc=spec_doc, spec_error=spec_error,
                  deleting=deleting, schedule=schedule, st=obs.status, written=obs.status)
        view = ExperimentStatus.parse(p.st)  # a status that is not one fails here, and says why
        if view.job and (view.active or (deleting and not view.terminal)):
            p.run = self.backend(view.job.backend).observe(view.job.name)
            if p.run.handback and p.run.state == "running":
                self._give_back(view.job.backend, view.job.name)
            elif p.run.handover and p.run.state == "running" and view.job.slot:
                self._start_next(view.job.backend, view.job.slot, view.job.name)
        return p

    def name_refusal(self, name: str) -> str | None:
        """Why `name` cannot be a new experiment: the ledger holds it (the one place the rule
        of permanent names is decided; both front ends and `autolab validate` ask here).

        A new object under a name the ledger holds would have its runs (`exp-<name>-<attempt>`)
        be the old ones, adopted (a backend never starts a run twice), and judged with the old
        program's val_bpb; its own rows never written (the run ids are recorded). A spec file
        written by hand, an Experiment deleted and made again: both come through here.
        """
        first = run_name(name)
        used = self.ledger.name_recorded(name) or (
            f"ledger run {first}" if self.ledger.has_run(first) else None)
        if not used:
            return None
        return (f"experiment name {name!r} was used before ({used}); names are permanent once "
                f"recorded (runs, branches and ledger rows are named after them): apply it "
                f"under a new name, e.g. {next_name(name)}")

    def dry_run(self, name: str, spec: ExperimentSpec | None, spec_error: str | None = None,
                scratch: str | None = None) -> dict:
        """The status an experiment's first pass would write, nothing kept (`autolab validate`).

        The checks run on a candidate made under `scratch` (a name no experiment can have),
        removed after whatever happens; then the duplicate lookup. A candidate that passes is
        claimed in flight, so a batch that repeats itself is caught as the controller would
        catch it.
        """
        candidate = duplicate = None
        if spec is not None and spec_error is None and scratch is not None:
            try:
                candidate = self.repo.materialise(scratch, spec)
                duplicate = self.duplicate_of(name, candidate)
            finally:
                self.repo.cleanup(scratch, keep_branch=False)
        return reconcile(self.world(name, spec, {}, observe=False, spec_error=spec_error,
                                    candidate=candidate, duplicate_of=duplicate)).status

    def _pass(self, obs: Observed, deleting: bool, schedule: bool = True) -> Decision:
        p = self._begin(obs, deleting, schedule)
        decision: Decision | None = None
        for _ in range(MAX_STEPS):
            w = self.world(p.name, p.spec, p.st, slot=p.slot, spec_error=p.spec_error,
                           generation=obs.generation, deleting=deleting, candidate=p.candidate,
                           duplicate_of=p.duplicate, run=p.run, promotion=p.promotion,
                           near_duplicates=p.near)
            p.now = w.now
            decision = reconcile(w)
            self._take(p, decision)
            if not decision.intents:
                break
            p.waiting = False
            for intent in decision.intents:
                self._carry_out(intent, p)
            if p.waiting:
                break  # no slot yet: the status says so; a later pass asks again
        self._tell(p.name, p.untold)
        if p.st != p.written:
            self._store(p.name, p.st, p.written)
        assert decision is not None
        if decision.finalized:
            self.paths.checked_spec(obs.key).unlink(missing_ok=True)
            self.book.forget(p.name)
            self.statuses.finalized(p.name)
        return decision

    def _take(self, p: _Pass, decision: Decision) -> None:
        """Take a step's decision: its status (stored now, or with a later step's) and events.

        A status is stored before any effect outside the engine: a slot from the book (in
        memory) is none, so a status that only asks for one waits for the next step's and both
        are one write ("All slots are busy" is stored only when they are). Nor is an
        Experiment's first status (Pending) stored before its checks: their effect, its
        worktree, is found again by its name, so a controller that dies meanwhile checks it
        again; the checks' outcome and it are one write, where a batch of specs made them two
        (a request, and a watch event for the operator, per Experiment). Nor, where the
        backend schedules by itself (a cluster without gpuSlots: no slot of ours to hold), is
        the status that submits a run stored before the submit: every backend adopts a run of
        the name it is given and never starts one twice, so a controller that dies after the
        submit decides the same run again (its name and seed come from the status as stored)
        and adopts it. The submitted run and its first observation are one write. A run on one
        of our slots is stored first: the slot book is rebuilt from the statuses, and a slot
        whose run no status names would go to another run beside it.

        The events of a transition go before the status that records it: a controller that
        dies in between makes the same transition again and tells it again (a sink that names
        each transition's events, as the operator's does, tells it once). A transition never
        stored is not told: Pending before the checks ("Accepted"), whose outcome is the first
        thing told. Events wait with the status they belong to (`untold`), so where the status
        waits for a submit the cluster queues, the run's Job comes first, a few requests sooner.
        """
        intents = decision.intents
        if p.slot is not None and not any(isinstance(i, (Submit, Materialise)) for i in intents):
            self.book.release(p.name)
            p.slot = None
        only_a_slot = bool(intents) and p.schedule \
            and all(isinstance(i, AcquireSlot) for i in intents)
        first_before_checks = not p.written and len(intents) == 1 \
            and isinstance(intents[0], Materialise)
        submitting = len(intents) == 1 and isinstance(intents[0], Submit) \
            and intents[0].slot == UNLIMITED
        if not first_before_checks:
            p.untold += decision.events
        if decision.status != p.st:
            p.st = decision.status
            self.book.observe(p.name, p.st, p.priority, p.obs.created)
        if p.st != p.written and not only_a_slot and not first_before_checks and not submitting:
            self._tell(p.name, p.untold)
            p.written = self._store(p.name, p.st, p.written)

    # -- carrying out the intents: one method per kind --------------------------------------------
    @functools.singledispatchmethod
    def _carry_out(self, intent: object, p: _Pass) -> None:
        raise TypeError(f"the engine cannot carry out {intent!r}")

    @_carry_out.register
    def _materialise_intent(self, intent: Materialise, p: _Pass) -> None:
        assert p.spec is not None
        p.candidate, p.duplicate = self._materialise(p.name, p.spec)
        if not p.candidate.refusal and p.spec_doc is not None:
            self._keep_checked_spec(p.obs.key, p.spec_doc)
            if p.st.get("phase") == PENDING and not p.duplicate:
                p.near = tuple(near_duplicates(self.repo, self.ledger.rows(), p.spec.diff,
                                               p.name, self._changes))

    @_carry_out.register
    def _acquire_slot(self, intent: AcquireSlot, p: _Pass) -> None:
        p.slot = self.book.grant(p.name, intent.priority,
                                 p.obs.created or p.st.get("createdAt") or p.now,
                                 confirm=intent.confirm) if p.schedule else None
        p.waiting = p.slot is None

    @_carry_out.register
    def _claim_test_intent(self, intent: ClaimTest, p: _Pass) -> None:
        self._claim_into_status(p)

    @_carry_out.register
    def _submit(self, intent: Submit, p: _Pass) -> None:
        p.slot = None  # used once
        if intent.claim:
            self._claim_into_status(p)
        p.run = self.backend(intent.backend).submit(self._request(p.obs, p.spec, intent, p.st))
        self._tell(p.name, p.untold)

    def _claim_into_status(self, p: _Pass) -> None:
        k, level = self.campaign.claim(p.name, p.st.get("parentHash") or "")
        if p.st.get("tries") != k or p.st.get("level") != level:
            # another pass claimed the count meanwhile
            p.st = {**p.st, "tries": k, "level": level}
            p.written = self._store(p.name, p.st, p.written)

    @_carry_out.register
    def _set_place(self, intent: SetPlace, p: _Pass) -> None:
        with self.lock:
            self.master.set_place(intent.master, int(intent.place), intent.val_bpb)

    @_carry_out.register
    def _cleanup_run(self, intent: CleanupRun, p: _Pass) -> None:
        self.backend(intent.backend).cleanup(intent.run)

    @_carry_out.register
    def _cancel(self, intent: Cancel, p: _Pass) -> None:
        p.run = self.backend(intent.backend).cancel(intent.run)

    @_carry_out.register
    def _promote(self, intent: Promote, p: _Pass) -> None:
        st, name = p.st, p.name
        with self.lock:
            p.promotion = self.master.promote_candidate(Promotion(
                name=name, commit=st["commit"], source=self.repo.candidate_source(name),
                val_bpb=intent.val_bpb, hashes=(st["candidateHash"], st["semanticHash"]),
                parent=st.get("parentHash", ""), now=utcnow(), margin=intent.margin,
                against=intent.against, places=intent.places))
        if not p.promotion.promoted:
            return
        self.campaign.discovered(name)
        self._keep_evaluation(st["candidateHash"], (st.get("metrics") or {}).get(
            "evaluate_seconds"), st.get("run") or name)
        self.events.lab(Event("Normal", "Promoted",
                              f"{name} is the new master: val_bpb {intent.val_bpb:.6f} (was "
                              f"{p.promotion.master_val_bpb})."))
        self.events.lab_changed()

    @_carry_out.register
    def _record_intent(self, intent: Record, p: _Pass) -> None:
        self.record_row(dict(intent.row), p.spec_doc, p.st)

    @_carry_out.register
    def _cleanup(self, intent: Cleanup, p: _Pass) -> None:
        with self.lock:
            # Branches of experiments that ran stay: they are the experiment DAG.
            self.repo.cleanup(p.name, keep_branch=bool(p.st.get("job") or p.st.get("run")))
        if p.st.get("job"):
            self.backend(p.st["job"]["backend"]).cleanup(p.st["job"]["name"])

    def _store(self, name: str, status: dict, written: dict) -> dict:
        """Write `status` over `written` (the status as stored); tell the lab of a new phase."""
        self.statuses.write_status(name, status, written)
        if status.get("phase") != written.get("phase"):
            self.events.lab_changed()
        return status

    def _give_back(self, backend_name: str, evaluated: str) -> None:
        """The run `evaluated` ran out of time beside the run started up next to it: stop that
        one, so the harness measures its model again alone (an evaluation that is slow on a GPU
        of its own is the candidate's failure; one slowed by a neighbour is nobody's)."""
        self.backend(backend_name).give_back(evaluated)

    def _start_next(self, backend_name: str, slot: str, evaluated: str) -> None:
        """The run `evaluated` no longer needs its GPU alone: start the slot's next run up beside it.

        Only for a backend that can (`starts_ahead`: the local one). Who is next, and what would
        be submitted, are the slot book's and the core's answers as things stand: the core is
        asked what it would do with this slot (nothing is written, nothing else is carried
        out), and a run is started only where it would submit at once. The real submit comes
        when the slot is free, after the evaluated run's verdict; if by then the answer is
        another (the master moved and the candidate is rebased, someone else is first), the
        backend stops what it started, having spent no training time on it.
        """
        backend = self.backend(backend_name)
        nxt = self.book.next_in_line()
        if not backend.starts_ahead or nxt is None or self._started_next.get(slot) == (evaluated, nxt):
            return
        self._started_next[slot] = (evaluated, nxt)
        obs = self.statuses.read(nxt)
        spec, _, spec_error = self.spec_of(obs) if obs is not None else (None, None, None)
        if obs is None or spec is None or obs.deleting:
            return
        w = self.world(nxt, spec, obs.status, slot=slot, spec_error=spec_error,
                       generation=obs.generation)
        decision = reconcile(w)
        submit = next((i for i in decision.intents if isinstance(i, Submit)), None)
        if submit is None or any(isinstance(i, Materialise) for i in decision.intents) \
                or self.backend(submit.backend) is not backend:
            return
        backend.start_next(self._request(obs, spec, submit, decision.status))

    def _world_lab(self) -> LabSpec:
        if self.lab.backend != self.default_backend:
            return dataclasses.replace(self.lab, backend=self.default_backend)
        return self.lab

    def _leftovers(self, name: str, st: dict) -> bool:
        if self.repo.has_worktree(name):
            return True
        view = ExperimentStatus.parse(st)
        if not view.job or not view.terminal:
            return False
        return self.backend(view.job.backend).leftovers(view.job.name)

    def _request(self, obs: Observed, spec: ExperimentSpec | None, submit: Submit,
                 st: dict) -> RunRequest:
        assert spec is not None
        limit = None
        if submit.program == "master":  # a pair run of the master it was built on
            source = self.repo.source_of(self.repo.resolve_parent(st["parentHash"])["commit"])
        else:
            source = self.repo.candidate_source(obs.name)
            limit = self.eval_limit()
        return RunRequest(run=submit.run, experiment=obs.name, campaign=spec.campaign,
                          candidate_source=source,
                          slot=submit.slot, profile=self.lab.profile, data=self.lab.data,
                          budget_seconds=self.lab.budget_seconds, gpus=spec.gpus,
                          overrides=spec.hf, owner=obs.owner, seed=self._seed_of(submit),
                          eval_limit=limit)

    # -- how long a candidate's evaluation may take ----------------------------------------------
    def eval_limit(self) -> float | None:
        """Seconds a candidate's evaluation may take (controller.core.evaluation), from the
        current master's own evaluation; None where that is not known: the profile's limit."""
        try:
            doc = json.loads(self.paths.evaluation_file.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(doc, dict) or doc.get("master") != self.master.master().hash \
                or doc.get("profile") != self.lab.profile:
            return None
        if self.lab.profile not in self._profile_eval_limits:  # the pinned harness's: git, once
            try:
                allowed: float | None = lab_profile(self.paths.root, self.lab.profile,
                                                    self.lab.harness).eval_timeout
            except (ProfileError, OSError):
                allowed = None
            self._profile_eval_limits[self.lab.profile] = allowed
        return evaluation_limit(doc.get("evaluateSeconds"), self._profile_eval_limits[self.lab.profile])

    def _keep_evaluation(self, master_hash: str, seconds: object, run: str,
                         replace: bool = True) -> None:
        """Keep how long `master_hash`'s measured run took to be evaluated (the bound's base)."""
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds <= 0:
            return
        if not replace:
            try:
                if json.loads(self.paths.evaluation_file.read_text()).get("master") == master_hash:
                    return
            except (OSError, ValueError, AttributeError):
                pass
        atomic_write(self.paths.evaluation_file, json.dumps(
            {"master": master_hash, "evaluateSeconds": seconds, "run": run,
             "profile": self.lab.profile, "measuredAt": utcnow()}, indent=2) + "\n")

    def record_row(self, row: dict, spec: dict | None, status: dict | None) -> bool:
        """Append one ledger row (once per run id), then the after-record hooks."""
        row["created_at"] = utcnow()
        if not self.ledger.append(row):
            return False
        for hook in self.hooks:
            hook(self.paths, self.lab_name, self.lab.surface, row, spec, status)
        return True

    def tell_failure(self, name: str, error: Exception) -> str:
        """Put a failed pass on the experiment's status and events, once per message."""
        message = failure_message(name, error)
        try:
            obs = self.statuses.read(name)
        except Exception:
            return message
        if obs is None:
            return message
        new = with_failure(obs.status, message, utcnow())
        if new is not None:
            self.events.experiment(name, Event("Warning", RECONCILE_ERROR, message))
            self.statuses.write_status(name, new, obs.status)
        return message

    # -- the master's baseline -------------------------------------------------------------------------
    def baseline(self) -> BaselineState:
        """Measure a master nobody has measured (see the module docstring for the policy)."""
        m = self.master.master()
        if m.place(1) is not None:
            return BaselineState()
        attempt = 1 + sum(1 for r in self.ledger.rows()
                          if r.get("experiment_id") == "baseline"
                          and r.get("candidate_hash") == m.hash and r.get("status") == "error")
        name = baseline_run_name(self.lab_name, m, attempt)
        failures = self.baseline_failures.get(m.hash, 0)
        if failures >= BASELINE_ATTEMPTS:
            last = baseline_run_name(self.lab_name, m, attempt - 1)
            return BaselineState(last, "failed", f"the master's baseline failed {failures} times; "
                                 f"the last attempt was run {last}")
        backend = self.backend(self.default_backend)
        obs = backend.observe(name)
        slot = None
        if obs.state in ("queued", "running"):
            slot = self.book.hold(name, backend.slot_of(name))
        elif obs.state == "missing":
            slot = self.book.hold(name)
        intents = reconcile_baseline(m, obs, slot, self.ledger.has_run(name))
        state = BaselineState(name, "running" if obs.state in ("queued", "running") else "waiting")
        if obs.state == "missing" and not any(isinstance(i, Submit) for i in intents):
            self.book.release(name)
        for intent in intents:
            match intent:
                case Submit():  # told first: once submitted, nothing asks again
                    self.events.lab(Event("Normal", "BaselineSubmitted",
                                          f"The master {m.hash[:12]} has no val_bpb yet; run "
                                          f"{name} measures it first."))
                    backend.submit(self.master_request(m, name, intent.slot,
                                                          self.campaign.place_seed(1)))
                    state.state = "running"
                case Record():
                    self.record_row(dict(intent.row, backend=self.default_backend), None, None)
                case SetMasterMetric():
                    state = self._baseline_measured(m, intent, obs, backend)
                case ResubmitBaseline():
                    state = self._baseline_failed(m, intent, failures, backend)
        return state

    def _baseline_measured(self, m: Master, intent: SetMasterMetric, obs: RunObservation,
                           backend: Backend) -> BaselineState:
        name = intent.run
        self.events.lab(Event("Normal", "BaselineMeasured",
                              f"The master {m.hash[:12]} measures val_bpb "
                              f"{intent.val_bpb:.6f}; experiments may run."))
        with self.lock:
            self.master.set_master_metric(intent.val_bpb, {1: intent.val_bpb}, m.hash)
        self._keep_evaluation(m.hash, _evaluate_seconds(obs.result), name)
        backend.cleanup(name)
        self.book.release(name)
        self.events.lab_changed()
        return BaselineState(name, "measured")

    def _baseline_failed(self, m: Master, intent: ResubmitBaseline, failures: int,
                         backend: Backend) -> BaselineState:
        name = intent.run
        self.baseline_failures[m.hash] = failures + 1
        left = BASELINE_ATTEMPTS - failures - 1
        backend.cleanup(name)
        self.book.release(name)
        why = intent.reason or "no reason given"
        state = BaselineState(name, "failed" if left <= 0 else "waiting",
                              f"the baseline run {name} failed: {why}")
        self.events.lab(Event(
            "Warning", "BaselineFailed", f"The baseline run {name} failed: {why}; " + (
                f"trying again ({left} attempts left)." if left > 0 else
                "no attempts left: fix the cause (see the ledger and the run's log), "
                "then start the controller again.")))
        self.events.lab_changed()
        return state

    def master_request(self, m: Master, name: str, slot: str | None,
                          seed: int = 0) -> RunRequest:
        return RunRequest(run=name, experiment="baseline", campaign="",
                          candidate_source=self.master.master_source(), slot=slot,
                          profile=self.lab.profile, data=self.lab.data,
                          budget_seconds=self.lab.budget_seconds, gpus=BASELINE_GPUS,
                          owner=self.lab_owner, seed=seed)

    # -- tests and the lab's noise --------------------------------------------------------------
    def _seed_of(self, submit: Submit) -> int:
        """The harness seed of a submit: its place's (none where a status of an older
        controller names no place)."""
        return self.campaign.place_seed(int(submit.place)) if submit.place else 0

    def _test_of(self, name: str, st: dict, slot: str | None) -> dict:
        """What the World says of an experiment's test: its number against its master, its
        level (kept on the status once it began) and the pairs it may carry (looked up in the
        ledger only once it holds a slot: when its decision is about to begin)."""
        level = st.get("level")
        if level is None:
            level = self.campaign.level(name)
        carried = None
        if slot is not None and not st.get("pairs") and not st.get("job") \
                and st.get("candidateHash") and st.get("phase") in ("Queued", "Confirming"):
            master = self.master.master()
            if st.get("parentHash") == master.hash:
                carried = carried_values(self.ledger.rows(), st["candidateHash"], master.hash,
                                         name)
        return {"tries": self._tries(name, st), "level": level, "carried": carried}

    def _tries(self, name: str, st: dict) -> int:
        """Which test against its master an experiment's decision is (its level): as kept on
        its status once it began, else as the campaign counts it."""
        if st.get("tries"):
            return int(st["tries"])
        return self.campaign.number(name, st.get("parentHash") or self.master.master().hash)


def _evaluate_seconds(result: dict | None) -> object:
    """How long the harness took to score a run's model (its result's timing), if it says."""
    return ((result or {}).get("timing") or {}).get("evaluate_seconds")
