"""Run from the repository root: cProfile (thread CPU time) of every pass of a 50-Experiment round, merged."""
import os, sys, time, threading, cProfile, pstats, io
repo = os.getcwd(); sys.path.insert(0, repo)
import importlib.util
def _main():
    sys.argv = ["operator_bench.py", "--experiments", "50", "--resync", "30", "--settle", "0.3"]
    spec = importlib.util.spec_from_file_location("ob", os.path.join(os.getcwd(), "bench/perf/operator_bench.py"))
    ob = importlib.util.module_from_spec(spec); spec.loader.exec_module(ob)
    import controller.operator as O
    profs, lock = [], threading.Lock()
    orig = O.Operator.reconcile_experiment
    def wrapped(self, *a, **k):
        p = cProfile.Profile(time.thread_time)
        p.enable()
        try:
            return orig(self, *a, **k)
        finally:
            p.disable()
            with lock: profs.append(p)
    O.Operator.reconcile_experiment = wrapped
    ob.main()
    st = pstats.Stats(profs[0])
    for p in profs[1:]: st.add(p)
    st.sort_stats("cumulative").print_stats(70)
    st.sort_stats("tottime").print_stats(30)
if __name__ == "__main__":
    _main()
