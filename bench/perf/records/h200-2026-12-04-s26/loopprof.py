"""cProfile of kopf's event-loop thread only (thread CPU time), over a 50-Experiment round."""
import cProfile, pstats, runpy, sys, time, os, threading
sys.path.insert(0, os.getcwd())
if __name__ == "__main__":
    sys.argv = ["operator_bench.py", "--experiments", "50", "--resync", "30", "--settle", "0"]
    g = runpy.run_path("bench/perf/operator_bench.py", run_name="bench")
    prof = cProfile.Profile(time.thread_time)
    orig_thread_run = threading.Thread.run
    def run(self):
        if self.name == "kopf":
            prof.enable()
            try:
                orig_thread_run(self)
            finally:
                prof.disable()
        else:
            orig_thread_run(self)
    threading.Thread.run = run
    try:
        g["main"]()
    finally:
        st = pstats.Stats(prof); st.dump_stats("/tmp/loop.prof"); st.sort_stats("tottime").print_stats(35); st.sort_stats("cumtime").print_stats(60)
