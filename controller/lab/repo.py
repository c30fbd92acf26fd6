"""The lab repo: git branches for candidates, the master and its history.

Every experiment is materialised without a worktree, in git's object store:
its diff is applied by `git apply --cached` to a temporary index holding the
master it was written against (arguments as a list, the diff on stdin: no
shell ever sees a user's string), and committed (`commit-tree`) with the
hypothesis as the message and trailers naming the experiment, campaign and
parent. If the master moved on, that commit is rebased onto the current
master as cherry-pick would (`git merge-tree --write-tree`, a three-way merge
based on the parent): a clean merge rebases it, a conflict refuses it with
the failing hunk. The candidate's bytes are read from the commit; the commit
stays on branch `autolab/exp/<name>` (the experiment DAG), and a marker
`.autolab/candidates/<name>` says that a cleanup is owed until the run ends.
No check shares a file with another, so many run at once (`CheckPool`: the
engine's pool of checking processes), and none checks out files: a check is
three short git processes in a pool's worker (apply, write-tree,
commit-tree; it reads blobs and moves branches through a `cat-file --batch`
and an `update-ref --stdin` that live as long as it does) where `git worktree add`/`remove` alone took ~30
ms (issue 15).

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
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool as BrokenExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from filelock import FileLock

from controller.core.diffs import DiffRefused, parse_surface_diff
from controller.core.hashing import (candidate_hash, check_candidate_source, compile_source,
                                     semantic_hash)
from controller.core.reconcile import Candidate, Master, PromotionResult, promotion_refused
from controller.core.spec import ExperimentSpec, LabSpec, SpecError
from controller.lab.paths import LabPaths

MASTER_BRANCH = "autolab/master"
GIT_ID = ["-c", "user.name=autolab", "-c", "user.email=autolab@localhost",
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
        self._indexes: dict[str, bytes] = {}  # commit -> an index of its tree (see _index_of)
        self._reader: _BlobReader | None = None  # a check pool's worker reads through one,
        self._refs: _RefWriter | None = None      # and moves branches through one

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
                      val_bpb=d.get("val_bpb"), experiment=d.get("experiment"))

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

    def set_master_metric(self, val_bpb: float) -> None:
        with self._master_lock:
            d = self.master_doc()
            if d.get("val_bpb") is not None:
                return
            d["val_bpb"] = val_bpb
            for h in d["history"]:
                if h["hash"] == d["hash"] and h.get("val_bpb") is None:
                    h["val_bpb"] = val_bpb
            atomic_write(self.master_file, json.dumps(d, indent=2) + "\n")

    def promote(self, name: str, commit: str, val_bpb: float, hashes: tuple[str, str],
                parent: str, now: str, margin: float | None = None,
                against: float | None = None) -> PromotionResult:
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
                     "promotedAt": now}
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

    def _index_of(self, commit: str) -> bytes:
        """A git index holding `commit`'s tree (read once per commit, then copied)."""
        index = self._indexes.get(commit)
        if index is None:
            with tempfile.TemporaryDirectory(prefix="autolab-index-") as d:
                path = os.path.join(d, "index")
                self.git_bytes("read-tree", commit, env={**os.environ, "GIT_INDEX_FILE": path})
                index = Path(path).read_bytes()
            self._indexes[commit] = index
        return index

    def _commit(self, tree: str, parent: str, message: str) -> str:
        # `git commit -m` cleans the message up this way (cleanup=whitespace); commit-tree not.
        return self.git_bytes("commit-tree", tree, "-p", parent, "-F", "-",
                              input=_stripspace(message).encode("utf-8")).stdout.decode().strip()

    def _blob(self, tree: str) -> bytes:
        if self._reader is not None:
            return self._reader.read(f"{tree}:{self.lab.surface}")
        return self.git_bytes("cat-file", "blob", f"{tree}:{self.lab.surface}").stdout

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
        with tempfile.TemporaryDirectory(prefix="autolab-check-") as d:
            index = os.path.join(d, "index")
            Path(index).write_bytes(self._index_of(parent["commit"]))
            env = {**os.environ, "GIT_INDEX_FILE": index}
            # Zero-context hunks are well-formed (`diff -U0`); git applies them only when told.
            zero = ["--unidiff-zero"] if diff.zero_context else []
            applied = self.git_bytes("apply", "--cached", "--whitespace=nowarn", *zero, "-",
                                     input=diff.text.encode("utf-8"), env=env, check=False)
            if applied.returncode != 0:
                why = applied.stderr.decode("utf-8", "replace").strip()
                why = why.replace("error: ", "").replace("\n", "; ")
                return Candidate(refusal="Invalid", reason="DiffDoesNotApply",
                                 message=_does_not_apply(parent, master, surface, why)), \
                    master.commit
            tree = self.git_bytes("write-tree", env=env).stdout.decode().strip()
        trailers = (f"\n\nAutolab-Experiment: {name}\nAutolab-Campaign: {spec.campaign or '-'}"
                    f"\nAutolab-Parent: {parent['hash']}")
        commit = self._commit(tree, parent["commit"], spec.hypothesis + trailers)
        rebased_from = None
        base = parent
        if parent["commit"] != master.commit:
            tree, hunk = self._rebase(commit, parent["commit"], master.commit)
            if tree is None:
                msg = (f"diff was written against {parent['hash'][:12]} and conflicts with the "
                       f"current master {master.hash[:12]} ({master.experiment or 'seed'}):\n"
                       f"{hunk}\nrewrite the change against the current master")
                return Candidate(refusal="Conflict", reason="RebaseConflict", message=msg), \
                    master.commit
            rebased_from = parent["hash"]
            base = {"hash": master.hash}
            # A change the master already holds rebases to the master's own tree: kept, so the
            # candidate is the master itself and the duplicate check says so (not a conflict).
            commit = self._commit(tree, master.commit, spec.hypothesis
                                  + trailers.replace(parent["hash"], master.hash)
                                  + f"\nAutolab-Rebased-From: {parent['hash']}")
        raw = self._blob(tree)
        refused = check_candidate_source(raw, surface)  # what Python runs is what we hash
        if refused is not None:
            return Candidate(refusal="Invalid", reason=refused.reason,
                             message=refused.message), master.commit
        source = raw.decode("utf-8")
        try:  # the text compiles as `python` compiles it; only what changed is parsed again
            compile_source(source, surface)
            sem = semantic_hash(source)
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
        if self._refs is not None:
            self._refs.point(f"refs/heads/autolab/exp/{name}", commit)
        else:
            self.git("branch", "-f", f"autolab/exp/{name}", commit)
        return Candidate(candidate_hash=candidate_hash(source), semantic_hash=sem,
                         parent_hash=base["hash"], rebased_from=rebased_from, commit=commit,
                         changed_lines=len(diff.added) + len(diff.removed)), master.commit

    def _rebase(self, commit: str, parent: str, master: str) -> tuple[str | None, str]:
        """The tree of `commit` cherry-picked onto `master`; (None, the hunk) on a conflict.

        A three-way merge in git's object store (`git merge-tree --write-tree`), as
        cherry-pick makes it: base `parent`, ours the master, theirs the candidate. git
        2.39 has no --merge-base, so the master's tree goes on a commit whose parent is
        `parent`, which makes `parent` the merge base whatever the history between them.
        """
        ours = self._commit(f"{master}^{{tree}}", parent, "the current master, for a rebase")
        merged = self.git_bytes("merge-tree", "--write-tree", ours, commit, check=False)
        tree = merged.stdout.decode("utf-8", "replace").split("\n", 1)[0].strip()
        if merged.returncode == 0:
            return tree, ""
        text = None
        if merged.returncode == 1 and tree:
            shown = self.git_bytes("cat-file", "blob", f"{tree}:{self.lab.surface}", check=False)
            if shown.returncode == 0:
                text = shown.stdout.decode("utf-8", "replace")
        return None, _conflict_hunk(text)

    def cleanup(self, name: str, keep_branch: bool) -> None:
        self._remove_worktree(name)
        if not keep_branch:
            self.git("branch", "-D", f"autolab/exp/{name}", check=False)

    def candidate_source(self, name: str) -> str:
        return self.source_of(f"autolab/exp/{name}")

    def source_of(self, commit: str) -> str:
        """The surface file as it is in `commit` (a master's, for its confirm runs)."""
        return self.git("show", f"{commit}:{self.lab.surface}").stdout


# -- the checks of many candidates at once ---------------------------------------------------------

CHECK_WORKERS = max(1, min(8, os.cpu_count() or 1))  # processes checking candidates at once
_WORKER_REPOS: dict[str, LabRepo] = {}  # in a worker: the labs it checked last, newest last
_WORKER_REPOS_MAX = 8


class _BlobReader:
    """One `git cat-file --batch` for the life of a worker: a blob without a process each."""

    def __init__(self, root: Path):
        self.proc = subprocess.Popen(["git", *GIT_ID, "cat-file", "--batch"], cwd=root,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL)
        self.lock = threading.Lock()

    def read(self, what: str) -> bytes:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        with self.lock:
            self.proc.stdin.write(what.encode("utf-8") + b"\n")
            self.proc.stdin.flush()
            header = self.proc.stdout.readline().split()
            if len(header) != 3 or header[1] != b"blob":
                raise GitError(f"git cat-file blob {what}: {b' '.join(header).decode()}")
            data = self.proc.stdout.read(int(header[2]))
            self.proc.stdout.read(1)  # the newline after the object
            return data

    def close(self) -> None:
        with contextlib.suppress(OSError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()  # cat-file ends at the end of its input
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)


class _RefWriter:
    """One `git update-ref --stdin` for the life of a worker: a transaction per branch moved."""

    def __init__(self, root: Path):
        self.proc = subprocess.Popen(["git", *GIT_ID, "update-ref", "--stdin"], cwd=root,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE)
        self.lock = threading.Lock()

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

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        with contextlib.suppress(OSError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)


def _worker_ready(ready: Any) -> None:
    """A check pool worker's first act. Unpickling this function imported this module, and
    with it everything a check runs; the worker says so."""
    ready.release()


def _check_in_worker(root: str, lab: LabSpec, name: str,
                     spec: ExperimentSpec) -> tuple[Candidate, str]:
    repo = _WORKER_REPOS.pop(root, None)
    if repo is None:
        repo = LabRepo(root, lab)
        repo._reader = _BlobReader(repo.root)
    if repo._refs is None or not repo._refs.alive():  # one that failed has ended: anew
        repo._refs = _RefWriter(repo.root)
    _WORKER_REPOS[root] = repo
    while len(_WORKER_REPOS) > _WORKER_REPOS_MAX:  # a long test session sees many labs
        old = _WORKER_REPOS.pop(next(iter(_WORKER_REPOS)))
        for helper in (old._reader, old._refs):
            if helper is not None:
                helper.close()
    repo.lab = lab  # as the engine's repo (`Engine.set_lab`)
    return repo.check(name, spec)


class CheckPool:
    """Worker processes that run `LabRepo.check` for many candidates at once.

    A check is git subprocesses (free to overlap) and Python's compile and AST hash
    (~20 ms of CPU that holds the GIL), so threads would run the Python half one at a
    time: processes use every core. They start on the first check (spawned: the
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
