"""The ledger keeps the seed's columns, only grows, and records a run once."""

from __future__ import annotations

import multiprocessing as mp
import subprocess
import sys
import threading
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
    Ledger, threads with Ledgers of their own and a second process all try the same runs
    (and some of their own). Every run must be in the file once, the header once."""
    trials, resume = 200, [f"exp-resume{i}-1" for i in range(8)]
    helper = subprocess.Popen([sys.executable, str(Path(__file__).with_name("ledger_writer.py"))],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    bad, errors = [], []
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # threads take turns often, so their races show in 200 trials
    try:
        for trial in range(trials):
            path = tmp_path / f"trial{trial}" / "results.tsv"
            shared = Ledger(path)
            writers = [(shared, f"shared{k}") for k in range(3)] + [(None, f"own{k}") for k in range(2)]
            barrier = threading.Barrier(len(writers) + 1)
            expected = list(resume)

            def ids_for(tag, k):
                own = [f"exp-{tag}-{trial}-{j}" for j in range(2)]
                expected.extend(own)
                # Each writer starts the resume list somewhere else, so they meet on every id.
                return resume[k * 3 % len(resume):] + own + resume[: k * 3 % len(resume)]

            def write(ledger, ids, look_first):
                try:
                    ledger = ledger or Ledger(path)
                    barrier.wait(timeout=10)
                    for run_id in ids:
                        if look_first:  # a reconcile pass looks at every run before it writes
                            [ledger.has_run(r) or ledger.measured(f"h-{r}", None) for r in resume]
                        ledger.append(row(run_id))
                except Exception as e:  # noqa: BLE001 - reported below
                    errors.append(f"trial {trial}: {type(e).__name__}: {e}")

            threads = [threading.Thread(target=write, args=(led, ids_for(tag, k), k != 1))
                       for k, (led, tag) in enumerate(writers)]
            helper.stdin.write(f"{path}\t{' '.join(ids_for('proc', len(writers)))}\n")
            helper.stdin.flush()
            assert helper.stdout.readline() == "ready\n"
            for t in threads:
                t.start()
            helper.stdin.write("go\n")
            helper.stdin.flush()
            barrier.wait(timeout=10)
            for t in threads:
                t.join()
            assert (answer := helper.stdout.readline()) == "done\n", answer

            lines = path.read_text().splitlines()
            run_ids = [line.split("\t")[0] for line in lines[1:]]
            dupes = {r: run_ids.count(r) for r in set(run_ids) if run_ids.count(r) > 1}
            if (lines[0] != "\t".join(COLUMNS) or "\t".join(COLUMNS) in lines[1:] or dupes
                    or sorted(run_ids) != sorted(expected)
                    or any(len(line.split("\t")) != len(COLUMNS) for line in lines)):
                bad.append((trial, dupes, lines.count("\t".join(COLUMNS))))
    finally:
        sys.setswitchinterval(switch)
        helper.stdin.close()
        helper.wait(timeout=10)
    assert not errors, errors[:3]
    assert not bad, (f"{len(bad)} of {trials} trials wrote a run more than once or lost one; "
                     f"first (trial, {{run id: times written}}, headers): {bad[:3]}")
