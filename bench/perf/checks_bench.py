"""Pre-run checks at scale: 1,000 specs against a 10,000-row ledger, and the dedup lookup alone.

Every spec goes through what the controller does before a GPU is spent: YAML
parse, schema validation, diff checks, `git apply` in a worktree, commit,
compile, both hashes, and the duplicate lookup. Prints per-experiment times,
the lookup time at 1k/10k/100k ledger rows, and peak memory.

    .venv/bin/python bench/perf/checks_bench.py [--specs 1000] [--rows 10000]
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from controller.cli.lab import init_lab  # noqa: E402
from controller.core.spec import ExperimentSpec, validate_document  # noqa: E402
from controller.lab.ledger import Ledger  # noqa: E402


def fake_rows(n: int, start: int = 0):
    for i in range(start, start + n):
        h = hashlib.sha1(f"row{i}".encode()).hexdigest()
        s = hashlib.sha1(f"sem{i}".encode()).hexdigest()
        yield {"run_id": f"exp-r{i}-1", "status": "succeeded", "experiment_id": f"r{i}",
               "candidate_hash": h, "semantic_hash": s, "val_bpb": "1.0",
               "hypothesis": "a filler row", "created_at": "2026-11-29T00:00:00Z"}


def fill_ledger(path: Path, n: int) -> None:
    led = Ledger(path)
    led.append(next(fake_rows(1)))
    from controller.lab.ledger import COLUMNS
    with open(path, "a") as f:  # bulk fill: the append path is measured separately
        for r in fake_rows(n - 1, 1):
            f.write("\t".join(str(r.get(c, "")) for c in COLUMNS) + "\n")


def lookup_us(rows: int, tmp: Path) -> float:
    path = tmp / f"ledger-{rows}.tsv"
    fill_ledger(path, rows)
    led = Ledger(path)
    led.refresh()
    probes = [hashlib.sha1(f"row{i}".encode()).hexdigest() for i in range(0, rows, max(1, rows // 1000))]
    probes += [hashlib.sha1(f"absent{i}".encode()).hexdigest() for i in range(1000)]
    t = time.perf_counter()
    for _ in range(10):
        for p in probes:
            led.measured(p, p)
    return (time.perf_counter() - t) / (10 * len(probes)) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--specs", type=int, default=1000)
    ap.add_argument("--rows", type=int, default=10000)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="autolab-perf-"))
    lab = init_lab(tmp / "lab", profile="tiny", data="synthetic")
    fill_ledger(lab.ledger.path, a.rows)
    lab.ledger.refresh()
    master = lab.repo.master()
    source = lab.repo.master_source()
    lines = source.splitlines(True)
    texts = []
    for i in range(a.specs):
        new = lines + [f"EXPERIMENT_TAG_{i} = {i}  # a distinct candidate\n"]
        diff = "".join(difflib.unified_diff(lines, new, "a/train.py", "b/train.py"))
        texts.append(yaml.safe_dump({"apiVersion": "autolab.dev/v1alpha1", "kind": "Experiment",
                                     "metadata": {"name": f"perf-{i}"},
                                     "spec": {"hypothesis": f"Candidate {i}.",
                                              "parent": master.hash[:10], "diff": diff}}))
    times, lookups, dups = [], [], 0
    t_all = time.perf_counter()
    for i, text in enumerate(texts):
        t = time.perf_counter()
        doc = validate_document(yaml.safe_load(text), source=f"perf-{i}.yaml")
        spec = ExperimentSpec.from_dict(doc["spec"])
        c = lab.repo.materialise(doc["metadata"]["name"], spec)
        assert c.refusal is None, c.message
        t_l = time.perf_counter()
        if lab.duplicate_of(doc["metadata"]["name"], c):
            dups += 1
        lookups.append(time.perf_counter() - t_l)
        lab.repo.cleanup(doc["metadata"]["name"], keep_branch=True)
        times.append(time.perf_counter() - t)
    wall = time.perf_counter() - t_all
    q = statistics.quantiles(times, n=20)
    print(f"specs: {a.specs}  ledger rows: {a.rows}  duplicates found: {dups}")
    print(f"per experiment (parse, validate, apply, commit, compile, hash, dedup, cleanup): "
          f"mean {statistics.mean(times) * 1e3:.1f} ms  p50 {statistics.median(times) * 1e3:.1f} ms"
          f"  p95 {q[18] * 1e3:.1f} ms  total {wall:.1f} s")
    print(f"dedup lookup inside the checks: mean {statistics.mean(lookups) * 1e6:.1f} us  "
          f"max {max(lookups) * 1e6:.1f} us")
    for rows in (1000, 10000, 100000):
        print(f"dedup lookup, ledger of {rows:>6} rows: {lookup_us(rows, tmp):.2f} us")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak memory (max RSS of this process): {peak:.0f} MiB")


if __name__ == "__main__":
    main()
