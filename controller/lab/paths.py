"""The lab's file layout, written out once.

    <root>/
      lab.yaml                       the Lab spec
      bench/                         the benchmark as the lab was made (pinned in git)
      experiments/*.yaml             the live specs (people and agents write these)
      research/results.tsv           the ledger
      research/live/master.json      the master (on one machine; a ConfigMap in a cluster)
      research/experiments/NAME.md   one note per experiment
      research/do-not-repeat.md      ideas not to try again, by campaign
      .autolab/                      the controller's own state (git-ignored):
        status/NAME.json             what the local loop knows about an experiment
        specs/KEY.json               the spec an experiment was checked with
        events/NAME.jsonl            its events
        locks/                       file locks
        candidates/NAME              a checked candidate's commit, until its cleanup
        worktrees/NAME               a candidate's git worktree (before issue 15; still cleaned)
        runs/RUN/                    a run's directory (local backend)
        trackio/                     Trackio's database
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

LAB_FILE = "lab.yaml"
LEDGER = "research/results.tsv"
MASTER_FILE = "research/live/master.json"
STATE = ".autolab"


def find_lab_root(start: str | Path) -> Path | None:
    """The lab that `start` is in, found the way git finds `.git`: `start` itself or the nearest
    parent holding lab.yaml. Inside the lab's own state (a scratch checkout or a candidate's
    worktree under .autolab/, which hold a lab.yaml of their own) it is the lab around them."""
    here = Path(start).resolve()
    for d in (here, *here.parents):
        if d.name == STATE and (d.parent / LAB_FILE).is_file():
            return d.parent
    for d in (here, *here.parents):
        if (d / LAB_FILE).is_file():
            return d
    return None


@dataclass(frozen=True)
class LabPaths:
    root: Path

    @classmethod
    def of(cls, root: str | Path) -> "LabPaths":
        return cls(Path(root).resolve())

    @property
    def lab_file(self) -> Path:
        return self.root / LAB_FILE

    @property
    def bench(self) -> Path:
        return self.root / "bench"

    @property
    def experiments(self) -> Path:
        return self.root / "experiments"

    @property
    def research(self) -> Path:
        return self.root / "research"

    @property
    def ledger(self) -> Path:
        return self.root / LEDGER

    @property
    def master_file(self) -> Path:
        return self.root / MASTER_FILE

    @property
    def live(self) -> Path:
        return self.research / "live"

    @property
    def noise_file(self) -> Path:
        """The lab's measured noise (`autolab noise`): research/live/noise.json."""
        return self.live / "noise.json"

    @property
    def evaluation_file(self) -> Path:
        """How long the master's measured run took to be evaluated: research/live/evaluation.json."""
        return self.live / "evaluation.json"

    @property
    def state(self) -> Path:
        return self.root / STATE

    def status_file(self, name: str) -> Path:
        return self.state / "status" / f"{name}.json"

    def checked_spec(self, key: str) -> Path:
        return self.state / "specs" / f"{key}.json"

    def events_file(self, name: str) -> Path:
        return self.state / "events" / f"{name}.jsonl"

    def lock(self, name: str) -> Path:
        """A lock file under .autolab/locks (its folder made on first use)."""
        d = self.state / "locks"
        d.mkdir(parents=True, exist_ok=True)
        return d / f"{name}.lock"

    def worktree(self, name: str) -> Path:
        return self.state / "worktrees" / name

    def candidate(self, name: str) -> Path:
        return self.state / "candidates" / name

    def run_dir(self, run: str) -> Path:
        return self.state / "runs" / run

    @property
    def trackio(self) -> Path:
        return self.state / "trackio"
