"""The lab's campaign: its places' seeds and the tests its decisions are.

A run's harness seed is its place's, drawn from the lab's secret (`.autolab/state/noise.key`,
which no run can read; `controller.core.noise.place_seed`): the core names places, never
seeds. Which test against a master an experiment's decision is (its number, which sets its
level) is counted when its first run is submitted: the experiments that began one against
that master, kept in `.autolab/state/tests/<master>.json`. The lab's tests in the order they
began, and the promoted ones among them, are kept in `.autolab/state/tests.json`: the online
FDR control (`controller.core.noise.lord_level`, LORD++) gives each test its level from them.
"""

from __future__ import annotations

import json
import secrets
import threading
from dataclasses import dataclass
from pathlib import Path

from controller.core.noise import lord_level, place_seed
from controller.lab.paths import LabPaths
from controller.lab.files import atomic_write


@dataclass
class Campaign:
    """The lab's secret for its places, and its tests (read and written under `lock`)."""

    paths: LabPaths
    lock: threading.RLock

    # -- places ------------------------------------------------------------------------------------
    def place_seed(self, place: int) -> int:
        return place_seed(self.noise_key(), place)

    def noise_key(self) -> bytes:
        """The lab's secret for the places' seeds, kept in its state directory, which no run
        can read; made once."""
        path = self.paths.state / "noise.key"
        try:
            key = path.read_bytes()
            if len(key) >= 16:
                return key
        except OSError:
            pass
        path.parent.mkdir(parents=True, exist_ok=True)
        key = secrets.token_hex(32).encode()
        atomic_write(path, key.decode())
        return path.read_bytes()

    # -- tests ---------------------------------------------------------------------------------------
    def _tests_file(self, master_hash: str) -> Path:
        return self.paths.state / "tests" / f"{master_hash}.json"

    def against(self, master_hash: str) -> list[str]:
        """The experiments that began a test against `master_hash`, in the order they began."""
        try:
            names = json.loads(self._tests_file(master_hash).read_text())
        except (OSError, ValueError):
            return []
        return [n for n in names if isinstance(n, str)] if isinstance(names, list) else []

    def number(self, name: str, master_hash: str) -> int:
        """Which test against `master_hash` the decision of `name` is: its place among those
        that began one, or the next place."""
        names = self.against(master_hash)
        return names.index(name) + 1 if name in names else len(names) + 1

    def _doc(self) -> dict:
        try:
            doc = json.loads((self.paths.state / "tests.json").read_text())
        except (OSError, ValueError):
            doc = {}
        tests = doc.get("tests") if isinstance(doc, dict) else None
        promoted = doc.get("promoted") if isinstance(doc, dict) else None
        return {"tests": [n for n in tests or [] if isinstance(n, str)],
                "promoted": [n for n in promoted or [] if isinstance(n, str)]}

    def level(self, name: str, doc: dict | None = None) -> float:
        """The level of `name`'s test: LORD++ at its number in the campaign (the next number if
        it has not begun), given the promotions of tests before it."""
        doc = doc if doc is not None else self._doc()
        tests = doc["tests"]
        t = tests.index(name) + 1 if name in tests else len(tests) + 1
        found = [tests.index(n) + 1 for n in doc["promoted"] if n in tests]
        return round(lord_level(t, [d for d in found if d < t]), 8)

    def discovered(self, name: str) -> None:
        """A promotion: the test of `name` earns level back for the tests after it."""
        with self.lock:
            doc = self._doc()
            if name not in doc["promoted"]:
                doc["promoted"].append(name)
                atomic_write(self.paths.state / "tests.json", json.dumps(doc) + "\n")

    def claim(self, name: str, master_hash: str) -> tuple[int, float]:
        """Count `name`'s decision (once) and say which test against `master_hash` it is and
        its level.

        Counted when its first run is submitted (or its carried pairs taken), whatever ends it:
        a candidate that voids its unlucky runs (a harness error) and is applied again under a
        new name is a new test each time, with the level the campaign has left then, so the
        tests together keep the online FDR control's bound however many there are."""
        with self.lock:
            names = self.against(master_hash)
            if name not in names:
                names.append(name)
                atomic_write(self._tests_file(master_hash), json.dumps(names) + "\n")
            doc = self._doc()
            level = self.level(name, doc)
            if name not in doc["tests"]:
                doc["tests"].append(name)
                atomic_write(self.paths.state / "tests.json", json.dumps(doc) + "\n")
            return names.index(name) + 1, level
