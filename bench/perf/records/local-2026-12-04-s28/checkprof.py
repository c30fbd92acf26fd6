"""Run from the repository root: CPU of 100 pre-run checks of distinct candidates in one process (self and git children); with any argument, a cProfile of them."""
import sys, time, difflib, resource, os, cProfile, pstats
sys.path.insert(0, ".")
from pathlib import Path
import tempfile
from controller.cli.lab import init_lab
from controller.core.spec import ExperimentSpec
from controller.lab.repo import _check_in_worker
tmp = Path(tempfile.mkdtemp())
lab = init_lab(tmp / "lab", profile="tiny", data="synthetic")
src = (Path("bench/train.py")).read_text()
parent = lab.repo.master().hash[:12]
specs = []
for i in range(200):
    ch = src.replace("SEED = 42", f"SEED = {1000+i}", 1)
    diff = "".join(difflib.unified_diff(src.splitlines(True), ch.splitlines(True), "a/train.py", "b/train.py"))
    specs.append(ExperimentSpec.from_dict({"hypothesis": f"h{i}", "parent": parent, "diff": diff}))
_check_in_worker(str(lab.root), lab.lab, "warm", specs[0])
def cpu(): 
    s = resource.getrusage(resource.RUSAGE_SELF); c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime, c.ru_utime + c.ru_stime
a = cpu(); t = time.perf_counter()
pr = cProfile.Profile() if len(sys.argv) > 1 else None
if pr: pr.enable()
for i, sp in enumerate(specs[1:101]):
    _check_in_worker(str(lab.root), lab.lab, f"s{i}", sp)
if pr: pr.disable()
b = cpu(); w = time.perf_counter() - t
print(f"100 checks: wall {w:.2f}s, self cpu {b[0]-a[0]:.2f}s, children cpu {b[1]-a[1]:.2f}s")
if pr: pstats.Stats(pr).sort_stats("tottime").print_stats(15)
if pr: pstats.Stats(pr).print_callers("io.open|builtins.compile|posix.mkdir|fork_exec")
