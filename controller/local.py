"""The local front end: a lab directory on one machine, walked by a loop.

People and agents write one Experiment spec per YAML file in `experiments/`.
Each pass reads them and hands every experiment to the engine
(`controller.engine`), which makes every decision; this module only adapts
the engine to one machine: statuses live beside the specs in
`.autolab/status/<name>.json` (the spec file's digest, its generation and
the status), replaced atomically; the master is `research/live/master.json`
and the lab repo's `autolab/master` branch (the lab repo is the engine's master
of record itself: no adapter here); events go to
`.autolab/events/<name>.jsonl`. The user's files are never written.

Removing a spec file (or `autolab delete NAME`) is the local `kubectl
delete`: a run in flight is cancelled, the cancellation is recorded, and the
status goes once the ledger has the row.

Each experiment is reconciled under its own file lock, so `autolab delete`
can act while `autolab run` is looping, and two loops never double-submit.

An experiment's place in the queue comes from when it was created
(`core/slots.py`): its record's `metadata.creationTimestamp`, to the
microsecond, stamped once when the record is made: by `autolab apply`
(`LocalLab.apply_file`; one apply's specs get increasing stamps, in the order
given), or, for a spec file written by hand, the file's modification time when
the loop first reads it. A record made before there were such stamps has the
status's `createdAt` (when the loop first saw it) instead.

A LocalLab holds processes of its own (the runs it started ahead of their
turn, its repo's git plumbing): code that uses it as a library ends it with
`close()` or `with LocalLab(root) as lab:`. Submitted runs are not its: they
go on, and the next loop adopts them.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from filelock import FileLock

from controller.backends import BackendConfigError
from controller.backends.local import LocalBackend, visible_slots
from controller.core.failures import RECONCILE_ERROR, failure_message
from controller.core.intents import Decision, Event
from controller.core.reconcile import ACTIVE, BASELINE_ATTEMPTS, TERMINAL, Candidate
from controller.core.slots import SlotBook, instant
from controller.core.spec import (LabSpec, SpecError, SpecUnreadable, next_name, trackable,
                                   validate_document)
from controller.core.status import CONFIRMING, RUNNING, ExperimentStatus
from controller.engine import BaselineFailed, Engine, Observed
from controller.lab.clock import precise, utcnow
from controller.lab.files import atomic_write
from controller.lab.init import make_lab
from controller.lab.paths import LAB_FILE, LabPaths

SPEC_SUFFIXES = (".yaml", ".yml")
LOCAL_BACKENDS = ("local", "hf")  # what the local loop can run
LAB_EVENTS = "_lab.jsonl"  # the lab's own events (a name no experiment can have)


def spec_digest(spec: dict) -> str:
    return hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def created_of(record: dict) -> str:
    """When the experiment of `record` was created: its place in the queue."""
    meta = record.get("metadata") if isinstance(record.get("metadata"), dict) else {}
    status = record.get("status") if isinstance(record.get("status"), dict) else {}
    return str(meta.get("creationTimestamp") or status.get("createdAt") or "")


def queue_places(records: dict[str, dict]) -> dict[str, int]:
    """Each waiting experiment's place in the lab's queue (1: the next slot is its), from the
    records as written, by the slot book's own rule (`SlotBook.queue`). What only the loop's
    memory holds is not in a record: the runs its decision in progress had since a first run
    are counted from 0, as a loop started now would."""
    book = SlotBook(None)
    for n, r in records.items():
        spec = r.get("spec") if isinstance(r.get("spec"), dict) else {}
        priority = spec.get("priority", 0)
        try:
            book.observe(n, r.get("status") or {}, priority if isinstance(priority, int) else 0,
                         created_of(r))
        except ValueError:  # a status that is not one waits for nothing
            continue
    return {n: i for i, n in enumerate(book.queue(), 1)}


def file_created(path: Path) -> str:
    """A spec file written by hand was created when it was last written."""
    try:
        return precise(path.stat().st_mtime_ns / 1e9)
    except OSError:
        return precise(time.time())


def load_yaml_file(path: Path) -> list:
    """All YAML documents of a file; a parse error names the file and line."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise SpecUnreadable(f"{path}: cannot read: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise SpecError(f"{path}: byte {e.start} is not UTF-8; save the file as UTF-8") from None
    try:
        return [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise SpecError(f"{path}:{where}: malformed YAML: {problem}") from None
    except (RecursionError, ValueError) as e:  # nesting or integers beyond Python's limits
        raise SpecError(f"{path}: cannot be read as YAML ({type(e).__name__}: nested too deep or a "
                        "number too long); simplify the file") from None


@dataclass
class SpecFile:
    name: str
    path: Path
    doc: dict | None = None
    error: str | None = None


@dataclass
class LoadedSpecs:
    specs: dict[str, SpecFile] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)  # files that name no experiment at all


class LocalStatuses:
    """StatusStore: the spec files of `experiments/` and the records under `.autolab/status`.

    A pass reads its record once (`read`, under the experiment's file lock) and writes its
    statuses over the record it read: the store keeps that record until the experiment is
    read again or let go, so a status write reads no file.
    """

    def __init__(self, lab: "LocalLab"):
        self.lab = lab
        self._records: dict[str, dict] = {}  # name -> its record as last read or written

    def read(self, name: str, created: str | None = None,
             specs: LoadedSpecs | None = None) -> Observed | None:
        """The experiment as stored; a spec file seen for the first time gets its record now,
        created at `created` (default: the file's modification time). `specs`: the spec files
        as the pass under way loaded them (default: load them now)."""
        lab = self.lab
        record = lab.read_record(name)
        sf = (specs if specs is not None else lab.load_specs()).specs.get(name)
        if sf is not None and not sf.path.exists():
            sf = None  # deleted since the pass began (`autolab delete` beside the loop)
        if sf is not None and sf.doc is not None and trackable(sf.doc):
            digest = spec_digest(sf.doc.get("spec") or {})
            if not record:
                record = {"metadata": {"name": name,
                                       "creationTimestamp": created or file_created(sf.path)},
                          "generation": 1, "file": str(sf.path), "status": {}}
            if record.get("specDigest") != digest:
                if record.get("specDigest") is not None:
                    record["generation"] = record.get("generation", 1) + 1
                record["specDigest"] = digest
                record["spec"] = sf.doc.get("spec")
                lab.write_record(name, record)
        else:
            sf = None
        if not record:
            self._records.pop(name, None)
            return None  # finalized meanwhile (e.g. by `autolab delete` while the loop ran)
        self._records[name] = record
        spec = record.get("spec")
        error = sf.error if sf is not None else None
        status = record.get("status") or {}
        backend = ((spec or {}).get("backend") if isinstance(spec, dict) else None) \
            or lab.lab.backend
        if not error and backend not in LOCAL_BACKENDS and not status.get("job"):
            error = (f"{record.get('file', name)}: spec.backend: {backend} is not available on "
                     f"one machine; use one of {', '.join(LOCAL_BACKENDS)} (kubernetes runs "
                     "through the operator: kubectl apply)")
        return Observed(name=name, key=name, spec=spec if isinstance(spec, dict) else None,
                        status=status, generation=int(record.get("generation", 1)),
                        deleting=sf is None, spec_error=error, created=created_of(record))

    def write_status(self, name: str, status: dict, previous: dict | None = None) -> None:
        record = self._records.get(name)
        if record is None:
            record = self.lab.read_record(name)
        if record.get("status") != status:
            record = {**record, "status": status}
            self.lab.write_record(name, record)
        self._records[name] = record

    def finalized(self, name: str) -> None:
        self._records.pop(name, None)
        self.lab.paths.status_file(name).unlink(missing_ok=True)


class LocalEvents:
    """EventSink: one JSONL file per experiment, and one for the lab."""

    def __init__(self, lab: "LocalLab"):
        self.local = lab

    def _append(self, path: Path, events: list[Event]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            for e in events:
                f.write(json.dumps({"time": utcnow(), "type": e.type, "reason": e.reason,
                                    "message": e.message}) + "\n")

    def experiment(self, name: str, event: Event) -> None:
        self._append(self.local.paths.events_file(name), [event])

    def lab(self, event: Event) -> None:
        self._append(self.local.paths.state / "events" / LAB_EVENTS, [event])

    def lab_changed(self) -> None:
        pass  # `autolab get` and `autolab master` read the files as they are


class LocalLab:
    """A lab directory: its spec files, its engine, and the loop's passes over them."""

    def __init__(self, root: str | Path):
        self.paths = LabPaths.of(root)
        self.root = self.paths.root
        lab_file = self.paths.lab_file
        if not lab_file.exists():
            raise SpecError(f"{self.root}: not a lab (no {LAB_FILE} here or in any parent "
                            "directory); create one with `autolab init DIR`, or cd into a lab "
                            "(or pass --lab DIR)")
        docs = load_yaml_file(lab_file)
        if len(docs) != 1:
            raise SpecError(f"{lab_file}: expected one Lab document, found {len(docs)}")
        doc = validate_document(docs[0], source=str(lab_file), kind="Lab")
        self.name = doc["metadata"]["name"]
        self.lab = LabSpec.from_dict(doc.get("spec") or {})
        self.state = self.paths.state
        self.statuses = LocalStatuses(self)
        self.engine = Engine(paths=self.paths, lab_name=self.name, lab=self.lab,
                             statuses=self.statuses, events=LocalEvents(self),
                             backends={"local": LocalBackend(self.root)},
                             make_backend=self._make_backend, visible_slots=visible_slots)
        self.repo = self.engine.repo
        self.ledger = self.engine.ledger
        self.backends = self.engine.backends
        self._last_created = 0  # microseconds: the last creation time this process stamped

    def _make_backend(self, name: str):
        if name == "hf":
            from controller.backends.hf import HfBackend  # only labs that use it pay the import
            return HfBackend.from_lab(self.lab, self.root, lab_name=self.name)
        raise SpecError(f"backend {name!r} is not available to the local loop; use local or "
                        "hf here, kubernetes through the operator")

    def backend_for(self, name: str):
        return self.engine.backend(name)

    def duplicate_of(self, name: str, c: Candidate) -> str | None:
        return self.engine.duplicate_of(name, c)

    # -- files ---------------------------------------------------------------------------------
    @property
    def experiments_dir(self) -> Path:
        return self.paths.experiments

    def read_record(self, name: str) -> dict:
        p = self.paths.status_file(name)
        if not p.exists():
            return {}
        try:
            return json.loads(p.read_text())
        except ValueError as e:
            raise SpecUnreadable(f"{p} is not valid JSON ({e}); restore it, or remove it to "
                                 "start the experiment over") from None

    def write_record(self, name: str, record: dict) -> None:
        atomic_write(self.paths.status_file(name),
                     json.dumps(record, indent=2, sort_keys=True) + "\n")

    def names(self) -> list[str]:
        d = self.state / "status"
        return sorted(p.stem for p in d.glob("*.json")) if d.exists() else []

    def load_specs(self) -> LoadedSpecs:
        out = LoadedSpecs()
        if not self.experiments_dir.exists():
            return out
        for path in sorted(self.experiments_dir.iterdir()):
            if path.suffix not in SPEC_SUFFIXES or path.name.startswith("."):
                continue
            if not path.name.isprintable():  # its name would reach terminals and statuses
                out.errors.append(f"{ascii(str(path))}: a spec file's name must be printable "
                                  "(no control or escape characters); rename it")
                continue
            try:
                docs = load_yaml_file(path)
            except SpecError as e:
                out.errors.append(str(e))
                continue
            if len(docs) != 1:
                out.errors.append(f"{path}: expected exactly one Experiment per file, found "
                                  f"{len(docs)}")
                continue
            doc = docs[0]
            meta = doc.get("metadata") if isinstance(doc, dict) else None
            name = meta.get("name") if isinstance(meta, dict) else None
            if not isinstance(name, str) or not name:
                out.errors.append(f"{path}: metadata.name: required field is missing (the "
                                  "experiment's name, a lowercase DNS label)")
                continue
            sf = SpecFile(name=name, path=path, doc=doc)
            try:
                validate_document(doc, source=str(path), kind="Experiment")
            except SpecError as e:
                sf.error = str(e)
            if name in out.specs:
                out.errors.append(f"{path}: metadata.name {name!r} is already used by "
                                  f"{out.specs[name].path}; names must be unique")
                continue
            out.specs[name] = sf
        return out

    def events(self, name: str) -> list[dict]:
        p = self.paths.events_file(name)
        if not p.exists():
            return []
        return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]

    # -- reconciling one experiment ------------------------------------------------------------
    def _lock(self, name: str) -> FileLock:
        return FileLock(str(self.paths.lock(f"exp-{name}")))

    def reconcile_one(self, name: str, deleting: bool = False, schedule: bool = True,
                      specs: LoadedSpecs | None = None) -> Decision | None:
        """One engine pass over `name`, under its file lock (`autolab delete` may run beside):
        its record read once, and handed to the engine. None if it is gone."""
        with self._lock(name):
            obs = self.statuses.read(name, specs=specs)
            if obs is None:
                return None
            return self.engine.reconcile(obs, deleting=deleting, schedule=schedule)

    def _planning_record(self, name: str) -> dict:
        """A record to plan a pass with; one that cannot be read, or is mis-shaped, reads as {}.

        The experiment's own pass meets the problem and tells it on that experiment.
        """
        try:
            r = self.read_record(name)
            ExperimentStatus.parse(r.get("status"))
        except (OSError, ValueError, AttributeError):  # StatusError is a ValueError
            return {}
        spec = r.get("spec") or {}
        ok = isinstance(spec, dict) and isinstance(spec.get("priority", 0), int)
        # A spec refused by its schema (priority: high) still has its status (Invalid): keep
        # it, or the pass summary never sees it settle and `autolab run` never ends.
        return r if ok else {**r, "spec": {}}

    def _reconcile_isolated(self, name: str, specs: LoadedSpecs, deleting: bool = False,
                            schedule: bool = True) -> str | None:
        """`reconcile_one`, with a failure kept to that experiment; returns its message, if any.

        One experiment's bad state must not stop the pass for all the others. The failure goes
        into its events and its status (once per distinct message; see core/failures.py) and
        the next pass tries again.
        """
        try:
            self.reconcile_one(name, deleting=deleting, schedule=schedule, specs=specs)
        except BackendConfigError:
            raise  # the lab's, not this experiment's: stop and say what to set
        except Exception as e:  # isolation is the point: whatever it is, it is this one's
            try:
                self.read_record(name)
            except (OSError, ValueError) as unreadable:
                message = failure_message(name, SpecError(
                    f"its status file {self.paths.status_file(name)} cannot be read "
                    f"({unreadable}); restore it, or remove it to start the experiment over"))
                if not self._told_already(name, message):
                    self.engine.events.experiment(name, Event("Warning", RECONCILE_ERROR,
                                                              message))
                return message
            with self._lock(name):
                return self.engine.tell_failure(name, e)
        return None

    def _told_already(self, name: str, message: str) -> bool:
        try:
            last = (self.events(name) or [{}])[-1]
        except (OSError, ValueError):
            return False
        return last.get("reason") == RECONCILE_ERROR and last.get("message") == message

    # -- one pass over the lab -----------------------------------------------------------------
    def step(self, deleting: set[str] = frozenset()) -> "PassSummary":
        loaded = self.load_specs()
        for n in [n for n, sf in loaded.specs.items() if not trackable(sf.doc)]:
            # Its name keys files and a JSON copy of it is kept: it names no experiment.
            sf = loaded.specs.pop(n)
            loaded.errors.append(sf.error or f"{sf.path}: metadata.name: expected a lowercase "
                                              "DNS label (a-z, 0-9, '-')")
        for n in deleting:
            loaded.specs.pop(n, None)
        return self._step(loaded)

    def _observe_all(self) -> dict[str, dict]:
        records = {n: self._planning_record(n) for n in self.names()}
        self.engine.observe_all([(n, r.get("status") or {},
                                  int((r.get("spec") or {}).get("priority", 0)), created_of(r))
                                 for n, r in records.items()])
        return records

    def _observe_new(self, names: list[str], specs: LoadedSpecs) -> list[Observed]:
        """The new experiments as their passes will read them (each under its lock)."""
        out = []
        for n in names:
            try:
                with self._lock(n):
                    obs = self.statuses.read(n, specs=specs)
            except Exception:  # its own pass meets the problem and tells it
                continue
            if obs is not None:
                out.append(obs)
        return out

    def _step(self, loaded: LoadedSpecs) -> "PassSummary":
        failures: list[str | None] = []
        records = self._observe_all()
        known = set(records)
        gone = {n for n in known if n not in loaded.specs}
        order = sorted(loaded.specs, key=lambda n: (  # creation order, as the queue's
            instant(created_of(records.get(n, {})) or file_created(loaded.specs[n].path)), n))
        # 1. deletions and pre-run checks, oldest first; a failure stays with its experiment.
        #    No slots yet: the new specs' priorities are weighed together in step 2.
        for n in sorted(gone):
            failures.append(self._reconcile_isolated(n, loaded, deleting=True))
        new = [n for n in order
               if (records.get(n, {}).get("status") or {}).get("phase") in (None, "Pending")]
        self.engine.precheck(self._observe_new(new, loaded))  # checked on every core, taken in order
        try:
            for n in new:
                failures.append(self._reconcile_isolated(n, loaded, schedule=False))
        finally:
            self.engine.drop_prechecks()
        # 2. the master's baseline, then everything in flight or left to settle
        records = self._observe_all()
        base = self.engine.baseline()
        if base.state == "failed":
            backend = self.engine.backend(self.engine.default_backend)
            raise BaselineFailed(f"{base.message}; see {backend.log_path(base.run)}, fix the "
                                 "cause and run again (each start tries "
                                 f"{BASELINE_ATTEMPTS} times)")
        # Runs in flight first: a run that finished frees its slot for a queued one in this pass.
        in_flight = {n for n, r in records.items()
                     if (r.get("status") or {}).get("phase") in (RUNNING, CONFIRMING)}
        for n in sorted(records, key=lambda n: n not in in_flight):
            phase = (records[n].get("status") or {}).get("phase")
            if phase in ACTIVE or (phase in TERMINAL and n in loaded.specs):
                failures.append(self._reconcile_isolated(n, loaded))
        return self.summary(loaded.errors + [f for f in failures if f])

    def summary(self, errors: list[str] | None = None) -> "PassSummary":
        rows = []
        for n in self.names():
            r = self._planning_record(n)
            rows.append((n, r.get("status") or {}, r.get("spec") or {}))
        return PassSummary(rows=rows, errors=errors or [],
                           baseline_pending=self.repo.master().val_bpb is None,
                           slots=self.engine.slot_ids() or [])

    def apply_file(self, doc: dict, source: str) -> str:
        """Write a validated spec into experiments/; returns created, unchanged or configured
        (only metadata changed). A spec is immutable once applied, like the cluster's CRD rule
        `self == oldSelf`: a changed one, or a name already recorded, raises SpecError and
        nothing is written. A new spec is recorded at once (phase Pending), so `autolab get`
        shows it before `autolab run` has looked."""
        validate_document(doc, source=source, kind="Experiment")
        name = doc["metadata"]["name"]
        target = self.experiments_dir / f"{name}.yaml"
        loaded = self.load_specs()
        if name in loaded.specs:
            target = loaded.specs[name].path
        record = self.read_record(name)
        old = None
        if target.exists():
            docs = load_yaml_file(target)
            old = docs[0] if docs else None
        elif record:
            raise SpecError(
                f"experiment {name!r} is being deleted (phase "
                f"{(record.get('status') or {}).get('phase', 'Pending')}); names are permanent "
                f"once recorded: apply it under a new name")
        if old is not None:
            if not isinstance(old, dict) or old.get("spec") != doc.get("spec"):
                phase = (record.get("status") or {}).get("phase", "Pending")
                raise SpecError(
                    f"{source}: experiment {name!r} already exists (phase {phase}) with a "
                    f"different spec; a spec cannot change once applied (the controller runs "
                    f"the spec it checked): create a new Experiment with a new name, e.g. "
                    f"{next_name(name)}, and `autolab delete {name}` if it should not finish")
            if old == doc:
                return "unchanged"
            atomic_write(target, _spec_yaml(doc))
            return "configured"
        refused = self.engine.name_refusal(name)
        if refused:
            raise SpecError(f"{source}: {refused}")
        atomic_write(target, _spec_yaml(doc))
        with self._lock(name):  # recorded now: Pending until the loop checks it
            self.statuses.read(name, created=self._creation_stamp())
        return "created"

    def _creation_stamp(self) -> str:
        """Now, to the microsecond, and after every stamp this process gave before: the specs
        of one `autolab apply` are queued in the order they were given in."""
        self._last_created = max(time.time_ns() // 1000, self._last_created + 1)
        return precise(self._last_created / 1e6)

    def stop_runs_started_ahead(self) -> None:
        """A run started up ahead of its turn (LocalBackend.start_next) waits at its first batch
        for a submit only a running loop makes: when the loop ends, it is stopped."""
        for backend in list(self.engine.backends.values()):
            backend.stop_next()

    def reap_stale(self) -> list[str]:
        """Stop what a controller that is gone started ahead of its turn (LocalBackend.reap_stale);
        one line per run, for a person. `autolab run` calls it first."""
        reaped = []
        for backend in list(self.engine.backends.values()):
            reaped += backend.reap_stale()
        return reaped

    def close(self) -> None:
        """End cleanly, as a library user must (or `with LocalLab(root) as lab:`): the runs started
        ahead stop; submitted runs go on, and the next loop adopts them."""
        for backend in list(self.engine.backends.values()):
            backend.close()
        self.repo.close()  # its long-lived git processes (a later call starts them again)

    def __enter__(self) -> "LocalLab":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def runs_in_flight(self) -> list[tuple[str, str | None]]:
        """(run, experiment) of every local run whose process is still going. Runs live in their
        own session, so they outlive the loop that started them; the next loop adopts them."""
        runs = self.paths.state / "runs"
        backend = self.backends["local"]
        out = []
        for d in sorted(runs.iterdir()) if runs.is_dir() else []:
            if d.name.startswith(".") or not (d / "launch.json").exists() or (d / "result.json").exists():
                continue  # (.next-<slot>: started up ahead, stopped with the loop)
            if backend.observe(d.name).state == "running":
                try:
                    experiment = json.loads((d / "launch.json").read_text()).get("experiment")
                except (OSError, ValueError):
                    experiment = None
                out.append((d.name, experiment))
        return out

    def run_progress(self, run: str) -> dict | None:
        """How far a local run is: seconds since it started and, from the last step line the
        training script printed (`step 00120 | ... | time 35.2/300s`), its step and training
        seconds of its budget. For a person to watch only: the candidate writes that line, so
        nothing is decided by it."""
        d = self.paths.run_dir(run)
        try:
            launch = json.loads((d / "launch.json").read_text())
            started = float(launch.get("startedAt"))
        except (OSError, ValueError, TypeError):
            return None
        out: dict = {"elapsed": max(0.0, time.time() - started)}
        try:
            with open(d / "log.txt", "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 8192))
                tail = f.read()
        except OSError:
            return out
        hits = _STEP_LINE.findall(tail)
        if hits:
            step, trained, budget = hits[-1]
            trained_s, budget_s = float(trained), float(budget)
            if math.isfinite(trained_s) and math.isfinite(budget_s):
                out.update(step=int(step), training=trained_s, budget=budget_s)
        return out

    def delete(self, name: str) -> Decision | None:
        loaded = self.load_specs()
        sf = loaded.specs.get(name)
        if sf is None and name not in self.names():
            raise SpecError(f"experiment {name!r} not found")
        if sf is not None:
            trash = self.state / "deleted"
            trash.mkdir(parents=True, exist_ok=True)
            os.replace(sf.path, trash / sf.path.name)
        if name in self.names():
            return self.reconcile_one(name, deleting=True)
        return None


def init_lab(target: Path, profile: str = "default", data: str = "hub", name: str = "default",
             budget: int | None = None, min_delta: float | str | None = None,
             max_pairs: int | None = None) -> LocalLab:
    """Make a lab in `target` (`controller.lab.init.make_lab`, as `autolab init` does) and open
    it. For code that uses the lab as a library (benchmarks, tests): end it with `close()`."""
    return LocalLab(make_lab(target, profile=profile, data=data, name=name, budget=budget,
                             min_delta=min_delta, max_pairs=max_pairs))


_STEP_LINE = re.compile(rb"^step (\d{1,9}) \|[^\n]*\| time (\d{1,7}(?:\.\d+)?)/(\d{1,7}(?:\.\d+)?)s",
                        re.M)


def _spec_yaml(doc: dict) -> str:
    return yaml.safe_dump(doc, sort_keys=False, width=100, allow_unicode=True)


@dataclass
class PassSummary:
    rows: list[tuple[str, dict, dict]]
    errors: list[str]
    baseline_pending: bool
    slots: list[str]

    @property
    def done(self) -> bool:
        return not self.baseline_pending and all(
            st.get("phase") in TERMINAL for _, st, _ in self.rows)

