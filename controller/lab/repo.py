"""The lab repo: git branches for candidates, the master and its history.

Every experiment is materialised without a worktree, in git's object store:
its diff is applied by `git apply` to a copy of the surface as it is in the
master it was written against, in a scratch directory outside any repository
(arguments as a list, the diff on stdin: no shell ever sees a user's string;
no config but git's defaults, so nobody's `core.autocrlf` rewrites the bytes),
and committed with the hypothesis as the message and trailers naming the
experiment, campaign and parent. If the master moved on, that commit is rebased
onto the current master as cherry-pick would (`git merge-tree --write-tree`, a
three-way merge based on the parent): a clean merge rebases it, a conflict
refuses it with the failing hunk. The commit stays on branch
`autolab/exp/<name>` (the experiment DAG), and a marker
`.autolab/candidates/<name>` says that a cleanup is owed until the run ends.
No check shares a file with another, so many run at once (`CheckPool`: the
engine's pool of checking processes), and a check starts one process, `git
apply`: it reads objects, writes the blob, the trees and the commit, and moves
the branch through long-lived git processes (`cat-file --batch`, `hash-object
--stdin-paths`, `mktree --batch`, `update-ref --stdin`; `_Plumbing`), where `git
worktree add`/`remove` alone took ~30 ms and a temporary index with `apply
--cached`, `write-tree` and `commit-tree` three processes (issue 15).

The master is branch `autolab/master` plus `research/live/master.json`, which
holds its hashes, its metric and the history of masters (so a spec's `parent`
prefix resolves to the commit it was written against). Promotion is a
compare-and-swap: under a lock, re-read the master, compare again, then move
the branch and rewrite master.json atomically.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import shutil
import subprocess
import tempfile
import threading
import time
import weakref
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool as BrokenExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from filelock import FileLock

from controller.core.diffs import DiffRefused, parse_surface_diff
from controller.core.hashing import (candidate_hash, check_candidate_source,
                                     compiled_semantic_hash, semantic_hash)
from controller.core.intents import Promotion
from controller.core.reconcile import Candidate, Master, PromotionResult, promotion_refused
from controller.core.spec import ExperimentSpec, LabSpec, SpecError
from controller.lab.paths import LabPaths

MASTER_BRANCH = "autolab/master"
GIT_NAME, GIT_EMAIL = "autolab", "autolab@localhost"  # who commits in a lab
GIT_ID = ["-c", f"user.name={GIT_NAME}", "-c", f"user.email={GIT_EMAIL}",
          "-c", "commit.gpgsign=false", "-c", "core.hooksPath=/dev/null"]


class GitError(RuntimeError):
    pass


def atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # A temporary name of its own per call: two threads of one process writing the same file
    # must not share (and steal) one temporary file.
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


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


@dataclass
class MasterRecord:
    hash: str
    commit: str
    val_bpb: float | None
    experiment: str | None


class LabRepo:
    def __init__(self, root: str | Path, lab: LabSpec):
        self.root = Path(root).resolve()
        self.lab = lab
        self.paths = LabPaths.of(self.root)
        self.state = self.paths.state
        self.master_file = self.paths.master_file
        self._master_lock = FileLock(str(self.state / "locks" / "master.lock"))
        self._plumbing: _Plumbing | None = None  # long-lived git processes (see `plumbing`)
        self._plumbing_lock = threading.Lock()
        self._path_trees: dict[str, list[list[tuple[bytes, bytes, str]]]] = {}  # see _tree_with

    # -- git -----------------------------------------------------------------------------------
    def git(self, *args: str, cwd: Path | None = None, input: str | None = None,
            check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run(["git", *GIT_ID, *args], cwd=cwd or self.root, input=input,
                              capture_output=True, text=True)
        if check and proc.returncode != 0:
            raise GitError(f"git {' '.join(args)}: {proc.stderr.strip() or proc.stdout.strip()}")
        return proc

    def worktree_path(self, name: str) -> Path:
        return self.paths.worktree(name)

    # -- master --------------------------------------------------------------------------------
    def master_doc(self) -> dict:
        try:
            return json.loads(self.master_file.read_text())
        except ValueError as e:  # a hand edit or a copy cut short: say which file, and what to do
            raise SpecError(f"{self.master_file} is not valid JSON ({e}); fix it by hand, or "
                            "restore it from a backup (the master's commit is the branch "
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
        atomic_write(self.master_file, json.dumps({**entry, "history": [dict(entry)]},
                                                  indent=2) + "\n")

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
            atomic_write(self.master_file, json.dumps(d, indent=2) + "\n")

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
            atomic_write(self.master_file, json.dumps(d, indent=2) + "\n")
            return True

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
            history = d["history"] + [dict(entry)]
            atomic_write(self.master_file, json.dumps({**entry, "history": history},
                                                      indent=2) + "\n")
            return PromotionResult(True, d.get("val_bpb"))

    # -- candidates ----------------------------------------------------------------------------
    def git_bytes(self, *args: str, input: bytes | None = None, env: dict | None = None,
                  check: bool = True) -> subprocess.CompletedProcess:
        """`git` with bytes in and out (a candidate's exact bytes; a temporary index)."""
        proc = subprocess.run(["git", *GIT_ID, *args], cwd=self.root, input=input,
                              capture_output=True, env=env)
        if check and proc.returncode != 0:
            why = (proc.stderr or proc.stdout).decode("utf-8", "replace").strip()
            raise GitError(f"git {' '.join(args)}: {why}")
        return proc

    def candidate_marker(self, name: str) -> Path:
        return self.paths.candidate(name)

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

    def plumbing(self) -> "_Plumbing":
        """This repo's long-lived git processes, started on first use (a check pool's worker
        keeps them for every check of the lab; `close` ends them, as does garbage collection)."""
        with self._plumbing_lock:
            if self._plumbing is None or not self._plumbing.alive():
                if self._plumbing is not None:
                    self._plumbing.close()
                self._plumbing = _Plumbing(self.root)
            return self._plumbing

    def close(self) -> None:
        """End the long-lived git processes (a later check starts them again)."""
        with self._plumbing_lock:
            plumbing, self._plumbing = self._plumbing, None
        if plumbing is not None:
            plumbing.close()

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
                levels.append(_tree_entries(git.read(where, b"tree"), len(commit) // 2))
                where = f"{commit}:{b'/'.join(parts[:depth + 1]).decode('utf-8')}"
            with self._plumbing_lock:  # checks in several threads share the repo
                while len(self._path_trees) >= 16:  # a few masters' worth
                    self._path_trees.pop(next(iter(self._path_trees)))
                self._path_trees[key] = levels
        oid = blob
        for depth in reversed(range(len(parts))):
            entries = [(mode, name, oid if name == parts[depth] else old)
                       for mode, name, old in levels[depth]]
            oid = git.trees.ask(b"".join(
                mode + b" " + _KIND.get(mode, b"blob") + b" " + old.encode() + b"\t" + name + b"\0"
                for mode, name, old in entries) + b"\0")
        return oid

    def _commit(self, tree: str, parent: str, message: str, scratch: str) -> str:
        """`git commit-tree` as the lab commits (author and committer autolab, now), through
        the long-lived `hash-object -t commit`; the text goes through a file in `scratch`."""
        now = time.time()
        offset = int(time.localtime(now).tm_gmtoff) // 60
        when = f"{int(now)} {'-' if offset < 0 else '+'}{abs(offset) // 60:02d}{abs(offset) % 60:02d}"
        who = f"{GIT_NAME} <{GIT_EMAIL}> {when}"
        text = f"tree {tree}\nparent {parent}\nauthor {who}\ncommitter {who}\n\n"
        path = os.path.join(scratch, "commit")
        Path(path).write_bytes(text.encode("utf-8") + _stripspace(message).encode("utf-8"))
        return self.plumbing().commits.ask(path.encode("utf-8") + b"\n")

    def materialise(self, name: str, spec: ExperimentSpec) -> Candidate:
        """Every check before a run: the diff, its parent, apply or rebase, compile, hashes."""
        return self.check(name, spec)[0]

    def check(self, name: str, spec: ExperimentSpec) -> tuple[Candidate, str]:
        """`materialise`, and the commit of the master it was checked against. Safe to call for different names at once (threads, processes):
        each check has its own temporary index, and git writes objects and refs atomically."""
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
                                 env=_apply_env(scratch))
        if applied.returncode != 0:
            why = applied.stderr.decode("utf-8", "replace").strip()
            why = why.replace("error: ", "").replace("\n", "; ")
            return Candidate(refusal="Invalid", reason="DiffDoesNotApply",
                             message=_does_not_apply(parent, master, surface, why))
        blob = self.plumbing().blobs.ask(str(target).encode("utf-8") + b"\n")
        return target.read_bytes(), blob

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

    def cleanup(self, name: str, keep_branch: bool) -> None:
        self._remove_worktree(name)
        if not keep_branch:
            self.git("branch", "-D", f"autolab/exp/{name}", check=False)

    def candidate_source(self, name: str) -> str:
        return self.source_of(f"autolab/exp/{name}")

    def source_of(self, commit: str) -> str:
        """The surface file as it is in `commit` (a master's, for its pair runs)."""
        return self.git("show", f"{commit}:{self.lab.surface}").stdout


# -- the checks of many candidates at once ---------------------------------------------------------

CHECK_WORKERS = max(1, min(8, os.cpu_count() or 1))  # processes checking candidates at once
WORKER_PARENT_POLL_SECONDS = 1.0  # how often a check worker looks whether its controller is still there
_WORKER_REPOS: dict[str, LabRepo] = {}  # in a worker: the labs it checked last, newest last
_WORKER_REPOS_MAX = 8


_KIND = {b"40000": b"tree", b"160000": b"commit"}  # a tree entry's mode -> its object's kind


def _tree_entries(raw: bytes, id_bytes: int) -> list[tuple[bytes, bytes, str]]:
    """A tree object's entries as (mode, name, object id), in git's order."""
    entries, i = [], 0
    while i < len(raw):
        space = raw.index(b" ", i)
        nul = raw.index(b"\0", space)
        entries.append((raw[i:space], raw[space + 1:nul], raw[nul + 1:nul + 1 + id_bytes].hex()))
        i = nul + 1 + id_bytes
    return entries


def _apply_env(scratch: str) -> dict[str, str]:
    """`git apply` in a scratch directory: never a repository above it, nobody's config."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    return {**env, "GIT_CEILING_DIRECTORIES": scratch, "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_CONFIG_GLOBAL": os.devnull}


class _GitPipe:
    """A long-lived git command that answers each request with one line: an object without a
    process each (`hash-object --stdin-paths`, `mktree --batch`). One that failed has ended;
    `_Plumbing.alive` then says so, and the next check starts them all anew."""

    def __init__(self, root: Path, *args: str):
        self.args = args
        self.proc = subprocess.Popen(["git", *GIT_ID, *args], cwd=root, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.lock = threading.Lock()

    def ask(self, request: bytes) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        with self.lock:
            try:
                self.proc.stdin.write(request)
                self.proc.stdin.flush()
                line = self.proc.stdout.readline()
            except OSError:
                line = b""
            if not line:  # git said why on stderr, then ended
                assert self.proc.stderr is not None
                with contextlib.suppress(OSError, ValueError):
                    self.proc.stdin.close()
                why = self.proc.stderr.read().decode("utf-8", "replace").strip()
                raise GitError(f"git {' '.join(self.args)}: {why or 'ended'}")
            return line.decode().strip()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()  # each of them ends at the end of its input
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for f in (self.proc.stdout, self.proc.stderr):
            with contextlib.suppress(OSError):
                if f is not None:
                    f.close()


class _Reader(_GitPipe):
    """`git cat-file --batch`: any object by name, its id and its bytes."""

    def __init__(self, root: Path):
        super().__init__(root, "cat-file", "--batch")

    def object(self, what: str) -> tuple[str, bytes, bytes]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        with self.lock:
            try:
                self.proc.stdin.write(what.encode("utf-8") + b"\n")
                self.proc.stdin.flush()
                header = self.proc.stdout.readline().split()
            except OSError:
                header = []
            if len(header) != 3:  # "<name> missing", or cat-file ended
                raise GitError(f"git cat-file {what}: {b' '.join(header).decode() or 'ended'}")
            data = self.proc.stdout.read(int(header[2]))
            self.proc.stdout.read(1)  # the newline after the object
            return header[0].decode(), header[1], data


class _RefWriter(_GitPipe):
    """`git update-ref --stdin`: a transaction per branch moved."""

    def __init__(self, root: Path):
        super().__init__(root, "update-ref", "--stdin")

    def point(self, ref: str, commit: str) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        with self.lock:
            try:
                self.proc.stdin.write(f"start\nupdate {ref} {commit}\ncommit\n".encode())
                self.proc.stdin.flush()
                said = [self.proc.stdout.readline(), self.proc.stdout.readline()]
            except OSError:
                said = []
            if said != [b"start: ok\n", b"commit: ok\n"]:
                why = b"".join(said).decode("utf-8", "replace")
                if self.proc.poll() is not None or not said:  # git said why, then ended
                    assert self.proc.stderr is not None
                    why += self.proc.stderr.read().decode("utf-8", "replace")
                raise GitError(f"git update-ref {ref} {commit}: {why.strip()}")


class _Plumbing:
    """The git processes a check talks to instead of starting its own: it reads objects,
    writes blobs, trees and commits, and moves branches, each through one long-lived
    process, so a check starts one process (`git apply`) where it started three."""

    def __init__(self, root: Path):
        self.reader = _Reader(root)
        self.blobs = _GitPipe(root, "hash-object", "-w", "--no-filters", "--stdin-paths")
        self.trees = _GitPipe(root, "mktree", "-z", "--batch")
        self.commits = _GitPipe(root, "hash-object", "-w", "-t", "commit", "--stdin-paths")
        self.refs = _RefWriter(root)
        self._all = (self.reader, self.blobs, self.trees, self.commits, self.refs)
        self._closer = weakref.finalize(self, _close_all, self._all)

    def object(self, what: str) -> tuple[str, bytes, bytes]:
        return self.reader.object(what)

    def read(self, what: str, kind: bytes) -> bytes:
        oid, got, data = self.reader.object(what)
        if got != kind:
            raise GitError(f"git cat-file {what}: a {got.decode()}, not a {kind.decode()}")
        return data

    def alive(self) -> bool:
        return all(p.alive() for p in self._all)

    def close(self) -> None:
        self._closer()


def _close_all(pipes: tuple[_GitPipe, ...]) -> None:
    for pipe in pipes:
        pipe.close()


def _worker_ready(ready: Any) -> None:
    """A check pool worker's first act. Unpickling this function imported this module, and
    with it everything a check runs; the worker says so. It also starts watching its parent:
    a worker whose controller was killed (kill -9 skips every shutdown) would otherwise wait
    on its queue for ever, with the git processes of its labs."""
    parent = os.getppid()

    def orphaned() -> None:
        while os.getppid() == parent:
            time.sleep(WORKER_PARENT_POLL_SECONDS)
        os._exit(0)

    threading.Thread(target=orphaned, daemon=True, name="parent-watch").start()
    ready.release()


def _check_in_worker(root: str, lab: LabSpec, name: str,
                     spec: ExperimentSpec) -> tuple[Candidate, str]:
    repo = _WORKER_REPOS.pop(root, None) or LabRepo(root, lab)
    _WORKER_REPOS[root] = repo
    while len(_WORKER_REPOS) > _WORKER_REPOS_MAX:  # a long test session sees many labs
        _WORKER_REPOS.pop(next(iter(_WORKER_REPOS))).close()
    repo.lab = lab  # as the engine's repo (`Engine.set_lab`)
    return repo.check(name, spec)


class CheckPool:
    """Worker processes that run `LabRepo.check` for many candidates at once.

    A check is a git subprocess (free to overlap) and Python's compile and AST hash
    of what changed (a few ms of CPU that holds the GIL; the whole file's, ~10 ms, on a
    worker's first check), so threads would run the Python half one at a time:
    processes use every core. They start on the first check (spawned: the
    operator's process has threads, which fork does not mix with) and serve every
    lab of this process. `executor` puts threads in their place (a test's: they run the
    caller's `LabRepo.check`); `task` is what runs a check in a process (a benchmark
    times it).
    """

    def __init__(self, workers: int = CHECK_WORKERS, executor: Executor | None = None,
                 task: Callable[[str, LabSpec, str, ExperimentSpec],
                                tuple[Candidate, str]] = _check_in_worker):
        self.workers = workers
        self.task = task
        self._executor = executor
        self._own = executor is None
        self._lock = threading.Lock()
        self._ready: Any = None  # released once by each worker that has started (own pool)
        self._workers_ready = 0  # how many of those start() has seen

    def _started(self) -> Executor:
        with self._lock:
            if self._executor is None:
                context = multiprocessing.get_context("spawn")
                self._ready, self._workers_ready = context.Semaphore(0), 0
                self._executor = ProcessPoolExecutor(
                    self.workers, mp_context=context, initializer=_worker_ready,
                    initargs=(self._ready,))
            return self._executor

    def start(self, wait: float = 0.0) -> bool:
        """Start every worker now, not on the first checks; with `wait`, wait up to that many
        seconds until each has started and imported what a check runs (a spawned process
        imports its parent's main module too). False if some had not by then."""
        executor = self._started()
        if self._ready is None or self._workers_ready >= self.workers:
            return True
        for _ in range(self.workers):  # a worker is spawned per task while none is idle
            with contextlib.suppress(BrokenExecutor, RuntimeError):
                executor.submit(int)
        deadline = time.monotonic() + wait
        while self._workers_ready < self.workers:
            if not self._ready.acquire(timeout=max(0.0, deadline - time.monotonic())):
                return False
            self._workers_ready += 1
        return True

    def submit(self, repo: LabRepo, name: str, spec: ExperimentSpec) -> Future:
        """Start the check of `name`; its future gives what `LabRepo.check` returns."""
        executor = self._started()
        try:
            if not self._own:  # threads (a test's): the caller's repo itself
                return executor.submit(repo.check, name, spec)
            return executor.submit(self.task, str(repo.root), repo.lab, name, spec)
        except (BrokenExecutor, RuntimeError):  # a worker died (or the pool was shut down)
            if self._own:
                with self._lock:
                    if self._executor is executor:
                        self._executor = None  # the next check starts a new pool
            future: Future = Future()
            try:
                future.set_result(repo.check(name, spec))
            except Exception as e:
                future.set_exception(e)
            return future

    def shutdown(self) -> None:
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)


_SHARED: CheckPool | None = None
_SHARED_LOCK = threading.Lock()


def shared_check_pool() -> CheckPool:
    """The process's one pool of checking processes (started on its first check)."""
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None:
            _SHARED = CheckPool()
        return _SHARED


def _stripspace(message: str) -> str:
    """What `git commit -m` stores (`git stripspace`): trailing whitespace off every line,
    runs of blank lines made one, none at either end, a newline at the end."""
    out: list[str] = []
    for line in message.split("\n"):
        line = line.rstrip(" \t\n\r")  # git's isspace(): not \v or \f
        if line or (out and out[-1]):
            out.append(line)
    while out and not out[-1]:
        out.pop()
    return "\n".join(out) + "\n" if out else ""


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


def _fixed(min_delta: float | str) -> float:
    return 0.0 if min_delta == "auto" else float(min_delta)


def recorded_duplicate(repo: LabRepo, ledger, name: str, c: Candidate) -> str | None:
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
