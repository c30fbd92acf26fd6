"""One experiment per GPU: the local backend's slots, with fake device ids (no GPU needed)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from controller.backends.local import visible_slots
from controller.local import init_lab
from controller.cli.main import main
from labkit import spec_from_edit


def test_visible_slots_follow_the_configured_ids(monkeypatch):
    monkeypatch.setenv("AUTOLAB_GPUS", "3,5,7")
    assert visible_slots() == ["3", "5", "7"]
    assert visible_slots(configured=2) == ["3", "5"]
    monkeypatch.setenv("AUTOLAB_GPUS", "")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr("shutil.which", lambda _: None)
    assert visible_slots() == ["cpu"]


def test_each_run_holds_its_own_gpu_and_frees_it_when_done(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("AUTOLAB_GPUS", "0,1")
    monkeypatch.setenv("AUTOLAB_TRACKING", "0")
    with init_lab(tmp_path / "lab", profile="tiny", data="synthetic", budget=3, min_delta=0) as lab:
        lab.repo.set_master_metric(0.001)  # slots are under test: nobody wins, the master stays
        for name, old, new, prio in (("first", "WARMDOWN_RATIO = 0.5", "WARMDOWN_RATIO = 0.4", 0),
                                     ("second", "WARMDOWN_RATIO = 0.5", "WARMDOWN_RATIO = 0.3", 0),
                                     ("urgent", "WARMDOWN_RATIO = 0.5", "WARMDOWN_RATIO = 0.2", 5)):
            lab.apply_file(spec_from_edit(lab, name, old, new, priority=prio), "test")
            time.sleep(0.02)  # distinct creation order
        summary = lab.step()
        running = {n: st["job"]["slot"] for n, st, _ in summary.rows if st.get("phase") == "Running"}
        assert sorted(running.values()) == ["0", "1"], summary.rows
        assert "urgent" in running, "the higher priority goes first"
        waiting = next(st for n, st, _ in summary.rows if n not in running)
        assert waiting["phase"] == "Queued"
        assert any(c["reason"] == "WaitingForSlot" for c in waiting["conditions"])
        for name, slot in running.items():
            pid = json.loads((lab.root / f".autolab/runs/exp-{name}-1/launch.json").read_text())["pid"]
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            assert f"CUDA_VISIBLE_DEVICES={slot}".encode() in env
        assert main(["get", "--lab", str(lab.root)]) == 0
        table = capsys.readouterr().out
        assert "SLOT" in table.splitlines()[0]
        holders: dict[str, set] = {}
        deadline = time.time() + 300
        while not summary.done and time.time() < deadline:
            time.sleep(0.3)
            summary = lab.step()
            busy = [st["job"]["slot"] for _, st, _ in summary.rows if st.get("phase") == "Running"]
            assert len(busy) == len(set(busy)) <= 2, "a GPU is never shared"
            for n, st, _ in summary.rows:
                if st.get("phase") == "Running":
                    holders.setdefault(n, set()).add(st["job"]["slot"])
        assert summary.done
        assert all(st["phase"] == "Succeeded" for _, st, _ in summary.rows)
        assert all(len(s) == 1 for s in holders.values()), "a run keeps its GPU"
        slots = {n: json.loads((lab.root / f".autolab/runs/exp-{n}-1/launch.json").read_text())["slot"]
                 for n in ("first", "second", "urgent")}
        assert set(slots.values()) == {"0", "1"}, "the third run took the slot the first one freed"


def test_a_freed_gpu_goes_to_the_next_run_in_the_same_pass(tmp_path, monkeypatch):
    """The pass that records a finished run starts the queued one, whatever their names."""
    monkeypatch.setenv("AUTOLAB_GPUS", "0")
    monkeypatch.setenv("AUTOLAB_TRACKING", "0")
    with init_lab(tmp_path / "lab", profile="tiny", data="synthetic", budget=2, min_delta=0) as lab:
        lab.repo.set_master_metric(0.001)  # nobody wins: the master stays, no rebase in between
        # "zz-first" sorts after "aa-second" but runs first; then "aa-second" waits for its GPU.
        for name, new in (("zz-first", "WARMDOWN_RATIO = 0.4"), ("aa-second", "WARMDOWN_RATIO = 0.3")):
            lab.apply_file(spec_from_edit(lab, name, "WARMDOWN_RATIO = 0.5", new), "test")
            summary = lab.step()
        phases = {n: st.get("phase") for n, st, _ in summary.rows}
        assert phases == {"zz-first": "Running", "aa-second": "Queued"}, phases
        deadline = time.time() + 300
        while phases["zz-first"] == "Running" and time.time() < deadline:
            time.sleep(0.2)
            summary = lab.step()
            phases = {n: st.get("phase") for n, st, _ in summary.rows}
        assert phases == {"zz-first": "Succeeded", "aa-second": "Running"}, phases
        lab.delete("aa-second")  # cancelled: nothing of this test goes on after it
