"""The local front end: a lab directory on one machine, reconciled by a loop.

People and agents write one Experiment spec per YAML file in `experiments/`.
The loop reads them, and for each one observes the world (its status, the
master, its run), calls the pure `reconcile()` and carries out the intents it
returns, until nothing is left to do. The user's files are never written:
what the controller knows about an experiment lives beside them in
`.autolab/status/<name>.json` (a snapshot of the spec it checked, its
generation and its status), replaced atomically.

Removing a spec file (or `autolab delete NAME`) is the local `kubectl
delete`: a run in flight is cancelled, the cancellation is recorded, and the
status goes once the ledger has the row.

Each experiment is reconciled under its own file lock, so `autolab delete`
can act while `autolab run` is looping, and two loops never double-submit.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import yaml
from filelock import FileLock

from controller.backends import BackendConfigError, RunRequest
from controller.backends.local import LocalBackend, visible_slots
from controller.core.reconcile import (ACTIVE, TERMINAL, Candidate, Decision, Event,
                                       RunObservation, World, allocate_slots,
                                       baseline_run_name, reconcile, reconcile_baseline,
                                       run_name)
from controller.core.failures import (RECONCILE_ERROR, failing, failure_message, with_failure,
                                      with_recovery)
from controller.core.spec import ExperimentSpec, LabSpec, SpecError, trackable, validate_document
from controller.lab.repo import LabRepo, atomic_write, recorded_duplicate
from controller.lab.ledger import Ledger
from controller.lab.paths import LAB_FILE
from controller.lab.memory import memory_hook
from controller.lab.tracking import tracking_hook

SPEC_SUFFIXES = (".yaml", ".yml")
LOCAL_BACKENDS = ("local", "hf")  # what the local loop can run


def utcnow() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def spec_digest(spec: dict) -> str:
    return hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def load_yaml_file(path: Path) -> list:
    """All YAML documents of a file; a parse error names the file and line."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise SpecError(f"{path}: cannot read: {e.strerror}") from None
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


class LocalLab:
    def __init__(self, root: str | Path):
        self.root = Path(root).resolve()
        lab_file = self.root / LAB_FILE
        if not lab_file.exists():
            raise SpecError(f"{self.root}: not a lab (no {LAB_FILE}); create one with "
                            "`autolab init DIR` or pass --lab DIR")
        docs = load_yaml_file(lab_file)
        if len(docs) != 1:
            raise SpecError(f"{lab_file}: expected one Lab document, found {len(docs)}")
        doc = validate_document(docs[0], source=str(lab_file), kind="Lab")
        self.name = doc["metadata"]["name"]
        self.lab = LabSpec.from_dict(doc.get("spec") or {})
        self.state = self.root / ".autolab"
        self.repo = LabRepo(self.root, self.lab)
        self.ledger = Ledger(self.root / "research" / "results.tsv")
        self.backends: dict = {"local": LocalBackend(self.root)}
        # Called after a ledger row is written: the research notes, then Trackio.
        self.hooks: list[Callable[["LocalLab", str, dict, dict], None]] = [memory_hook,
                                                                          tracking_hook]
        self._inflight: dict[str, str] = {}

    # -- files ---------------------------------------------------------------------------------
    @property
    def experiments_dir(self) -> Path:
        return self.root / "experiments"

    def _record_path(self, name: str) -> Path:
        return self.state / "status" / f"{name}.json"

    def read_record(self, name: str) -> dict:
        p = self._record_path(name)
        return json.loads(p.read_text()) if p.exists() else {}

    def write_record(self, name: str, record: dict) -> None:
        atomic_write(self._record_path(name), json.dumps(record, indent=2, sort_keys=True) + "\n")

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

    # -- observing -----------------------------------------------------------------------------
    def backend_for(self, name: str):
        if name not in self.backends and name == "hf":
            from controller.backends.hf import HfBackend  # only labs that use it pay the import
            self.backends["hf"] = HfBackend.from_lab(self.lab, self.root)
        if name not in self.backends:
            raise SpecError(f"backend {name!r} is not available to the local loop; use local or "
                            "hf here, kubernetes through the operator")
        return self.backends[name]

    def duplicate_of(self, name: str, c: Candidate) -> str | None:
        hit = recorded_duplicate(self.repo, self.ledger, name, c)
        if hit or c.refusal:
            return hit
        for h in (c.candidate_hash, c.semantic_hash):
            other = self._inflight.get(h or "")
            if other and other != name:
                return other
        return None

    def _index_inflight(self, name: str, st: dict) -> None:
        if st.get("phase") in ACTIVE:
            for h in (st.get("candidateHash"), st.get("semanticHash")):
                if h:
                    self._inflight.setdefault(h, name)

    # -- reconciling one experiment ------------------------------------------------------------
    def reconcile_one(self, name: str, sf: SpecFile | None, slot: str | None = None,
                      deleting: bool = False) -> Decision | None:
        lock = FileLock(str(self.state / "locks" / f"exp-{name}.lock"))
        (self.state / "locks").mkdir(parents=True, exist_ok=True)
        with lock:
            return self._reconcile_locked(name, sf, slot, deleting)

    def _reconcile_locked(self, name: str, sf: SpecFile | None, slot: str | None,
                          deleting: bool) -> Decision | None:
        record = self.read_record(name)
        if sf is not None and sf.doc is not None:
            digest = spec_digest(sf.doc.get("spec") or {})
            if not record:
                record = {"metadata": {"name": name}, "spec": sf.doc.get("spec"),
                          "generation": 1, "specDigest": digest, "file": str(sf.path),
                          "status": {}}
            elif record.get("specDigest") != digest:
                record["generation"] = record.get("generation", 1) + 1
                record["specDigest"] = digest
                if record.get("status", {}).get("phase") in (None, "Pending"):
                    record["spec"] = sf.doc.get("spec")
        if not record:
            return None  # finalized meanwhile (e.g. by `autolab delete` while the loop ran)
        spec_error = sf.error if sf is not None else None
        spec = None
        if not spec_error:
            try:
                spec = ExperimentSpec.from_dict(record["spec"])
            except (KeyError, TypeError, AttributeError) as e:
                spec_error = f"{record.get('file', name)}: spec: {e}"
        if spec is not None and (spec.backend or self.lab.backend) not in LOCAL_BACKENDS \
                and not (record.get("status") or {}).get("job"):
            spec_error = (f"{record.get('file', name)}: spec.backend: "
                          f"{spec.backend or self.lab.backend} is not available on one machine; "
                          f"use one of {', '.join(LOCAL_BACKENDS)} (kubernetes runs through the "
                          "operator: kubectl apply)")
            spec = None
        st = record.get("status") or {}
        candidate = duplicate = promotion = None
        run: RunObservation | None = None
        if st.get("job"):
            run = self.backend_for(st["job"]["backend"]).observe(st["job"]["name"])
        decision = None
        for _ in range(10):
            w = World(name=name, spec=spec, lab=self.lab, master=self.repo.master(), now=utcnow(),
                      status=st, spec_error=spec_error, generation=record.get("generation", 1),
                      deleting=deleting, candidate=candidate, duplicate_of=duplicate,
                      slot=slot, run=run, promotion=promotion,
                      recorded=self.ledger.has_run((st.get("job") or {}).get("name")
                                                   or run_name(name)),
                      worktree=self.repo.has_worktree(name))
            decision = reconcile(w)
            if decision.status != st or record.get("status") != decision.status:
                record["status"] = decision.status
                self.write_record(name, record)
            st = decision.status
            self._log_events(name, decision.events)
            if not decision.intents:
                break
            for intent in decision.intents:
                a = intent.args
                if intent.kind == "materialise":
                    candidate = self.repo.materialise(name, spec)
                    duplicate = self.duplicate_of(name, candidate)
                elif intent.kind == "submit":
                    slot = None  # used once
                    run = self.backend_for(a["backend"]).submit(self._request(name, spec, a))
                elif intent.kind == "cancel":
                    run = self.backend_for(a["backend"]).cancel(a["run"])
                elif intent.kind == "promote":
                    promotion = self.repo.promote(
                        name, st["commit"], a["val_bpb"], (st["candidateHash"], st["semanticHash"]),
                        st.get("parentHash", ""), utcnow())
                elif intent.kind == "record":
                    row = dict(a["row"], created_at=utcnow())
                    if self.ledger.append(row):
                        for hook in self.hooks:
                            hook(self, name, record, row)
                elif intent.kind == "cleanup":
                    # Branches of experiments that ran stay: they are the experiment DAG.
                    self.repo.cleanup(name, keep_branch=bool(st.get("job")))
        self._index_inflight(name, st)
        if decision is not None and decision.finalized:
            self._record_path(name).unlink(missing_ok=True)
        return decision

    def _request(self, name: str, spec: ExperimentSpec, a: dict) -> RunRequest:
        return RunRequest(run=a["run"], experiment=name, campaign=spec.campaign,
                          candidate_source=self.repo.candidate_source(name),
                          candidate_path=str(self.repo.worktree_path(name) / self.lab.surface),
                          slot=a.get("slot"), profile=self.lab.profile, data=self.lab.data,
                          budget_seconds=self.lab.budget_seconds, gpus=spec.gpus,
                          overrides=spec.hf)

    def _log_events(self, name: str, events: list[Event]) -> None:
        if not events:
            return
        p = self.state / "events" / f"{name}.jsonl"
        p.parent.mkdir(parents=True, exist_ok=True)
        with open(p, "a", encoding="utf-8") as f:
            for e in events:
                f.write(json.dumps({"time": utcnow(), "type": e.type, "reason": e.reason,
                                    "message": e.message}) + "\n")

    def events(self, name: str) -> list[dict]:
        p = self.state / "events" / f"{name}.jsonl"
        if not p.exists():
            return []
        return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]

    # -- the master's baseline -----------------------------------------------------------------
    def _baseline(self, free: list[str]) -> str | None:
        """Measure a master with no metric. Returns the slot its run holds, if any."""
        m = self.repo.master()
        if m.val_bpb is not None:
            return None
        name = baseline_run_name(m)
        # A lab that runs on Hugging Face measures its master there too (a laptop has no GPU).
        backend = self.backend_for("hf") if self.lab.backend == "hf" else self.backends["local"]
        obs = backend.observe(name)
        slot = free[0] if free else None
        for intent in reconcile_baseline(m, obs, slot, self.ledger.has_run(name)):
            if intent.kind == "submit":
                path = self.state / "baseline" / m.hash[:12] / Path(self.lab.surface).name
                path.parent.mkdir(parents=True, exist_ok=True)
                source = self.repo.master_source()
                path.write_text(source)
                obs = backend.submit(RunRequest(
                    run=name, experiment="baseline", campaign="", candidate_source=source,
                    candidate_path=str(path), slot=intent.args["slot"], profile=self.lab.profile,
                    data=self.lab.data, budget_seconds=self.lab.budget_seconds))
            elif intent.kind == "record":
                self.ledger.append(dict(intent.args["row"], created_at=utcnow(), backend="local"))
            elif intent.kind == "set-master-metric":
                self.repo.set_master_metric(intent.args["val_bpb"])
            elif intent.kind == "resubmit-baseline":
                # Locally a person looks first: a master that cannot be measured needs a fix.
                raise BaselineFailed(f"the master's baseline run {name} failed: "
                                     f"{intent.args['reason']}; see {backend.log_path(name)}, "
                                     f"then remove {backend.run_dir(name)} to measure it again")
        if obs.state in ("queued", "running"):
            return backend.slot_of(name)
        return None

    # -- one pass over the lab -----------------------------------------------------------------
    def _planning_record(self, name: str) -> dict:
        """A record to plan a pass with; one that cannot be read, or is mis-shaped, reads as {}.

        The experiment's own reconcile meets the problem and tells it on that experiment.
        """
        try:
            r = self.read_record(name)
        except (OSError, ValueError):
            return {}
        st = (r.get("status") or {}) if isinstance(r, dict) else None
        spec = (r.get("spec") or {}) if isinstance(r, dict) else None
        text = (str, type(None))
        ok = (isinstance(st, dict) and isinstance(spec, dict)
              and all(isinstance(st.get(k), text) for k in ("phase", "createdAt", "queuedAt",
                                                             "candidateHash", "semanticHash"))
              and isinstance(st.get("job") or {}, dict)
              and isinstance((st.get("job") or {}).get("slot"), text)
              and isinstance(spec.get("priority", 0), int))
        return r if ok else {}

    def _reconcile_isolated(self, name: str, sf: SpecFile | None, slot: str | None = None,
                            deleting: bool = False) -> str | None:
        """`reconcile_one`, with a failure kept to that experiment; returns its message, if any.

        One experiment's bad state must not stop the pass for all the others. The failure goes
        into its events and its status (once per distinct message; see core/failures.py) and
        the next pass tries again.
        """
        try:
            decision = self.reconcile_one(name, sf, slot=slot, deleting=deleting)
        except BackendConfigError:
            raise  # the lab's, not this experiment's: stop and say what to set
        except Exception as e:  # isolation is the point: whatever it is, it is this one's
            try:
                self.read_record(name)
                message = failure_message(name, e)
            except (OSError, ValueError) as unreadable:
                message = failure_message(name, SpecError(
                    f"its status file {self._record_path(name)} cannot be read ({unreadable}); "
                    "restore it, or remove it to start the experiment over"))
            if self._amend_status(name, lambda st: with_failure(st, message, utcnow())) \
                    or not self._told_already(name, message):
                self._log_events(name, [Event("Warning", RECONCILE_ERROR, message)])
            return message
        if decision is not None and not decision.finalized and failing(decision.status):
            self._amend_status(name, lambda st: with_recovery(st, utcnow()))
        return None

    def _amend_status(self, name: str, change: Callable[[dict], dict | None]) -> bool:
        """Apply `change` to a readable record's status under its lock; True if it changed."""
        try:
            with FileLock(str(self.state / "locks" / f"exp-{name}.lock")):
                record = self.read_record(name)
                st = record.get("status") if isinstance(record, dict) else None
                new = change(st) if isinstance(st, dict) else None
                if new is None:
                    return False
                record["status"] = new
                self.write_record(name, record)
                return True
        except (OSError, ValueError):
            return False

    def _told_already(self, name: str, message: str) -> bool:
        try:
            last = (self.events(name) or [{}])[-1]
        except (OSError, ValueError):
            return False
        return last.get("reason") == RECONCILE_ERROR and last.get("message") == message

    def step(self, deleting: set[str] = frozenset()) -> "PassSummary":
        loaded = self.load_specs()
        for n in [n for n, sf in loaded.specs.items() if not trackable(sf.doc)]:
            # Its name keys files and a JSON copy of it is kept: it names no experiment.
            sf = loaded.specs.pop(n)
            loaded.errors.append(sf.error or f"{sf.path}: metadata.name: expected a lowercase "
                                              "DNS label (a-z, 0-9, '-')")
        failures: list[str | None] = []
        known = set(self.names())
        records = {n: self._planning_record(n) for n in known}
        self._inflight = {}
        for n, r in records.items():
            self._index_inflight(n, r.get("status") or {})
        gone = {n for n in known if n not in loaded.specs}
        order = sorted(loaded.specs, key=lambda n: (
            (records.get(n, {}).get("status") or {}).get("createdAt") or "~",
            loaded.specs[n].path.stat().st_mtime if loaded.specs[n].path.exists() else 0, n))
        # 1. deletions and pre-run checks, oldest first; a failure stays with its experiment
        for n in sorted(gone | (set(deleting) & known)):
            failures.append(self._reconcile_isolated(n, None, deleting=True))
        for n in order:
            phase = (records.get(n, {}).get("status") or {}).get("phase")
            if phase in (None, "Pending"):
                failures.append(self._reconcile_isolated(n, loaded.specs[n]))
        # 2. slots: the baseline first, then queued experiments by priority
        records = {n: self._planning_record(n) for n in self.names()}
        slots = visible_slots(self.lab.gpu_slots)
        busy = {((r.get("status") or {}).get("job") or {}).get("slot") for r in records.values()
                if (r.get("status") or {}).get("phase") in ACTIVE}
        busy.discard(None)
        base_slot = self._baseline([s for s in slots if s not in busy])
        if base_slot:
            busy.add(base_slot)
        queued = [(n, int((r.get("spec") or {}).get("priority", 0)),
                   r["status"].get("queuedAt", "")) for n, r in records.items()
                  if (r.get("status") or {}).get("phase") == "Queued"
                  and not r["status"].get("job")]
        grant = allocate_slots(queued, busy, slots) if self.repo.master().val_bpb is not None \
            else {}
        for n, r in records.items():
            st = r.get("status") or {}
            if st.get("phase") in ACTIVE or (st.get("phase") in TERMINAL and n in loaded.specs):
                failures.append(self._reconcile_isolated(n, loaded.specs.get(n),
                                                         slot=grant.get(n)))
        return self.summary(loaded.errors + [f for f in failures if f])

    def summary(self, errors: list[str] | None = None) -> "PassSummary":
        rows = []
        for n in self.names():
            r = self._planning_record(n)
            rows.append((n, r.get("status") or {}, r.get("spec") or {}))
        m = self.repo.master()
        baseline_running = m.val_bpb is None
        return PassSummary(rows=rows, errors=errors or [], baseline_pending=baseline_running,
                           slots=visible_slots(self.lab.gpu_slots))

    def apply_file(self, doc: dict, source: str) -> str:
        """Write a validated spec into experiments/; returns created/configured/unchanged."""
        validate_document(doc, source=source, kind="Experiment")
        name = doc["metadata"]["name"]
        self.experiments_dir.mkdir(parents=True, exist_ok=True)
        target = self.experiments_dir / f"{name}.yaml"
        loaded = self.load_specs()
        if name in loaded.specs and loaded.specs[name].path != target:
            target = loaded.specs[name].path
        text = yaml.safe_dump(doc, sort_keys=False, width=100, allow_unicode=True)
        if target.exists():
            old = load_yaml_file(target)
            if old and old[0] == doc:
                return "unchanged"
            atomic_write(target, text)
            return "configured"
        atomic_write(target, text)
        return "created"

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
            return self.reconcile_one(name, None, deleting=True)
        return None


class BaselineFailed(RuntimeError):
    pass


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


def hostname() -> str:
    return socket.gethostname()
