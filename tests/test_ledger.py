"""The ledger keeps the seed's columns, only grows, and records a run once."""

from __future__ import annotations

import multiprocessing as mp

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
