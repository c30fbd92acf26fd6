"""The ledger: `research/results.tsv`, one row per finished experiment, append-only.

The columns are the seed ledger's, in its order, so existing autoresearch
parsers keep reading it; Autolab's own columns come after them. Rows are only
ever appended, under a file lock, one `write` of one whole line each, and a
run id is written once however often a crashed controller retries. The ledger
is never rewritten: a promotion is known when the row is written, because the
row is appended after the compare-and-swap on the master.

Lookups (has this run been recorded? has this candidate been measured?) go
through an in-memory index that is extended with only the bytes appended since
the last look, so a check costs the same against ten rows or a hundred
thousand.
"""

from __future__ import annotations

import os
from pathlib import Path

from filelock import FileLock

SEED_COLUMNS = ("run_id created_at status job_id campaign experiment_id worker_id hypothesis "
                "parent_hash candidate_hash val_bpb training_seconds total_seconds peak_vram_mb "
                "mfu_percent promoted comment").split()
EXTRA_COLUMNS = "semantic_hash outcome delta rebased_from duplicate_of backend reason".split()
COLUMNS = SEED_COLUMNS + EXTRA_COLUMNS

# Rows whose candidate counts as measured: a repeat of one of these is a duplicate.
# Infrastructure errors and cancellations measured nothing, so they may be tried again.
MEASURED = {"succeeded", "failed", "baseline"}


class LedgerError(RuntimeError):
    pass


def _clean(value: object) -> str:
    return str(value if value is not None else "").replace("\t", " ").replace("\r", " ") \
        .replace("\n", " ")


class Ledger:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._lock = FileLock(str(self.path) + ".lock")
        self._offset = 0
        self._header: list[str] | None = None
        self._rows: list[dict] = []
        self._run_ids: set[str] = set()
        self._by_hash: dict[str, str] = {}
        self._by_semantic: dict[str, str] = {}

    # -- reading -------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Index whatever was appended since the last look."""
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
            return
        chunk, self._offset = data[: end + 1], self._offset + end + 1
        for raw in chunk.decode("utf-8", errors="replace").split("\n")[:-1]:
            fields = raw.split("\t")
            if self._header is None:
                self._header = fields
                unknown = [c for c, ours in zip(fields, COLUMNS) if c != ours]
                if unknown or len(fields) > len(COLUMNS):
                    raise LedgerError(f"{self.path}: header does not match the ledger columns "
                                      f"({' '.join(COLUMNS)}); keep the seed's columns in order "
                                      "and add new ones only at the end")
                continue
            if not raw.strip():
                continue
            row = dict(zip(self._header if len(fields) <= len(self._header) else COLUMNS,
                           fields))
            self._index(row)

    def _index(self, row: dict) -> None:
        self._rows.append(row)
        self._run_ids.add(row.get("run_id", ""))
        if row.get("status") in MEASURED:
            h, s = row.get("candidate_hash"), row.get("semantic_hash")
            name = row.get("experiment_id", "")
            if h:
                self._by_hash.setdefault(h, name)
            if s:
                self._by_semantic.setdefault(s, name)

    def rows(self) -> list[dict]:
        self.refresh()
        return list(self._rows)

    def has_run(self, run_id: str) -> bool:
        self.refresh()
        return run_id in self._run_ids

    def measured(self, candidate_hash: str | None, semantic: str | None) -> str | None:
        """The experiment that already measured this candidate, exactly or semantically."""
        self.refresh()
        if candidate_hash and candidate_hash in self._by_hash:
            return self._by_hash[candidate_hash]
        if semantic and semantic in self._by_semantic:
            return self._by_semantic[semantic]
        return None

    # -- writing -------------------------------------------------------------------------------
    def append(self, row: dict) -> bool:
        """Append one row unless its run id is recorded already. Returns True if written."""
        unknown = set(row) - set(COLUMNS)
        if unknown:
            raise LedgerError(f"unknown ledger columns: {sorted(unknown)}")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._lock:
            self.refresh()
            if row["run_id"] in self._run_ids:
                return False
            line = "\t".join(_clean(row.get(c, "")) for c in COLUMNS) + "\n"
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                if os.fstat(fd).st_size == 0:
                    os.write(fd, ("\t".join(COLUMNS) + "\n").encode())
                else:
                    with open(self.path, "rb") as f:
                        f.seek(-1, os.SEEK_END)
                        if f.read(1) != b"\n":  # a torn last line from a crash: end it
                            os.write(fd, b"\n")
                os.write(fd, line.encode("utf-8"))
                os.fsync(fd)
            finally:
                os.close(fd)
            self.refresh()
            return True
