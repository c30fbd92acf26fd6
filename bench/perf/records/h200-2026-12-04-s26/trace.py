"""Where a pass's time goes in the 50-Experiment burst: wraps a few functions, runs the bench."""
import collections, runpy, sys, threading, time, atexit, os
repo = os.getcwd()
sys.path.insert(0, repo)
import controller.kube.cluster as C
import controller.engine as E
import controller.operator as O
spans = collections.defaultdict(list)
def wrap(obj, name, label=None):
    f = getattr(obj, name)
    def w(*a, **kw):
        t = time.perf_counter()
        try:
            return f(*a, **kw)
        finally:
            key = label(a, kw) if callable(label) else (label or name)
            spans[key].append(time.perf_counter() - t)
    setattr(obj, name, w)
wrap(C.Kube, "request", lambda a, kw: f"req {a[1]} {a[2].rsplit('/', 1)[-1] if not a[2].endswith('}') else a[2].rsplit('/', 2)[-2]}")
wrap(E.Engine, "_materialise", "materialise")
wrap(E.Engine, "_pass", "pass")
wrap(O.Operator, "reconcile_experiment", "reconcile_experiment")
wrap(O.Operator, "_guarded", "guarded")
def report():
    for k, v in sorted(spans.items()):
        v = sorted(v)
        print(f"{k:40s} n={len(v):4d} mean={1000*sum(v)/len(v):7.1f}ms p50={1000*v[len(v)//2]:7.1f} p95={1000*v[int(.95*(len(v)-1))]:7.1f}")
atexit.register(report)
sys.argv = ["operator_bench.py", "--experiments", "50", "--resync", "30", "--settle", "2"]
runpy.run_path(os.path.join(repo, "bench/perf/operator_bench.py"), run_name="__main__")
