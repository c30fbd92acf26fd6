"""The campaign bench (bench/perf/campaign_bench.py) on a few streams: what a user reads off it.

A few streams take well under a second, so these run with the suite: the seed lab's rule keeps
no-ops as often as luck says, the paired policies do not, every figure is a number, and a seed
gives the same table every time.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "perf" / "campaign_bench.py"


@pytest.fixture(scope="module")
def cb():
    spec = importlib.util.spec_from_file_location("campaign_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["campaign_bench"] = mod
    spec.loader.exec_module(mod)
    return mod


def run(cb, *args: str) -> dict:
    return cb.main(["--streams", "4", "--workers", "1", *args])


def figures(out: dict):
    for arrival, policies in out["results"].items():
        for policy, row in policies.items():
            for key, value in row.items():
                for v in value if isinstance(value, list) else [value]:
                    yield f"{arrival}/{policy}/{key}", v


def test_seed_rule_promotes_many_noops_and_paired_policies_do_not(cb, monkeypatch):
    monkeypatch.setattr(cb, "KIND_SHARES", {"noop": 0.7, "seed": 0.1, "gain": 0.2})
    out = run(cb, "--arrival", "waiting", "--no-calibration")["results"]["waiting"]
    assert out["seed"]["false_share"] > 0.5
    assert out["seed"]["false_per_null"] > 0.1  # less than half: the recorded value is a lucky one
    for policy in ("today", "new"):
        assert out[policy]["false_per_null"] < 0.05, policy


def test_every_policy_reports_finite_figures(cb):
    out = run(cb)
    assert set(out["results"]) == {"waiting", "all"}
    assert set(out["results"]["waiting"]) == {"seed", "today", "new"}
    bad = [k for k, v in figures(out) if not math.isfinite(v)]
    assert not bad
    for c in out["calibration"]:
        assert 0 < c["power_3sd_test1"] <= 1 and c["runs_2sd_fresh_median"] >= 2


def test_same_seed_gives_the_same_numbers(cb):
    a = run(cb, "--seed", "7", "--no-calibration")
    b = run(cb, "--seed", "7", "--no-calibration")
    c = run(cb, "--seed", "8", "--no-calibration")
    assert a["results"] == b["results"]
    assert a["results"] != c["results"]


def test_policies_take_their_knobs_from_the_command_line(cb):
    out = run(cb, "--policies", "new,new:cap=6:fre=none", "--cap", "12", "--first-run-every",
              "3", "--arrival", "waiting", "--no-calibration")
    assert set(out["results"]["waiting"]) == {"new", "new:cap=6:fre=none"}
    p = cb.parse_policy("new:cap=6:fre=none", 12, 3)
    assert (p.cap, p.fre) == (6, None)
    assert (cb.parse_policy("new", 12, 3).cap, cb.parse_policy("new", 12, 3).fre) == (12, 3)


def test_a_new_spec_waits_a_bounded_number_of_runs_even_when_promotions_void_decisions(cb):
    """Small noise: promotions come often and void the decisions under way. Started over in the
    decisions' turn (the default), they never push a new spec's first run back by more than the
    specs ahead of it and FIRST_RUN_EVERY runs each; started over as first runs, in creation
    order, they went before every newer spec."""
    out = run(cb, "--streams", "6", "--noise-scale", "0.1", "--arrival", "waiting",
              "--policies", "new,new:restart=first", "--no-calibration")["results"]["waiting"]
    bound = (cb.WAITING * (1 + cb.FIRST_RUN_EVERY) + 2) * cb.RUN_SECONDS
    assert out["new"]["wasted_share"] > 0.05, "the promotions void decisions under way"
    assert out["new"]["longest_first_wait_worst_s"] <= bound
    assert out["new:restart=first"]["longest_first_wait_worst_s"] > 2 * bound
    assert cb.parse_policy("new:restart=first", None, None).restart == "first"
    with pytest.raises(SystemExit, match="restart"):
        cb.parse_policy("new:restart=later", None, None)


def test_benchmarks_call_the_library_not_the_cli():
    """A benchmark times the controller, not argument parsing and printing: no file under
    bench/perf imports `controller.cli` (a benchmark of the command line runs `autolab` as a
    process, as a user would)."""
    import ast

    importers = []
    for path in sorted(BENCH.parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n == "controller.cli" or n.startswith("controller.cli.") for n in names):
                importers.append(f"{path.name}:{node.lineno}")
    assert importers == []
