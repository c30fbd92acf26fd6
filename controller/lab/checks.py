"""Candidate checks: a spec's diff made into a commit of the lab, or refused with the reason.

Every experiment is materialised without a worktree, in git's object store: its diff is
applied by `git apply` to a copy of the surface as it is in the master it was written against,
in a scratch directory outside any repository (arguments as a list, the diff on stdin: no shell
ever sees a user's string; no config but git's defaults, so nobody's `core.autocrlf` rewrites
the bytes), and committed with the hypothesis as the message and trailers naming the
experiment, campaign and parent. If the master moved on, that commit is rebased onto the
current master as cherry-pick would (`git merge-tree --write-tree`, a three-way merge based on
the parent): a clean merge rebases it, a conflict refuses it with the failing hunk. Then what
Python runs is checked and hashed (`check_candidate_source`, `compiled_semantic_hash`).

The commit stays on branch `autolab/exp/<name>` (the experiment DAG), and a marker
`.autolab/candidates/<name>` says that a cleanup is owed until the run ends. No check shares a
file with another, so many run at once (`controller.lab.check_pool`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable

from controller.core.diffs import DiffRefused, parse_surface_diff
from controller.core.hashing import (candidate_hash, check_candidate_source,
                                     compiled_semantic_hash)
from controller.core.reconcile import Candidate, Master
from controller.core.spec import ExperimentSpec, LabSpec
from controller.lab.git import (GitError, Plumbing, apply_env, commit_object, mktree_line,
                                tree_entries)
from controller.lab.paths import LabPaths

_TREES_KEPT = 16  # parents' trees remembered for `_tree_with`: a few masters' worth


class CandidateChecks:
    """The checks of a lab repo's candidates (a part of `LabRepo`, which supplies what is
    declared here)."""

    lab: LabSpec
    paths: LabPaths
    _plumbing_lock: threading.Lock
    _path_trees: dict[str, list[list[tuple[bytes, bytes, str]]]]
    git: Callable[..., subprocess.CompletedProcess]  # LabRepo.git
    git_bytes: Callable[..., subprocess.CompletedProcess]  # LabRepo.git_bytes
    plumbing: Callable[[], Plumbing]  # LabRepo.plumbing
    master: Callable[[], Master]  # RepoMaster.master
    resolve_parent: Callable[[str], dict]  # RepoMaster.resolve_parent

    def materialise(self, name: str, spec: ExperimentSpec) -> Candidate:
        """Every check before a run: the diff, its parent, apply or rebase, compile, hashes."""
        return self.check(name, spec)[0]

    def check(self, name: str, spec: ExperimentSpec) -> tuple[Candidate, str]:
        """`materialise`, and the commit of the master it was checked against. Safe to call
        for different names at once (threads, processes): each check has its own scratch
        directory, and git writes objects and refs atomically."""
        surface = self.lab.surface
        master = self.master()
        try:
            diff = parse_surface_diff(spec.diff, surface)
            parent = self.resolve_parent(spec.parent)
        except DiffRefused as e:
            return Candidate(refusal="Invalid", reason=e.reason, message=str(e)), master.commit
        self._remove_worktree(name)
        with tempfile.TemporaryDirectory(prefix="autolab-check-") as scratch:
            candidate = self._apply(parent, master, diff, scratch)
            if isinstance(candidate, Candidate):
                return candidate, master.commit
            raw, blob = candidate
            tree = self._tree_with(parent["commit"], blob)
            trailers = (f"\n\nAutolab-Experiment: {name}\nAutolab-Campaign: {spec.campaign or '-'}"
                        f"\nAutolab-Parent: {parent['hash']}")
            commit = self._commit(tree, parent["commit"], spec.hypothesis + trailers, scratch)
            rebased_from = None
            base = parent
            if parent["commit"] != master.commit:
                tree, hunk = self._rebase(commit, parent["commit"], master.commit, scratch)
                if tree is None:
                    msg = (f"diff was written against {parent['hash'][:12]} and conflicts with "
                           f"the current master {master.hash[:12]} "
                           f"({master.experiment or 'seed'}):\n{hunk}\n"
                           "rewrite the change against the current master")
                    return Candidate(refusal="Conflict", reason="RebaseConflict",
                                     message=msg), master.commit
                rebased_from = parent["hash"]
                base = {"hash": master.hash}
                # A change the master already holds rebases to the master's own tree: kept, so
                # the candidate is the master itself and the duplicate check says so (not a
                # conflict).
                commit = self._commit(tree, master.commit, spec.hypothesis
                                      + trailers.replace(parent["hash"], master.hash)
                                      + f"\nAutolab-Rebased-From: {parent['hash']}", scratch)
                raw = self.plumbing().read(f"{tree}:{surface}", b"blob")
        refused = check_candidate_source(raw, surface)  # what Python runs is what we hash
        if refused is not None:
            return Candidate(refusal="Invalid", reason=refused.reason,
                             message=refused.message), master.commit
        source = raw.decode("utf-8")
        try:  # the text compiles as `python` compiles it; only what changed is parsed again
            sem = compiled_semantic_hash(source, surface)
        except SyntaxError as e:
            return Candidate(refusal="Invalid", reason="CompileError",
                             message=f"candidate does not compile: {surface} line {e.lineno}: "
                                     f"{e.msg}"), master.commit
        except (RecursionError, MemoryError):  # Python could not run it either
            return Candidate(refusal="Invalid", reason="CompileError",
                             message=f"candidate does not compile: {surface} is nested too "
                                     "deeply for Python's compiler; split the expression"), \
                master.commit
        # Marked before the branch: a crash in between leaves a branch that cleanup finds.
        marker = self.candidate_marker(name)
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(commit + "\n")
        self.plumbing().refs.point(f"refs/heads/autolab/exp/{name}", commit)
        return Candidate(candidate_hash=candidate_hash(source), semantic_hash=sem,
                         parent_hash=base["hash"], rebased_from=rebased_from, commit=commit,
                         changed_lines=len(diff.added) + len(diff.removed)), master.commit

    def _apply(self, parent: dict, master: Master, diff: Any,
               scratch: str) -> Candidate | tuple[bytes, str]:
        """The parent's surface with the diff applied, and its blob: (bytes, blob id), or the
        refusal. `git apply` patches a copy of the file in `scratch`, outside any repository
        (as `patch` would, with git's rules, and no config but its defaults), and the result
        goes into the object store through the long-lived `hash-object`, as it is."""
        surface = self.lab.surface
        tree = Path(scratch, "tree")  # the surface's path is the diff's, from here
        target = tree / surface
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            target.write_bytes(self.plumbing().read(f"{parent['commit']}:{surface}", b"blob"))
        except GitError:
            return Candidate(refusal="Invalid", reason="DiffDoesNotApply",
                             message=_does_not_apply(parent, master, surface,
                                                     f"{surface} is not in it"))
        # Zero-context hunks are well-formed (`diff -U0`); git applies them only when told.
        zero = ["--unidiff-zero"] if diff.zero_context else []
        applied = subprocess.run(["git", "apply", "--whitespace=nowarn", *zero, "-"],
                                 cwd=tree,
                                 input=diff.text.encode("utf-8"), capture_output=True,
                                 env=apply_env(scratch))
        if applied.returncode != 0:
            why = applied.stderr.decode("utf-8", "replace").strip()
            why = why.replace("error: ", "").replace("\n", "; ")
            return Candidate(refusal="Invalid", reason="DiffDoesNotApply",
                             message=_does_not_apply(parent, master, surface, why))
        blob = self.plumbing().blobs.ask(str(target).encode("utf-8") + b"\n")
        return target.read_bytes(), blob

    def _tree_with(self, commit: str, blob: str) -> str:
        """The tree of `commit` with the surface's blob replaced by `blob` (`git mktree`, one
        tree per directory on the surface's path; the parent's trees are read once)."""
        git = self.plumbing()
        parts = self.lab.surface.encode("utf-8").split(b"/")
        key = f"{commit}:{self.lab.surface}"
        levels = self._path_trees.get(key)
        if levels is None:
            levels, where = [], f"{commit}^{{tree}}"
            for depth in range(len(parts)):
                levels.append(tree_entries(git.read(where, b"tree"), len(commit) // 2))
                where = f"{commit}:{b'/'.join(parts[:depth + 1]).decode('utf-8')}"
            with self._plumbing_lock:  # checks in several threads share the repo
                while len(self._path_trees) >= _TREES_KEPT:
                    self._path_trees.pop(next(iter(self._path_trees)))
                self._path_trees[key] = levels
        oid = blob
        for depth in reversed(range(len(parts))):
            entries = [(mode, name, oid if name == parts[depth] else old)
                       for mode, name, old in levels[depth]]
            oid = git.trees.ask(b"".join(mktree_line(*entry) for entry in entries) + b"\0")
        return oid

    def _commit(self, tree: str, parent: str, message: str, scratch: str) -> str:
        """`git commit-tree` as the lab commits, through the long-lived `hash-object -t
        commit`; the text goes through a file in `scratch`."""
        path = os.path.join(scratch, "commit")
        Path(path).write_bytes(commit_object(tree, parent, message))
        return self.plumbing().commits.ask(path.encode("utf-8") + b"\n")

    def _rebase(self, commit: str, parent: str, master: str,
                scratch: str) -> tuple[str | None, str]:
        """The tree of `commit` cherry-picked onto `master`; (None, the hunk) on a conflict.

        A three-way merge in git's object store (`git merge-tree --write-tree`), as
        cherry-pick makes it: base `parent`, ours the master, theirs the candidate. git
        2.39 has no --merge-base, so the master's tree goes on a commit whose parent is
        `parent`, which makes `parent` the merge base whatever the history between them.
        """
        master_tree = self.plumbing().object(f"{master}^{{tree}}")[0]
        ours = self._commit(master_tree, parent, "the current master, for a rebase", scratch)
        merged = self.git_bytes("merge-tree", "--write-tree", ours, commit, check=False)
        tree = merged.stdout.decode("utf-8", "replace").split("\n", 1)[0].strip()
        if merged.returncode == 0:
            return tree, ""
        text = None
        if merged.returncode == 1 and tree:
            with contextlib.suppress(GitError):
                text = self.plumbing().read(f"{tree}:{self.lab.surface}", b"blob").decode(
                    "utf-8", "replace")
        return None, _conflict_hunk(text)

    # -- what a check leaves behind ----------------------------------------------------------
    def candidate_marker(self, name: str) -> Path:
        return self.paths.candidate(name)

    def worktree_path(self, name: str) -> Path:
        return self.paths.worktree(name)

    def has_worktree(self, name: str) -> bool:
        """Something of a checked candidate is left to clean up (its marker, or an old worktree)."""
        return self.candidate_marker(name).exists() or self.worktree_path(name).exists()

    def _remove_worktree(self, name: str) -> None:
        self.candidate_marker(name).unlink(missing_ok=True)
        wt = self.worktree_path(name)  # made by a controller before issue 15
        if not wt.exists():
            return
        if self.git("worktree", "remove", "--force", str(wt), check=False).returncode != 0:
            shutil.rmtree(wt, ignore_errors=True)  # half-made by a crash: forget it in git too
            self.git("worktree", "prune", check=False)

    def cleanup(self, name: str, keep_branch: bool) -> None:
        self._remove_worktree(name)
        if not keep_branch:
            self.git("branch", "-D", f"autolab/exp/{name}", check=False)

    def candidate_source(self, name: str) -> str:
        return self.source_of(f"autolab/exp/{name}")

    def source_of(self, commit: str) -> str:
        """The surface file as it is in `commit` (a master's, for its pair runs)."""
        return self.git("show", f"{commit}:{self.lab.surface}").stdout


def recorded_duplicate(repo: Any, ledger: Any, name: str, c: Candidate) -> str | None:
    """What a checked candidate repeats among the master and the measured experiments.

    Both front ends call this, then look among their own runs in flight.
    """
    if c.refusal:
        return None
    m = repo.master()
    if c.candidate_hash == m.hash or c.semantic_hash == m.semantic_hash:
        return f"master ({m.experiment or 'seed'} {m.hash[:12]})"
    hit = ledger.measured(c.candidate_hash, c.semantic_hash)
    return hit if hit and hit != name else None


def _conflict_hunk(text: str | None, context: int = 2) -> str:
    """The first conflicted region of a file, with a little context, for the user."""
    if text is None:
        return "(conflicting file could not be read)"
    lines = text.split("\n")
    start = next((i for i, l in enumerate(lines) if l.startswith("<<<<<<<")), None)
    if start is None:
        return "(git reported a conflict)"
    end = next((i for i in range(start, len(lines)) if lines[i].startswith(">>>>>>>")), start)
    lo, hi = max(0, start - context), min(len(lines), end + context + 1)
    # git labels the sides with commit ids that differ on every attempt; name them instead.
    label = {start: "<<<<<<< current master", end: ">>>>>>> this experiment"}
    return "\n".join(f"  {i + 1:4d} | {label.get(i, lines[i])}" for i in range(lo, hi))


def _does_not_apply(parent: dict, master: Master, surface: str, why: str) -> str:
    """Why a diff did not apply to its parent, blaming a moved master only when it moved."""
    head = f"diff does not apply to its parent {parent['hash'][:12]}"
    fresh = "`autolab worktree NAME` gives a fresh copy of the current master to edit and diff"
    if parent["commit"] == master.commit or parent["hash"] == master.hash:
        return (f"{head} (the current master): {why}; the lines it removes and its context "
                f"lines must be in {surface} as they are there: {fresh}")
    return (f"{head}: {why}; that master is older than the current one "
            f"{master.hash[:12]} ({master.experiment or 'seed'}): regenerate the diff against "
            f"the current master ({fresh})")
