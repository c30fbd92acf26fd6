"""CPU of one pre-run check in a check-pool worker, its git processes included (run from the
repository root: `.venv/bin/python bench/perf/records/local-2026-12-04-s30/check_cpu.py 300`).

The checks run here, in this process, through the worker's own entry point
(`_check_in_worker`): N distinct candidates of the tiny profile's train.py, each one new line.
Printed per check: wall time, this process's CPU, the CPU of the git processes it waited for
(`git apply`; before this session also `write-tree` and `commit-tree`), and, where the code has
them, the CPU of the long-lived git processes it talks to (`_Plumbing`), warm-up included."""
import difflib
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.getcwd())
from controller.cli.lab import init_lab  # noqa: E402
from controller.core.spec import ExperimentSpec  # noqa: E402
from controller.lab import repo as R  # noqa: E402

N = int(sys.argv[1]) if len(sys.argv) > 1 else 200
lab = init_lab(Path(tempfile.mkdtemp()) / "lab", profile="tiny", data="synthetic")
master = lab.repo.master()
lines = lab.repo.master_source().splitlines(True)
specs = []
for i in range(N + 5):
    new = list(lines)
    new[40:40] = [f"EXPERIMENT_TAG_{i} = {i}\n"]
    specs.append(ExperimentSpec(hypothesis=f"Candidate {i}.", parent=master.hash[:10], diff="".join(
        difflib.unified_diff(lines, new, "a/bench/train.py", "b/bench/train.py"))))
root = str(lab.repo.root)
for i in range(5):  # a worker that has checked before
    assert not R._check_in_worker(root, lab.repo.lab, f"warm-{i}", specs[i])[0].refusal


def cpu() -> tuple[float, float]:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


def long_lived() -> float:
    plumbing = getattr(R._WORKER_REPOS.get(root), "_plumbing", None)
    total = 0
    for pipe in getattr(plumbing, "_all", ()):
        fields = Path(f"/proc/{pipe.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


a, t = cpu(), time.perf_counter()
for i in range(5, N + 5):
    assert not R._check_in_worker(root, lab.repo.lab, f"perf-{i}", specs[i])[0].refusal
b, wall = cpu(), time.perf_counter() - t
print(f"per check: wall {wall / N * 1e3:.2f} ms, this process {(b[0] - a[0]) / N * 1e3:.2f} ms CPU, "
      f"git processes waited for {(b[1] - a[1]) / N * 1e3:.2f} ms, long-lived git processes "
      f"{long_lived() / N * 1e3:.2f} ms (warm-up included)")
