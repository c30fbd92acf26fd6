"""Whose word a figure is: the harness's measurement, or the candidate's own report.

A run records a handful of summary figures besides its metric: seconds, tokens, parameters,
depth, MFU, peak GPU memory, steps. The candidate `train.py` reports all of them in its
`stats.json`, and it is hostile code: it may write MFU 99.9 and a peak of 1 MB. So the run
harness (bench/run.py) measures what it can itself, out of the candidate's reach (MFU from the
tokens it served, the exported model's FLOPs, its own clock and the GPU's peak; GPU memory from
the driver; depth and parameters from the export), and lists in the result's `self_reported`
the figures it had to take from the candidate (the number of optimiser steps, always).

Such a figure is the candidate's word, and wherever the lab shows it, it says so:

    result["self_reported"]  ->  status.selfReported       (`autolab describe`, `get -o wide`)
                             ->  the ledger's last column  (`self_reported`, space-separated)
                             ->  the report, Trackio       (read from the ledger or the result)

`MARK` follows such a figure in a table; Trackio logs it under `self_reported/<name>`.

Records older than this module carry no list: a result without `self_reported`, a status
without `selfReported`, a ledger row written before the column. Their figures came from the
same `stats.json`, so they are read as the harness that wrote them worked (`LEGACY`). A row a
seed lab recorded (`autolab init --from`) is `SEED_IMPORTED`: there, train.py measured even
its own val_bpb.

Pure: no I/O; the front ends, the ledger rows and the report call it.
"""

from __future__ import annotations

from typing import Any, Iterable

# A run's summary figures, in the order train.py prints them and the harness's result carries
# them (bench/run.py's METRIC_KEYS, which runs without this package; tests/test_bench.py checks
# that the two agree). The first five are the ledger's columns.
SUMMARY_KEYS = ("val_bpb", "training_seconds", "total_seconds", "peak_vram_mb", "mfu_percent",
                "total_tokens_M", "num_steps", "num_params_M", "depth")
LEDGER_FIGURES = SUMMARY_KEYS[:5]
# The ledger's column (added after the seed's and Autolab's first ones) and the status field.
COLUMN = "self_reported"
STATUS_FIELD = "selfReported"
# What the harness took from the candidate's stats.json before it measured MFU and GPU memory.
LEGACY = ("peak_vram_mb", "mfu_percent", "num_steps", "depth")
# The seed lab's figures: its train.py printed them all, the metric too.
SEED_IMPORTED = LEDGER_FIGURES
MARK = "(candidate's)"
EXPLAINED = "the candidate's own figure; the harness did not measure it"
TRACKIO_PREFIX = "self_reported/"


def of_result(result: dict | None, metrics: dict[str, Any]) -> list[str]:
    """The keys of `metrics` (from this result) that are the candidate's word, in their order."""
    listed = result.get("self_reported") if isinstance(result, dict) else None
    if not isinstance(listed, list):
        listed = list(LEGACY)  # an older harness: no list, and these were the candidate's
    return [k for k in metrics if k in listed]


def of_status(status: dict) -> set[str]:
    """The status's metrics that are the candidate's word."""
    listed = status.get(STATUS_FIELD)
    metrics = status.get("metrics") or {}
    if isinstance(listed, list):
        return {k for k in listed if isinstance(k, str)}
    return {k for k in LEGACY if k in metrics}  # written before the field


def of_row(row: dict) -> set[str]:
    """The ledger row's figures that are the candidate's word."""
    value = row.get(COLUMN)
    if value is None:  # a row written before the column: as the harness then worked
        return set(LEGACY)
    return set(str(value).split())


def column(keys: Iterable[str]) -> str:
    """The ledger cell: the keys, space-separated ('' when every figure is the harness's)."""
    return " ".join(keys)


def marked(text: str, own: bool) -> str:
    """A figure as a table shows it: followed by MARK when it is the candidate's word."""
    return f"{text} {MARK}" if own and text != "" else text


def trackio_name(key: str, own: bool) -> str:
    """The name a figure is logged under in Trackio: the candidate's apart, in its own section."""
    return TRACKIO_PREFIX + key if own else key
