"""The check pool: worker processes that check many candidates at once.

A check (`LabRepo.check`) is a git subprocess (free to overlap) and Python's compile and AST
hash of what changed (a few ms of CPU that holds the GIL; the whole file's, ~10 ms, on a
worker's first check), so threads would run the Python half one at a time: processes use
every core. They start on the first check (spawned: the operator's process has threads, which
fork does not mix with) and serve every lab of this process; each worker keeps a `LabRepo`,
with its long-lived git processes, for the last few labs it checked. A worker watches its
parent and ends when the controller is gone (kill -9 skips every shutdown).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import threading
import time
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool as BrokenExecutor
from typing import Any, Callable

from controller.core.reconcile import Candidate
from controller.core.spec import ExperimentSpec, LabSpec
from controller.lab.repo import LabRepo

CHECK_WORKERS = max(1, min(8, os.cpu_count() or 1))  # processes checking candidates at once
WORKER_PARENT_POLL_SECONDS = 1.0  # how often a check worker looks whether its controller is still there
_WORKER_REPOS: dict[str, LabRepo] = {}  # in a worker: the labs it checked last, newest last
_WORKER_REPOS_MAX = 8


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

    `executor` puts threads in their place (a test's: they run the caller's
    `LabRepo.check`); `task` is what runs a check in a process (a benchmark times it).
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
