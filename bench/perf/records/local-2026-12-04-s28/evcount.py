"""Run from the repository root: one 50-Experiment round of operator_bench.py, then the Events the API server holds, by component, reason and kind."""
import os, sys, collections, importlib.util
def _main():
    sys.path.insert(0, os.getcwd())
    sys.argv = ["operator_bench.py", "--experiments", "50", "--resync", "30", "--settle", "1"]
    spec = importlib.util.spec_from_file_location("ob", "bench/perf/operator_bench.py")
    ob = importlib.util.module_from_spec(spec); spec.loader.exec_module(ob)
    orig = ob.start_operator
    def wrapped(url, *a, **k):
        op, stop = orig(url, *a, **k)
        def stop2():
            from kubernetes import client as k8s
            api = k8s.CoreV1Api(k8s.ApiClient(k8s.Configuration(host=url)))
            evs = api.list_namespaced_event("autolab").items
            c = collections.Counter((e.source.component if e.source else None, e.reason, e.involved_object.kind) for e in evs)
            for k, v in c.most_common(): print("EVENT", v, k)
            stop()
        return op, stop2
    ob.start_operator = wrapped
    ob.main()
    
if __name__ == '__main__':
    _main()