"""Run from the repository root: CPU of the operator's threads (kopf's loop, the handler pool) from the client's start to the end of a 50-Experiment round."""
import os, sys, time, threading, collections
repo = os.getcwd(); sys.path.insert(0, repo)
import importlib.util
def tcpu(tid):
    try:
        f = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        return 0.0
def _main():
    sys.argv = ["operator_bench.py", "--experiments", "50", "--resync", "30", "--settle", "0.3"]
    spec = importlib.util.spec_from_file_location("ob", os.path.join(os.getcwd(), "bench/perf/operator_bench.py"))
    ob = importlib.util.module_from_spec(spec); spec.loader.exec_module(ob)
    orig_popen = ob.subprocess.Popen
    base = {}
    class P(orig_popen):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            if "--client" in a[0]:
                for t in os.listdir("/proc/self/task"): base[int(t)] = tcpu(t)
    ob.subprocess.Popen = P
    orig = ob.start_operator
    def wrapped(*a, **k):
        op, stop = orig(*a, **k)
        def stop2():
            names = {t.native_id: t.name for t in threading.enumerate()}
            agg = collections.Counter()
            for t in os.listdir("/proc/self/task"):
                n = names.get(int(t), "?")
                key = "kopf loop" if n == "kopf" else ("pool" if "ThreadPool" in n or n.startswith("Thread-") or "asyncio" in n else n)
                agg[key] += tcpu(t) - base.get(int(t), 0.0)
            print("thread CPU since the client started:", {k: round(v, 2) for k, v in agg.items()})
            print("names", sorted(set(names.values()))[:20])
            stop()
        return op, stop2
    ob.start_operator = wrapped
    ob.main()
if __name__ == "__main__":
    _main()
