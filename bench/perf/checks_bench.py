"""Pre-run checks at scale: 1,000 specs against a 10,000-row ledger, and the dedup lookup alone.

Every spec goes through what the controller does before a GPU is spent: YAML
parse and schema validation (here, one at a time), then the engine's way with a
batch of new specs (`Engine.precheck`): the diff checks, `git apply --cached` on
a temporary index, commit-tree, compile and both hashes run on the check pool
(`--workers` processes), and the passes take the results in order, each with
its duplicate lookup and in-flight claim under the engine's lock, then the
candidate's cleanup. Prints the total wall time, per-spec times (parse and
validate + the check in its worker + lookup and cleanup), the lookup time at
1k/10k/100k ledger rows, and peak memory.

    .venv/bin/python bench/perf/checks_bench.py [--specs 1000] [--rows 10000] [--workers 2]
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from controller.local import init_lab  # noqa: E402
from controller.core.spec import ExperimentSpec, validate_document  # noqa: E402
from controller.engine import Observed  # noqa: E402
from controller.lab.ledger import Ledger  # noqa: E402
from controller.lab.check_pool import CHECK_WORKERS, CheckPool, _check_in_worker  # noqa: E402

TIMES = "AUTOLAB_BENCH_CHECK_TIMES"  # where each worker appends "name seconds" per check


def timed_check(root, lab, name, spec):
    """The pool's task, timed inside the worker (its queue wait left out)."""
    t = time.perf_counter()
    try:
        return _check_in_worker(root, lab, name, spec)
    finally:
        with open(os.environ[TIMES], "a") as f:
            f.write(f"{name} {time.perf_counter() - t:.6f}\n")


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
    ap.add_argument("--workers", type=int, default=CHECK_WORKERS, help="checking processes")
    a = ap.parse_args()
    load = [round(x, 2) for x in os.getloadavg()]  # others' work on the machine skews it all
    tmp = Path(tempfile.mkdtemp(prefix="autolab-perf-"))
    os.environ[TIMES] = str(tmp / "check-times.txt")
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
    pool = CheckPool(workers=a.workers, task=timed_check)
    lab.engine.checks = pool
    # The workers start before the clock does, as in a controller that has checked before.
    pool.submit(lab.repo, "warm-up", ExperimentSpec(hypothesis="-", parent=master.hash[:10],
                                                    diff="x")).result()
    own: dict[str, float] = {}
    dups = 0
    t_all = time.perf_counter()
    observed, specs = [], {}
    for i, text in enumerate(texts):
        t = time.perf_counter()
        doc = validate_document(yaml.safe_load(text), source=f"perf-{i}.yaml")
        name = doc["metadata"]["name"]
        specs[name] = ExperimentSpec.from_dict(doc["spec"])
        observed.append(Observed(name=name, key=name, spec=doc["spec"], status={}))
        own[name] = time.perf_counter() - t
    started = lab.engine.precheck(observed)
    candidates = {}
    for name, spec in specs.items():
        c, duplicate = lab.engine._materialise(name, spec)  # what a pass's materialise does
        t = time.perf_counter()
        assert c.refusal is None, c.message
        dups += bool(duplicate)
        lab.repo.cleanup(name, keep_branch=True)
        own[name] += time.perf_counter() - t
        candidates[name] = c
    wall = time.perf_counter() - t_all
    last = f"perf-{a.specs - 1}"  # each candidate is on its branch, as the checks made it
    assert f"EXPERIMENT_TAG_{a.specs - 1} = " in lab.repo.candidate_source(last)
    checks = {}
    for line in Path(os.environ[TIMES]).read_text().splitlines():
        name, seconds = line.split()
        checks[name] = float(seconds)
    times = [own[n] + checks[n] for n in specs]
    lookups = []
    for name, c in candidates.items():  # the lookup alone, with 1,000 candidates in flight
        t = time.perf_counter()
        lab.duplicate_of(name, c)
        lookups.append(time.perf_counter() - t)
    pool.shutdown()
    q = statistics.quantiles(times, n=20)
    print(f"load average at the start: {load}")
    print(f"specs: {a.specs}  ledger rows: {a.rows}  workers: {a.workers}  "
          f"checked on the pool: {started}  duplicates found: {dups}")
    print(f"all {a.specs} specs: {wall:.1f} s wall ({wall / a.specs * 1e3:.1f} ms a spec)")
    print(f"per spec (parse, validate, apply, commit, compile, hash in a worker; dedup, cleanup): "
          f"mean {statistics.mean(times) * 1e3:.1f} ms  p50 {statistics.median(times) * 1e3:.1f} ms"
          f"  p95 {q[18] * 1e3:.1f} ms")
    print(f"dedup lookup (master read + ledger index + in-flight claim): "
          f"mean {statistics.mean(lookups) * 1e6:.1f} us  max {max(lookups) * 1e6:.1f} us")
    for rows in (1000, 10000, 100000):
        print(f"dedup lookup, ledger of {rows:>6} rows: {lookup_us(rows, tmp):.2f} us")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak memory (max RSS of this process): {peak:.0f} MiB")


if __name__ == "__main__":
    main()
