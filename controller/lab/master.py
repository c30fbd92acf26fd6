"""The master store: the lab's current master, its history, and promotion as a compare-and-swap.

The master is branch `autolab/master` plus `research/live/master.json`, which holds its hashes,
its metric, its values by place and the history of masters (so a spec's `parent` prefix
resolves to the commit it was written against). Every change to it happens under one file
lock: re-read master.json, decide, then move the branch and rewrite the file atomically. A
promotion is a compare-and-swap: the reconcile core's `promotion_refused` is asked again under
the lock, against the master as it is now, so two winners decided at once cannot both move it.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any, Callable

from filelock import FileLock

from controller.core.diffs import DiffRefused
from controller.core.hashing import candidate_hash, semantic_hash
from controller.core.intents import Promotion
from controller.core.reconcile import Master, PromotionResult, promotion_refused
from controller.core.spec import LabSpec, SpecUnreadable
from controller.lab.files import atomic_write

MASTER_BRANCH = "autolab/master"


def read_places(raw: object) -> dict[int, float]:
    """A master's values by place, as stored (`{"1": 0.98, ...}`); what does not read is left
    out (a hand edit), so a place without a value is measured again."""
    out: dict[int, float] = {}
    if isinstance(raw, dict):
        for k, v in raw.items():
            if str(k).isdigit() and isinstance(v, (int, float)) and not isinstance(v, bool) \
                    and v == v and abs(v) != float("inf"):
                out[int(k)] = float(v)
    return out


class RepoMaster:
    """The master of a lab repo (a part of `LabRepo`, which supplies what is declared here).
    In a cluster the ConfigMap is the master of record (`controller.kube.cluster.MasterStore`)
    and this one follows it."""

    lab: LabSpec
    master_file: Path
    _master_lock: FileLock
    git: Callable[..., subprocess.CompletedProcess]  # LabRepo.git

    def master_doc(self) -> dict:
        try:
            return json.loads(self.master_file.read_text())
        except ValueError as e:  # a hand edit or a copy cut short: say which file, and what to do
            raise SpecUnreadable(f"{self.master_file} is not valid JSON ({e}); fix it by hand, "
                                 "or restore it from a backup (the master's commit is the branch "
                                 f"{MASTER_BRANCH})") from None

    def master(self) -> Master:
        d = self.master_doc()
        return Master(hash=d["hash"], semantic_hash=d["semanticHash"], commit=d["commit"],
                      val_bpb=d.get("val_bpb"), experiment=d.get("experiment"),
                      places=read_places(d.get("places")))

    def master_source(self) -> str:
        return self.git("show", f"{self.master().commit}:{self.lab.surface}").stdout

    def seed_master(self, commit: str) -> None:
        """Make `commit` the first master (called by `autolab init`)."""
        source = self.git("show", f"{commit}:{self.lab.surface}").stdout
        self.git("branch", "-f", MASTER_BRANCH, commit)
        entry = {"hash": candidate_hash(source), "semanticHash": semantic_hash(source),
                 "commit": commit, "val_bpb": None, "experiment": None, "parent": None,
                 "promotedAt": None}
        self._write({**entry, "history": [dict(entry)]})

    def resolve_parent(self, prefix: str) -> dict:
        """The master (from history) whose hash or commit starts with `prefix`."""
        history = self.master_doc().get("history", [])
        hits = {h["hash"]: h for h in history
                if h["hash"].startswith(prefix) or h["commit"].startswith(prefix)}
        if not hits:
            current = self.master().hash
            raise DiffRefused("UnknownParent",
                              f"parent {prefix} is not a master of this lab; write the diff "
                              f"against the current master {current[:12]} "
                              "(see `autolab master`)")
        if len(hits) > 1:
            raise DiffRefused("AmbiguousParent",
                              f"parent {prefix} matches several masters "
                              f"({', '.join(h[:12] for h in hits)}); give more hex digits")
        return next(iter(hits.values()))

    def set_master_metric(self, val_bpb: float, places: dict | None = None,
                          master_hash: str | None = None) -> None:
        """The baseline: the master's val_bpb, and its value at place 1 (where it ran); only
        while `master_hash` (where given) is still the master."""
        with self._master_lock:
            d = self.master_doc()
            if master_hash is not None and d["hash"] != master_hash:
                return
            if d.get("val_bpb") is not None and (places is None or d.get("places")):
                return
            if d.get("val_bpb") is None:
                d["val_bpb"] = val_bpb
            if places:
                d["places"] = {**{str(k): v for k, v in places.items()}, **(d.get("places") or {})}
            for h in d["history"]:
                if h["hash"] == d["hash"]:
                    h.update(val_bpb=d["val_bpb"], places=d.get("places") or {})
            self._write(d)

    def set_place(self, master_hash: str, place: int, val_bpb: float) -> bool:
        """Keep the master's value at `place`, if `master_hash` is still the master and the
        place has none yet (a value is measured once; the first one stands)."""
        with self._master_lock:
            d = self.master_doc()
            places = d.get("places") or {}
            if d["hash"] != master_hash or str(place) in places:
                return False
            d["places"] = {**places, str(place): val_bpb}
            for h in d["history"]:
                if h["hash"] == d["hash"]:
                    h["places"] = d["places"]
            self._write(d)
            return True

    def before_checks(self, asked_at: float | None = None) -> None:
        """The engine's seam (`MasterOfRecord`): the lab repo is its own master of record, so
        there is nothing to bring in step before a check."""

    def promote_candidate(self, p: Promotion) -> PromotionResult:
        """The engine's compare-and-swap (`MasterOfRecord`): `promote`, of a `Promotion`."""
        return self.promote(p.name, p.commit, p.val_bpb, p.hashes, p.parent, p.now, p.margin,
                            p.against, p.places)

    def promote(self, name: str, commit: str, val_bpb: float, hashes: tuple[str, str],
                parent: str, now: str, margin: float | None = None,
                against: float | None = None, places: dict | None = None) -> PromotionResult:
        """Compare-and-swap: under the lock, re-read the master, compare again, then move it."""
        with self._master_lock:
            d = self.master_doc()
            previous = d["history"][-2]["val_bpb"] if len(d["history"]) > 1 else None
            need = margin if margin is not None else _fixed(self.lab.min_delta)
            settled = promotion_refused(d, name, val_bpb, need, previous, parent, against)
            if settled is not None:
                return settled
            self.git("update-ref", f"refs/heads/{MASTER_BRANCH}", commit)
            entry = {"hash": hashes[0], "semanticHash": hashes[1], "commit": commit,
                     "val_bpb": val_bpb, "experiment": name, "parent": parent,
                     "promotedAt": now, "places": {str(k): v for k, v in (places or {}).items()}}
            self._write({**entry, "history": d["history"] + [dict(entry)]})
            return PromotionResult(True, d.get("val_bpb"))

    def _write(self, doc: dict[str, Any]) -> None:
        atomic_write(self.master_file, json.dumps(doc, indent=2) + "\n")


def _fixed(min_delta: float | str) -> float:
    return 0.0 if min_delta == "auto" else float(min_delta)
