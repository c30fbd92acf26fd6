"""The lab repo: one git repository holding the master, its history and every candidate.

`LabRepo` is what the rest of the controller holds. It is made of parts, one job a module:

- `controller.lab.git`: how git is run (`GitError`, the lab's identity, the long-lived
  plumbing processes a check talks to);
- `controller.lab.master` (`RepoMaster`): the master record, `research/live/master.json`
  beside branch `autolab/master`, and promotion as a compare-and-swap under a file lock;
- `controller.lab.checks` (`CandidateChecks`): a spec's diff applied, rebased, compiled and
  hashed into branch `autolab/exp/<name>`, or refused with the reason;
- `controller.lab.check_pool`: many checks at once, in worker processes.

This module joins them: it knows where the lab is and owns the git processes the parts share.
"""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path

from filelock import FileLock

from controller.core.spec import LabSpec
from controller.lab.checks import CandidateChecks
from controller.lab.git import Plumbing, run_git, run_git_bytes
from controller.lab.master import RepoMaster
from controller.lab.paths import LabPaths


class LabRepo(RepoMaster, CandidateChecks):
    """A lab's repository at `root`, checked and promoted by the rules of `lab`."""

    def __init__(self, root: str | Path, lab: LabSpec):
        self.root = Path(root).resolve()
        self.lab = lab
        self.paths = LabPaths.of(self.root)
        self.state = self.paths.state
        self.master_file = self.paths.master_file
        self._master_lock = FileLock(str(self.state / "locks" / "master.lock"))
        self._plumbing: Plumbing | None = None  # long-lived git processes (see `plumbing`)
        self._plumbing_lock = threading.Lock()
        self._path_trees = {}  # the parents' trees on the surface's path (`_tree_with`)

    def git(self, *args: str, cwd: Path | None = None, input: str | None = None,
            check: bool = True) -> subprocess.CompletedProcess:
        """`git` in this repo (or in `cwd`), text in and out; `GitError` when it fails."""
        return run_git(self.root, *args, cwd=cwd, input=input, check=check)

    def git_bytes(self, *args: str, input: bytes | None = None, env: dict | None = None,
                  check: bool = True) -> subprocess.CompletedProcess:
        """`git` in this repo with bytes in and out (a candidate's exact bytes)."""
        return run_git_bytes(self.root, *args, input=input, env=env, check=check)

    def plumbing(self) -> Plumbing:
        """This repo's long-lived git processes, started on first use (a check pool's worker
        keeps them for every check of the lab; `close` ends them, as does garbage collection)."""
        with self._plumbing_lock:
            if self._plumbing is None or not self._plumbing.alive():
                if self._plumbing is not None:
                    self._plumbing.close()
                self._plumbing = Plumbing(self.root)
            return self._plumbing

    def close(self) -> None:
        """End the long-lived git processes (a later check starts them again)."""
        with self._plumbing_lock:
            plumbing, self._plumbing = self._plumbing, None
        if plumbing is not None:
            plumbing.close()
