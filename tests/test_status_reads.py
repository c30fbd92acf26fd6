"""An engine pass reads its experiment's status once, in both front ends.

The front end reads an experiment (under its guard: the local file lock, the operator's
per-object lock) and hands what it read to the engine, which writes over it and never asks
for it again. Counted at the real stores: the local lab's status-file reads
(`LocalLab.read_record`, wrapped to count) and, in a cluster, the API server's log of GETs of
the Experiment (the in-repo emulator records every request).
"""

from __future__ import annotations

import asyncio
import collections

from controller.local import init_lab
from controller.core.reconcile import TERMINAL
from controller.local import LocalLab
from controller.operator import Operator, OperatorConfig
from labkit import InstantBackend, spec_from_edit
from test_operator import EXP, LAB, NS, Cluster, cluster, experiment, result, seed_lab

assert cluster  # the emulator fixture of tests/test_operator.py

EDITS = {"deeper": ("DEPTH = 8", "DEPTH = 10"),
         "no-warmdown": ("WARMDOWN_RATIO = 0.5", "WARMDOWN_RATIO = 0.0")}


def test_each_local_pass_reads_its_experiment_status_once(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOLAB_TRACKING", "0")
    root = tmp_path / "lab"
    init_lab(root, profile="tiny", data="synthetic", budget=5, min_delta=0).repo \
        .set_master_metric(1.0)
    lab = LocalLab(root)
    lab.backends["local"] = InstantBackend(lambda req: 0.9 if req.experiment != "baseline"
                                           else 1.0)
    for name, (old, new) in EDITS.items():
        lab.apply_file(spec_from_edit(lab, name, old, new), "t")

    reads: collections.Counter = collections.Counter()
    read_record = lab.read_record

    def counted(name: str) -> dict:
        reads[name] += 1
        return read_record(name)

    lab.read_record = counted  # the real store, counted
    per_pass: list[tuple[str, int]] = []
    reconcile_one = lab.reconcile_one

    def one_pass(name: str, **kw):
        before = reads[name]
        try:
            return reconcile_one(name, **kw)
        finally:
            per_pass.append((name, reads[name] - before))

    lab.reconcile_one = one_pass
    for _ in range(40):
        if lab.step().done:
            break
    phases = {n: lab.read_record(n)["status"]["phase"] for n in EDITS}
    assert set(phases.values()) <= set(TERMINAL), phases
    assert len(per_pass) >= 2 * len(EDITS), per_pass
    assert all(n == 1 for _, n in per_pass), per_pass


async def test_each_cluster_pass_reads_its_experiment_once(cluster: Cluster):
    c = cluster
    seed_lab(c.root, 1.0)
    await c.apply("labs", LAB)
    for name, (old, new) in EDITS.items():
        await c.apply("experiments", experiment(name, old, new))
    op = Operator(OperatorConfig(lab_root=c.root, server=c.url, scanning=False,
                                 watch_timeout=None))
    per_pass: list[tuple[str, int]] = []
    started: set[str] = set()

    def one_pass(name: str) -> None:
        first = len(c.em.requests)
        op.reconcile_experiment(NS, name)
        gets = [r for r in c.em.requests[first:]
                if r.method == "GET" and r.url.path.endswith(f"/experiments/{name}")]
        per_pass.append((name, len(gets)))

    try:
        for _ in range(12):
            for name in EDITS:
                await asyncio.to_thread(one_pass, name)
                run = ((c.get(EXP, name) or {}).get("status") or {}).get("job", {}).get("name")
                if run and run not in started and c.get("batch/v1/jobs", run) is not None:
                    started.add(run)  # the kubelet's part: the Job's Pod runs and ends
                    pod = await c.start_pod(run)
                    await c.finish_pod(pod, result(0.9), exit_code=0)
            if all(c.phase(n) in TERMINAL for n in EDITS):
                break
    finally:
        op.shutdown()
    assert all(c.phase(n) in TERMINAL for n in EDITS), {n: c.phase(n) for n in EDITS}
    assert len(per_pass) >= 2 * len(EDITS), per_pass
    assert all(n == 1 for _, n in per_pass), per_pass
