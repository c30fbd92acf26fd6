"""The ledger keeps the seed's columns, only grows, and records a run once."""

from __future__ import annotations

import multiprocessing as mp
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from controller.lab.ledger import COLUMNS, SEED_COLUMNS, Ledger, LedgerError


def row(run_id, status="succeeded", h="", s="", exp=None, **kw):
    return {"run_id": run_id, "status": status, "candidate_hash": h, "semantic_hash": s,
            "experiment_id": exp or run_id, **kw}


def test_header_starts_with_the_seed_columns_in_order(tmp_path):
    led = Ledger(tmp_path / "results.tsv")
    led.append(row("exp-a-1", hypothesis="tabs\tand\nnewlines stay on one line"))
    header, line = (tmp_path / "results.tsv").read_text().splitlines()
    assert header.split("\t")[: len(SEED_COLUMNS)] == SEED_COLUMNS
    assert header.split("\t") == COLUMNS
    assert len(line.split("\t")) == len(COLUMNS)
    assert "tabs and newlines stay on one line" in line


def test_a_run_is_recorded_once_and_nothing_is_rewritten(tmp_path):
    led = Ledger(tmp_path / "results.tsv")
    assert led.append(row("exp-a-1"))
    before = (tmp_path / "results.tsv").read_bytes()
    assert not led.append(row("exp-a-1", comment="a retry after a crash"))
    assert not Ledger(tmp_path / "results.tsv").append(row("exp-a-1"))
    assert led.append(row("exp-b-1"))
    after = (tmp_path / "results.tsv").read_bytes()
    assert after.startswith(before)
    assert [r["run_id"] for r in Ledger(tmp_path / "results.tsv").rows()] == ["exp-a-1", "exp-b-1"]


def _append_many(path, k):
    led = Ledger(path)
    for i in range(50):
        led.append(row(f"exp-{i}-1"))  # every process tries the same ids


def test_concurrent_writers_never_duplicate_or_tear_rows(tmp_path):
    path = tmp_path / "results.tsv"
    procs = [mp.get_context("fork").Process(target=_append_many, args=(path, k)) for k in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    rows = Ledger(path).rows()
    assert sorted(r["run_id"] for r in rows) == sorted(f"exp-{i}-1" for i in range(50))
    assert all(len(line.split("\t")) == len(COLUMNS) for line in path.read_text().splitlines())


def test_measured_candidates_are_found_through_the_index(tmp_path):
    led = Ledger(tmp_path / "results.tsv")
    led.append(row("exp-a-1", h="h1", s="s1", exp="a"))
    led.append(row("exp-b-1", status="error", h="h2", s="s2", exp="b"))
    led.append(row("exp-c-1", status="cancelled", h="h3", s="s3", exp="c"))
    assert led.measured("h1", None) == "a" and led.measured(None, "s1") == "a"
    assert led.measured("h2", "s2") is None, "an infrastructure error measured nothing"
    assert led.measured("h3", "s3") is None, "a cancelled run measured nothing"
    other = Ledger(tmp_path / "results.tsv")
    other.append(row("exp-d-1", h="h4", s="s4", exp="d"))
    assert led.measured("h4", None) == "d", "rows appended elsewhere are picked up"


def test_a_torn_last_line_is_closed_before_the_next_row(tmp_path):
    path = tmp_path / "results.tsv"
    Ledger(path).append(row("exp-a-1"))
    with open(path, "a") as f:
        f.write("exp-torn-1\t2026")  # a writer killed mid-line
    led = Ledger(path)
    led.append(row("exp-b-1"))
    lines = path.read_text().splitlines()
    assert lines[-1].startswith("exp-b-1\t")
    assert led.has_run("exp-b-1") and led.has_run("exp-a-1")


def test_a_line_still_being_written_is_indexed_once_complete(tmp_path):
    path = tmp_path / "results.tsv"
    led = Ledger(path)
    led.append(row("exp-a-1"))
    line = "\t".join(row("exp-b-1").get(c, "") for c in COLUMNS) + "\n"
    with open(path, "a") as f:
        f.write(line[:10])  # another writer's line, half there
        f.flush()
        assert not led.has_run("exp-b-1") and len(led.rows()) == 1
        f.write(line[10:])
    assert led.has_run("exp-b-1")
    assert [r["run_id"] for r in led.rows()] == ["exp-a-1", "exp-b-1"]


def test_a_ledger_with_foreign_columns_is_refused(tmp_path):
    path = tmp_path / "results.tsv"
    path.write_text("when\twhat\n")
    with pytest.raises(LedgerError, match="keep the seed's columns in order"):
        Ledger(path).rows()


def test_a_seed_ledger_is_extended_not_rewritten(tmp_path):
    path = tmp_path / "results.tsv"
    seed = "\t".join(SEED_COLUMNS) + "\n" + "\t".join(["old-1"] + [""] * 16) + "\n"
    path.write_text(seed)
    led = Ledger(path)
    led.append(row("exp-new-1"))
    assert path.read_text().startswith(seed)
    assert [r["run_id"] for r in led.rows()] == ["old-1", "exp-new-1"]


def test_threads_and_a_second_process_resuming_at_once_write_each_run_once(tmp_path):
    """A restarted controller's resume passes, all at once: threads sharing the operator's
    Ledger (and one more only looking things up on it), threads with Ledgers of their own
    and a second process all record the same runs, and some of their own. In each of 200
    fresh ledgers every run must be written once, the header once."""
    trials, resume = 200, [f"exp-resume{i}-1" for i in range(8)]
    header = "\t".join(COLUMNS)
    # One second process for all the trials, told each one's ledger over a pipe.
    helper = subprocess.Popen([sys.executable, str(Path(__file__).with_name("ledger_writer.py"))],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    bad, errors = [], []
    try:
        for trial in range(trials):
            path = tmp_path / f"trial{trial}" / "results.tsv"
            shared = Ledger(path)
            writers = [(shared, f"shared{k}") for k in range(6)] + [(None, f"own{k}") for k in range(2)]
            barrier = threading.Barrier(len(writers) + 2)  # the writers, the reader, this thread
            finished = threading.Event()
            expected = list(resume)

            def ids_for(tag, k):
                own = [f"exp-{tag}-{trial}-{j}" for j in range(2)]
                expected.extend(own)
                # Each writer starts the resume list somewhere else, so they meet on every id.
                return resume[k * 3 % len(resume):] + own + resume[: k * 3 % len(resume)]

            def write(ledger, ids):
                try:
                    ledger = ledger or Ledger(path)
                    barrier.wait(timeout=10)
                    for run_id in ids:
                        # A reconcile pass looks every run up before it records one.
                        [ledger.has_run(r) or ledger.measured(f"h-{r}", None) for r in resume]
                        ledger.append(row(run_id))
                except Exception as e:  # noqa: BLE001 - reported below
                    errors.append(f"trial {trial}: {type(e).__name__}: {e}")

            def look():
                barrier.wait(timeout=10)
                while not finished.is_set():
                    [shared.has_run(r) for r in resume]
                    time.sleep(0)

            threads = [threading.Thread(target=write, args=(led, ids_for(tag, k)))
                       for k, (led, tag) in enumerate(writers)]
            reader = threading.Thread(target=look)
            helper.stdin.write(f"{path}\t{' '.join(ids_for('proc', len(writers)))}\n")
            helper.stdin.flush()
            assert helper.stdout.readline() == "ready\n"
            for t in [*threads, reader]:
                t.start()
            helper.stdin.write("go\n")
            helper.stdin.flush()
            barrier.wait(timeout=10)
            for t in threads:
                t.join()
            finished.set()
            reader.join()
            assert (answer := helper.stdout.readline()) == "done\n", answer

            lines = path.read_text().splitlines()
            run_ids = [line.split("\t")[0] for line in lines[1:]]
            dupes = {r: run_ids.count(r) for r in set(run_ids) if run_ids.count(r) > 1}
            file_ok = (lines[0] == header and header not in lines[1:] and not dupes
                       and sorted(run_ids) == sorted(expected)
                       and all(len(line.split("\t")) == len(COLUMNS) for line in lines))
            index_ok = sorted(r["run_id"] for r in shared.rows()) == sorted(run_ids)
            if not (file_ok and index_ok):
                bad.append((trial, file_ok, dupes, lines.count(header), index_ok))
    finally:
        helper.stdin.close()
        helper.wait(timeout=10)
    assert not errors, errors[:3]
    assert not bad, (
        f"{sum(not b[1] for b in bad)} of {trials} trials left a bad file (a run written more "
        f"than once or not at all, or the header repeated), {sum(not b[4] for b in bad)} left "
        "the shared Ledger's rows() disagreeing with the file; first (trial, file ok, "
        f"{{run id: times written}}, headers, rows() ok): {bad[:3]}")
