"""The ledger: `research/results.tsv`, one row per finished experiment, append-only.

The columns are the seed ledger's, in its order, so existing autoresearch
parsers keep reading it; Autolab's own columns come after them. The ledger is
never rewritten: a promotion is known when the row is written, because the row
is appended after the compare-and-swap on the master.

Each run id is written at most once, however many writers try it at the same
time and however often a crashed or restarted controller retries: threads
sharing one `Ledger`, threads each with their own, and other processes on the
same host. `append` takes a thread lock per ledger path (this process's
threads, whichever object they use) and then an exclusive `flock` on
`results.tsv.lock` (other processes), re-reads what others appended, and only
then decides and writes: one `write` of one whole line, fsynced, before the
locks are let go.

Lookups (has this run been recorded? has this candidate been measured?) go
through an in-memory index that is extended with only the bytes appended since
the last look, so a check costs the same against ten rows or a hundred
thousand. The index is guarded by a thread lock of its own, so the threads
sharing one object see it whole, and it only takes complete lines: a line still
being written, or torn by a crash, is read once its newline is there.
"""

from __future__ import annotations

import fcntl
import os
import threading
import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from controller.core.errors import MachineError

SEED_COLUMNS = ("run_id created_at status job_id campaign experiment_id worker_id hypothesis "
                "parent_hash candidate_hash val_bpb training_seconds total_seconds peak_vram_mb "
                "mfu_percent promoted comment").split()
# self_reported (last): the row's figures that are the candidate's word (controller.core.figures).
EXTRA_COLUMNS = "semantic_hash outcome delta rebased_from duplicate_of backend reason self_reported".split()
COLUMNS = SEED_COLUMNS + EXTRA_COLUMNS

# Rows whose candidate counts as measured: a repeat of one of these is a duplicate.
# Infrastructure errors and cancellations measured nothing, so they may be tried again.
MEASURED = {"succeeded", "failed", "baseline"}

# One thread lock per ledger path, shared by every Ledger object of this process on it:
# the threads of a process take turns on it before they take the flock, so excluding
# them never rests on how a filesystem implements flock (over NFS it becomes a POSIX
# lock, which belongs to the process and would let its threads in together).
_PATH_LOCKS: dict[str, threading.Lock] = {}
_PATH_LOCKS_GUARD = threading.Lock()
# Ledgers of this process: a child forked while another thread held one's thread lock
# gets a fresh lock and a fresh index (that thread does not exist in the child, and may
# have left the index half updated).
_LEDGERS: "weakref.WeakSet[Ledger]" = weakref.WeakSet()


def _path_lock(key: str) -> threading.Lock:
    with _PATH_LOCKS_GUARD:
        return _PATH_LOCKS.setdefault(key, threading.Lock())


def _after_fork_in_child() -> None:
    # Only the forking thread exists in the child: locks other threads held stay held.
    global _PATH_LOCKS_GUARD
    _PATH_LOCKS_GUARD = threading.Lock()
    _PATH_LOCKS.clear()
    for ledger in list(_LEDGERS):
        if ledger._mutex.acquire(blocking=False):
            ledger._mutex.release()
        else:
            ledger._mutex = threading.RLock()
            ledger._reset_index()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class LedgerError(MachineError, RuntimeError):
    """The ledger file cannot be read or written as a ledger (a hand edit, a cut-short copy)."""


def _clean(value: object) -> str:
    return str(value if value is not None else "").replace("\t", " ").replace("\r", " ") \
        .replace("\n", " ")


class Ledger:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._lock_path = str(self.path) + ".lock"
        self._lock_key = os.path.realpath(self._lock_path)
        # Guards the in-memory index against the threads sharing this object.
        self._mutex = threading.RLock()
        self._reset_index()
        _LEDGERS.add(self)

    def _reset_index(self) -> None:
        self._offset = 0
        self._header: list[str] | None = None
        self._rows: list[dict] = []
        self._run_ids: set[str] = set()
        self._names: dict[str, str] = {}  # experiment_id -> where it was first recorded
        self._by_hash: dict[str, str] = {}
        self._by_semantic: dict[str, str] = {}

    # -- reading -------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Index whatever was appended since the last look (complete lines only)."""
        with self._mutex:
            try:
                size = os.stat(self.path).st_size
            except FileNotFoundError:
                return
            if size == self._offset:
                return  # nothing appended since the last look
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
            end = data.rfind(b"\n")
            if end < 0:
                return  # only part of a line so far: its writer has not finished it
            header = self._header
            rows = []
            for raw in data[: end + 1].decode("utf-8", errors="replace").split("\n")[:-1]:
                fields = raw.split("\t")
                if header is None:
                    unknown = [c for c, ours in zip(fields, COLUMNS) if c != ours]
                    if unknown or len(fields) > len(COLUMNS):
                        raise LedgerError(
                            f"{self.path}: header does not match the ledger columns "
                            f"({' '.join(COLUMNS)}); keep the seed's columns in order "
                            "and add new ones only at the end")
                    header = fields
                    continue
                if not raw.strip():
                    continue
                rows.append(dict(zip(header if len(fields) <= len(header) else COLUMNS, fields)))
            # Parsed first, committed together: the offset never runs ahead of the index.
            self._header = header
            for row in rows:
                self._index(row)
            self._offset += end + 1

    def _index(self, row: dict) -> None:
        self._rows.append(row)
        self._run_ids.add(row.get("run_id", ""))
        self._names.setdefault(row.get("experiment_id", ""),
                               f"ledger run {row.get('run_id')}, {row.get('status') or 'recorded'}")
        if row.get("status") in MEASURED:
            h, s = row.get("candidate_hash"), row.get("semantic_hash")
            name = row.get("experiment_id", "")
            if h:
                self._by_hash.setdefault(h, name)
            if s:
                self._by_semantic.setdefault(s, name)

    def rows(self) -> list[dict]:
        with self._mutex:
            self.refresh()
            return list(self._rows)

    def name_recorded(self, name: str) -> str | None:
        """Where experiment `name` was recorded first ("ledger run <id>, <status>"), if it was:
        names are permanent once the ledger has a row of theirs, as run ids and experiment
        branches are named after them."""
        with self._mutex:
            self.refresh()
            return self._names.get(name) if name else None

    def has_run(self, run_id: str) -> bool:
        with self._mutex:
            self.refresh()
            return run_id in self._run_ids

    def measured(self, candidate_hash: str | None, semantic: str | None) -> str | None:
        """The experiment that already measured this candidate, exactly or semantically."""
        with self._mutex:
            self.refresh()
            if candidate_hash and candidate_hash in self._by_hash:
                return self._by_hash[candidate_hash]
            if semantic and semantic in self._by_semantic:
                return self._by_semantic[semantic]
            return None

    # -- writing -------------------------------------------------------------------------------
    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        """An exclusive flock on the lock file, on a descriptor opened for this one hold."""
        fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                # Unlocked explicitly, not by the close: a child forked meanwhile holds a
                # copy of this descriptor, which would keep the lock until it exited.
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def append(self, row: dict) -> bool:
        """Append one row unless its run id is recorded already. Returns True if written."""
        unknown = set(row) - set(COLUMNS)
        if unknown:
            raise LedgerError(f"unknown ledger columns: {sorted(unknown)}")
        line = ("\t".join(_clean(row.get(c, "")) for c in COLUMNS) + "\n").encode("utf-8")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # This process's threads, then other processes: from here until the row is on disk
        # nobody else appends, so what the index says after this refresh is the whole file.
        with _path_lock(self._lock_key), self._exclusive():
            with self._mutex:
                self.refresh()
                if _clean(row["run_id"]) in self._run_ids:
                    return False
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                size = os.fstat(fd).st_size
                if size == 0:
                    line = ("\t".join(COLUMNS) + "\n").encode() + line
                elif os.pread(fd, 1, size - 1) != b"\n":
                    line = b"\n" + line  # a torn last line from a crash: end it
                view = memoryview(line)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            self.refresh()
            return True
