"""Every figure a run records is the harness's own, or is listed as the candidate's word.

The candidate's `stats.json` says what it likes. bench/run.py measures what it can itself:
MFU from the tokens it served, the evaluator's FLOPs count of the exported model, its own clock
and the GPU's bf16 peak by name (no GPU: no MFU); peak GPU memory from the driver, for the
candidate's processes only; depth and parameters from the exported model. What it cannot
measure (the number of steps) stays the candidate's and is listed in `self_reported`; what the
candidate said is kept apart, in `reported`.

These run on the CPU. A stand-in `nvidia-smi` on PATH answers for the driver, as the real one
does: the GPU's processes and their memory. It lists every python process running a train.py
(777 MiB each; other labs' too, if any run here), every evaluator (5000 MiB), the harness itself
(3000 MiB) and one process the driver does not give a figure for; only the candidate's count.
"""

from __future__ import annotations

import io
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_run_phases import BENCH, EXPORT, TRAIN, bench  # noqa: F401  (the module fixture)

BUDGET = 2.5
# evaluate.model_figures of the default train.py's export, and train.py's own FLOPS_PER_TOKEN
# (test_the_default_models_flops_are_counted_as_train_py_counts_them checks both).
DEFAULT_FLOPS_PER_TOKEN = 276_824_064
RECORDS = BENCH / "perf" / "records"

FAKE_NVIDIA_SMI = """#!{python}
import os
rows = [f"{{os.getppid()}}, 3000", "1, [N/A]"]  # the harness that asked; a figure not given
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        with open(f"/proc/{{pid}}/comm") as f:
            comm = f.read().strip()
        with open(f"/proc/{{pid}}/cmdline", "rb") as f:
            argv = f.read().split(b"\\0")
    except OSError:
        continue
    if not comm.startswith("python"):
        continue
    if any(a.endswith(b"evaluate.py") for a in argv):
        rows.append(f"{{pid}}, 5000")
    elif any(b"train.py" in a for a in argv):  # train.py itself, or the sandbox's boot that runs it
        rows.append(f"{{pid}}, 777")
print("\\n".join(rows))
"""

HOSTILE_STATS = '''
print(f"FLOPS_PER_TOKEN={FLOPS_PER_TOKEN}", flush=True)
stats.update(mfu_percent=99.9, peak_vram_mb=1.0, depth=99, num_params_M=1e6, total_tokens_M=1e6)
'''


def stand_in_nvidia_smi(tmp: Path, monkeypatch) -> None:
    """Put the stand-in `nvidia-smi` first on PATH (skip where NVML is, as the harness reads
    that instead)."""
    if importlib.util.find_spec("pynvml") is not None:
        pytest.skip("NVML is installed here: the harness would read it, not the stand-in nvidia-smi")
    tools = tmp / "bin"
    tools.mkdir()
    (tools / "nvidia-smi").write_text(FAKE_NVIDIA_SMI.format(python=sys.executable))
    (tools / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tools}{os.pathsep}{os.environ['PATH']}")


def hostile_candidate(tmp: Path) -> Path:
    """train.py, trained honestly, that reports MFU 99.9 % and 1 MB of GPU memory."""
    src = TRAIN.read_text()
    assert EXPORT in src
    path = tmp / "candidate" / "train.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(src.replace(EXPORT, HOSTILE_STATS + EXPORT))
    return path


def test_a_candidate_claiming_99_9_mfu_and_1_mb_gets_the_harness_figures_recorded(
        bench, tmp_path, monkeypatch):
    stand_in_nvidia_smi(tmp_path, monkeypatch)
    monkeypatch.setenv("AUTOLAB_EARLY_EVALUATOR", "1")  # the evaluator holds GPU memory meanwhile
    result = bench.run.run_candidate(hostile_candidate(tmp_path), tmp_path / "result.json",
                                     source="synthetic", budget=BUDGET, log_path=tmp_path / "run.log",
                                     termination_log=tmp_path / "termination-log")
    assert result["status"] == "succeeded", result["reason"]
    metrics, reported, measured = result["metrics"], result["reported"], result["measured"]
    # The candidate's word, kept as it said it, and nowhere else.
    assert (reported["mfu_percent"], reported["peak_vram_mb"], reported["depth"]) == (99.9, 1.0, 99)
    assert result["self_reported"] == ["num_steps"]
    # GPU memory: the driver's figure for the candidate's process, not the evaluator's, not the
    # harness's, not another lab's, read more than once while it ran.
    assert metrics["peak_vram_mb"] == 777.0
    assert measured["gpu_memory"] == "nvidia-smi" and measured["gpu_memory_samples"] >= 2
    # MFU: a CPU has no bf16 peak, so there is none; the FLOPs count is train.py's own.
    assert metrics["mfu_percent"] is None and measured["peak_flops"] is None
    log = (tmp_path / "run.log").read_text()
    printed = int(log.split("FLOPS_PER_TOKEN=")[1].split()[0])
    assert measured["flops_per_token"] == printed
    # Depth, parameters and tokens from the exported model and the data server.
    assert metrics["depth"] == 2 and metrics["num_params_M"] < 1
    assert metrics["total_tokens_M"] * 1e6 == pytest.approx(result["timing"]["tokens_served"], abs=500)
    assert "measured: MFU not measured" in log and "peak GPU memory 777.0 MiB (nvidia-smi" in log
    assert "the candidate says mfu_percent 99.9, peak_vram_mb 1.0" in log
    assert json.loads((tmp_path / "termination-log").read_text()) == result


def test_without_a_driver_gpu_memory_is_empty_on_a_cpu_and_the_candidates_on_a_gpu(bench):
    own_figures = bench.harness.figures
    evaluation = {"val_bpb": 1.0, "num_params": 10, "flops_per_token": 60, "depth": None,
                  "device_name": None}
    stats = {"peak_vram_mb": 1.0, "num_steps": 7, "depth": 3, "mfu_percent": 99.9}
    unread = {"peak_mb": None, "how": None, "samples": 0}
    metrics, own = own_figures._metrics(stats, evaluation, training=2.0, total=3.0, tokens=100, gpu=unread,
                                    had_gpu=False)
    assert metrics["peak_vram_mb"] is None and metrics["mfu_percent"] is None
    assert (metrics["num_steps"], metrics["depth"], own) == (7, 3, ["num_steps", "depth"])
    metrics, own = own_figures._metrics(stats, evaluation, training=2.0, total=3.0, tokens=100, gpu=unread,
                                    had_gpu=True)
    assert metrics["peak_vram_mb"] == 1.0 and own == ["peak_vram_mb", "num_steps", "depth"], \
        "a GPU whose driver hides the candidate's processes: its figure, as its own"


def test_a_gpu_is_known_by_its_name_and_mfu_follows_from_the_harness_figures(bench):
    own_figures = bench.harness.figures
    assert own_figures.peak_flops("NVIDIA H100 80GB HBM3") == own_figures.peak_flops("NVIDIA H200") == 989.5e12
    assert own_figures.peak_flops("NVIDIA H100 PCIe") == 756e12 and own_figures.peak_flops("NVIDIA H100 NVL") == 835e12
    assert own_figures.peak_flops("NVIDIA L40S") == 362.05e12 and own_figures.peak_flops("NVIDIA L4") == 121e12
    assert own_figures.peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert own_figures.peak_flops("Tesla T4") is None and own_figures.peak_flops(None) is None
    # 1e6 tokens of 1e9 FLOPs in 10 s on 989.5 TFLOP/s
    assert own_figures.harness_mfu(10**6, 10.0, 10**9, "NVIDIA H200") == round(100 * 1e14 / 989.5e12, 2)
    assert own_figures.harness_mfu(10**6, 10.0, 10**9, None) is None
    assert own_figures.harness_mfu(10**6, 10.0, None, "NVIDIA H200") is None
    assert own_figures.harness_mfu(10**6, 0.0, 10**9, "NVIDIA H200") is None


def recorded_default_runs() -> list[dict]:
    """Results of the default train.py's architecture (50.332M parameters, depth 8) recorded on
    an H200 by the earlier harness, whose MFU was train.py's own report: the fields this test
    reads, gathered in one file from the per-call records (git history keeps those; each entry
    names its own)."""
    return json.loads((RECORDS / "h200-default-runs.json").read_text())


def test_the_harness_mfu_of_recorded_h200_runs_agrees_with_train_py_at_the_default_budget(bench):
    runs = recorded_default_runs()
    assert len(runs) >= 10
    for r in runs:
        t, m = r["timing"], r["metrics"]
        ours = bench.harness.figures.harness_mfu(t["tokens_served"], t["training_seconds"],
                                                  DEFAULT_FLOPS_PER_TOKEN, "NVIDIA H200")
        # The tokens served are the ones trained on and the loader's read-ahead: at most 8 batches.
        trained = m["num_steps"] * 2**19
        assert 0 <= t["tokens_served"] - trained <= 8 * (128 * 2048 + 1), r.get("run")
        assert ours >= m["mfu_percent"] - 0.1
        if t["training_seconds"] >= 290:  # the default budget: the read-ahead is 0.3 % of it
            assert abs(ours - m["mfu_percent"]) < 2.0


def test_the_default_models_flops_are_counted_as_train_py_counts_them():
    """The default train.py's model, exported both ways (bf16 autocast inside the program, as on
    CUDA, and plain), counted by the evaluator: train.py's FLOPS_PER_TOKEN and DEPTH."""
    script = f"""
import io, json, sys, torch
sys.path.insert(0, {str(BENCH)!r})
head = open({str(TRAIN)!r}).read().split("# Optimisers")[0]  # the model, built; nothing trained
g = {{"__name__": "train_head"}}
exec(compile(head, "train.py", "exec"), g)
import prepare, evaluate
out = {{"train_py": [g["FLOPS_PER_TOKEN"], g["DEPTH"]]}}
for autocast in (False, True):
    example = torch.zeros(prepare.EVAL_BATCH_SIZE, prepare.MAX_SEQ_LEN, dtype=torch.long)
    program = prepare.export_program(g["raw_model"].eval(), example, autocast=autocast)
    buf = io.BytesIO(); torch.export.save(program, buf); buf.seek(0)
    figures = evaluate.model_figures(torch.export.load(buf))
    out[str(autocast)] = [figures["flops_per_token"], figures["depth"]]
print(json.dumps(out))
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOLAB_")}
    # A data socket that is never read: make_loader then prepares no data (nothing is asked).
    env.update(AUTOLAB_BENCH_PROFILE="default", AUTOLAB_DATA_FD="1000", CUDA_VISIBLE_DEVICES="",
               OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["train_py"] == out["False"] == out["True"] == [DEFAULT_FLOPS_PER_TOKEN, 8]


def export_toy(model, autocast: bool):
    import torch

    sys.path.insert(0, str(BENCH))
    import prepare

    program = prepare.export_program(model, torch.zeros(2, 8, dtype=torch.long), autocast=autocast)
    buf = io.BytesIO()
    torch.export.save(program, buf)
    buf.seek(0)
    return torch.export.load(buf)


@pytest.mark.parametrize("autocast", [False, True])
def test_lookups_and_unread_weights_cost_no_flops_and_each_attention_call_is_a_layer(bench, autocast):
    import torch
    import torch.nn.functional as F

    class Toy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = torch.nn.Embedding(32, 16)
            self.ve = torch.nn.Embedding(32, 16)  # a value embedding: a lookup too
            self.qkv = torch.nn.Linear(16, 16, bias=False)
            self.head = torch.nn.Linear(16, 32, bias=False)
            self.padding = torch.nn.Linear(16, 4096, bias=False)  # exported, never read

        def forward(self, idx):
            x = F.rms_norm(self.wte(idx), (16,)) + self.ve(idx)
            for _ in range(3):  # one block, three times: three attention layers
                q = self.qkv(x).view(2, 8, 2, 8).transpose(1, 2)
                x = x + F.scaled_dot_product_attention(q, q, q, is_causal=True).transpose(1, 2).reshape(2, 8, 16)
            return self.head(x).float()

    figures = bench_evaluate().model_figures(export_toy(Toy(), autocast))
    matmul = 16 * 16 + 16 * 32  # qkv and head; the embeddings and the padding are not counted
    attention = 3 * 6 * 8 * 2 * (8 + 8)  # 6 x S x heads x (Dqk + Dv) per call: 12 x S x width
    assert figures == {"flops_per_token": 6 * matmul + attention, "depth": 3, "matmul_params": matmul}


def test_a_graph_without_attention_has_no_depth_to_give(bench):
    import torch

    model = torch.nn.Sequential(torch.nn.Embedding(32, 16), torch.nn.Linear(16, 32, bias=False))
    figures = bench_evaluate().model_figures(export_toy(model, False))
    assert figures == {"flops_per_token": 6 * 16 * 32, "depth": None, "matmul_params": 16 * 32}


def bench_evaluate():
    sys.path.insert(0, str(BENCH))
    import evaluate

    return evaluate


# --- the lab's record: ledger, get -o wide, describe, the report, Trackio ----------------------


def test_a_hostile_candidates_claims_reach_no_record_unmarked(tmp_path, monkeypatch, capsys):
    """The acceptance line: a candidate that trains honestly but reports MFU 99.9 and 1 MB of
    peak GPU memory, run by the lab end to end (the real harness, the local backend)."""
    from controller.local import init_lab
    from controller.cli.main import main
    from controller.core import figures
    from controller.lab import tracking
    from controller.lab.report import write_report
    from labkit import spec_from_edit
    from test_tracking import read_back

    stand_in_nvidia_smi(tmp_path, monkeypatch)
    monkeypatch.setenv("AUTOLAB_EARLY_EVALUATOR", "1")
    monkeypatch.delenv("AUTOLAB_TRACKING", raising=False)
    lab = init_lab(tmp_path / "lab", profile="tiny", data="synthetic", budget=3, min_delta=0)
    lab.repo.set_master_metric(9.9)  # the baseline is not what this test is about
    lab.apply_file(spec_from_edit(lab, "claims", EXPORT, HOSTILE_STATS + EXPORT,
                                  "Reporting a better MFU makes it better."), "test")
    assert main(["run", "--lab", str(lab.root), "--interval", "0.2"]) == 0
    capsys.readouterr()

    def shows_no_claim(text: str) -> None:
        assert "99.9" not in text and "1e+06" not in text, text

    # The ledger: the harness's figures (no GPU peak on a CPU: no MFU), no candidate's figure.
    row = next(r for r in lab.ledger.rows() if r["experiment_id"] == "claims")
    assert row["status"] == "succeeded", row
    assert (row["mfu_percent"], row["peak_vram_mb"], row[figures.COLUMN]) == ("", "777.0", "")
    shows_no_claim("\t".join(row.values()))
    # get -o wide: the same, in its MFU and VRAM_MB columns.
    assert main(["get", "claims", "-o", "wide", "--lab", str(lab.root)]) == 0
    head, line = capsys.readouterr().out.splitlines()
    cols = head.split()
    assert cols[cols.index("MFU"):cols.index("MFU") + 2] == ["MFU", "VRAM_MB"]
    assert "777.0" in line.split()
    shows_no_claim(line)
    # describe: every metric, the steps marked as the candidate's word.
    assert main(["describe", "claims", "--lab", str(lab.root)]) == 0
    described = capsys.readouterr().out
    assert "  mfu_percent: not measured" in described and "  peak_vram_mb: 777.0\n" in described
    assert "  depth: 2\n" in described
    steps = next(x for x in described.splitlines() if x.startswith("  num_steps: "))
    assert steps.endswith(f"({figures.EXPLAINED})")
    shows_no_claim(described.split("\nDiff:")[0])  # the diff itself holds the claim, as code
    # The report's recent runs.
    md, _ = write_report(lab, png=False)
    recent = next(x for x in md.split("## Recent runs")[1].splitlines() if "`claims`" in x)
    assert "777.0" in recent and figures.MARK not in recent
    shows_no_claim(md)
    # Trackio: the harness's figures under their names, the candidate's steps apart.
    run = next(r for name, r in read_back(lab).items() if name.startswith("claims"))
    assert run["config"]["self_reported"] == ["num_steps"] and "num_steps" not in run["config"]
    assert run["config"]["depth"] == 2 and run["logs"][-1]["peak_vram_mb"] == 777.0
    assert "mfu_percent" not in run["logs"][-1]
    shows_no_claim(json.dumps(run))
    assert tracking.settle()


# --- whose word: statuses, ledger rows, older records --------------------------------------------


def harness_result(self_reported=None, **figures_) -> dict:
    result = {"status": "succeeded", "metrics": {"val_bpb": 1.25, "training_seconds": 3.0,
                                                 "total_seconds": 9.0, **figures_}}
    if self_reported is not None:
        result["self_reported"] = self_reported
    return result


@pytest.mark.parametrize("result, status_list, column", [
    # Today's harness on a GPU machine whose driver showed the candidate: its own figures.
    (harness_result(["num_steps"], peak_vram_mb=777.0, mfu_percent=41.2, num_steps=9),
     ["num_steps"], ""),
    # A driver that hid the candidate's processes: its memory figure, as its word.
    (harness_result(["peak_vram_mb", "num_steps"], peak_vram_mb=1.0, mfu_percent=41.2, num_steps=9),
     ["peak_vram_mb", "num_steps"], "peak_vram_mb"),
    # A harness from before the list (a lab's pinned older harness): MFU and memory were its word.
    (harness_result(None, peak_vram_mb=1.0, mfu_percent=99.9, num_steps=9, depth=99),
     ["peak_vram_mb", "mfu_percent", "num_steps", "depth"], "peak_vram_mb mfu_percent"),
], ids=["measured", "driver-hid-it", "older-harness"])
def test_the_status_and_the_ledger_row_say_which_figures_are_the_candidates(result, status_list,
                                                                            column):
    from controller.core import figures
    from controller.core.reconcile import Master, RunObservation, World, reconcile, master_run_row
    from controller.core.spec import ExperimentSpec, LabSpec

    master = Master(hash="a" * 40, semantic_hash="b" * 40, commit="c" * 40, val_bpb=1.0)
    job = {"backend": "local", "name": "exp-e-1", "slot": "0"}
    d = reconcile(World(name="e", spec=ExperimentSpec(hypothesis="h", parent="aaaa", diff="-"),
                        lab=LabSpec(profile="tiny", min_delta=0.0), master=master,
                        now="2026-11-29T10:00:00Z", status={"phase": "Running", "conditions": [],
                                                            "job": job},
                        run=RunObservation("exp-e-1", "succeeded", result=result)))
    assert d.status[figures.STATUS_FIELD] == status_list
    row = next(i.row for i in d.intents if i.kind == "record")
    assert row[figures.COLUMN] == column
    baseline, _ = master_run_row(master, RunObservation("baseline-x-1", "succeeded", result=result))
    assert baseline[figures.COLUMN] == column


def test_a_figure_the_harness_could_not_measure_is_an_empty_cell_not_none():
    from controller.core.reconcile import Master, RunObservation, master_run_row

    master = Master(hash="a" * 40, semantic_hash="b" * 40, commit="c" * 40)
    row, _ = master_run_row(master, RunObservation("baseline-x-1", "succeeded", result=harness_result(
        ["num_steps"], peak_vram_mb=None, mfu_percent=None, num_steps=9)))
    assert (row["mfu_percent"], row["peak_vram_mb"]) == ("", "")


def test_get_wide_marks_the_candidates_figures_and_older_statuses_by_the_older_harness():
    from controller.cli.output import table_rows
    from controller.core import figures

    figures_ = {"val_bpb": 1.0, "mfu_percent": 41.25, "peak_vram_mb": 777.0}
    rows = [("measured", {"metrics": figures_, "selfReported": ["num_steps"]}, {}),
            ("hid-it", {"metrics": {**figures_, "peak_vram_mb": 1.0}, "selfReported": ["peak_vram_mb"]}, {}),
            ("older", {"metrics": {**figures_, "mfu_percent": 99.9, "peak_vram_mb": 1.0}}, {}),
            ("cpu", {"metrics": {**figures_, "mfu_percent": None, "peak_vram_mb": None},
                     "selfReported": ["num_steps"]}, {})]
    head, lines = table_rows(rows, wide=True)
    at = head.index("MFU")
    cells = {line[0]: line[at:at + 2] for line in lines}
    mark = figures.MARK
    assert cells == {"measured": ["41.25", "777.0"], "hid-it": ["41.25", f"1.0 {mark}"],
                     "older": [f"99.90 {mark}", f"1.0 {mark}"], "cpu": ["", ""]}


def test_an_older_ledger_still_reads_unchanged_and_the_report_marks_its_figures(tmp_path):
    from controller.local import init_lab
    from controller.core import figures
    from controller.lab.ledger import COLUMNS
    from controller.lab.report import build_report

    lab = init_lab(tmp_path / "lab", profile="tiny", data="synthetic")
    old_columns = COLUMNS[:COLUMNS.index(figures.COLUMN)]
    old = {"run_id": "exp-old-1", "created_at": "2026-11-01T10:00:00Z", "status": "succeeded",
           "experiment_id": "old", "val_bpb": "0.98", "peak_vram_mb": "1.0", "mfu_percent": "99.9",
           "promoted": "0", "backend": "local"}
    text = "\t".join(old_columns) + "\n" + "\t".join(old.get(c, "") for c in old_columns) + "\n"
    lab.ledger.path.write_text(text)
    new = {**old, "run_id": "exp-new-1", "experiment_id": "new", "peak_vram_mb": "777.0",
           "mfu_percent": "41.2", figures.COLUMN: ""}
    hid = {**old, "run_id": "exp-hid-1", "experiment_id": "hid", "mfu_percent": "41.2",
           figures.COLUMN: "peak_vram_mb"}
    assert lab.ledger.append(new) and lab.ledger.append(hid)
    assert lab.ledger.path.read_text().startswith(text), "what was recorded stays as it was"
    rows = {r["experiment_id"]: r for r in lab.ledger.rows()}
    assert figures.COLUMN not in rows["old"] and rows["old"]["mfu_percent"] == "99.9"
    md = build_report(lab)
    recent = {line.split("`")[1]: line for line in md.split("## Recent runs")[1].splitlines()
              if line.count("`") >= 2}
    mark = figures.MARK
    assert f"| 99.9 {mark} | 1.0 {mark} |" in recent["old"]
    assert "| 41.2 | 777.0 |" in recent["new"]
    assert f"| 41.2 | 1.0 {mark} |" in recent["hid"]
    assert f"{mark}: {figures.EXPLAINED}" in md


def test_a_seed_labs_rows_are_imported_as_its_train_pys_word(tmp_path):
    from controller.core import figures
    from controller.lab.ledger import SEED_COLUMNS
    from controller.lab.seed import SeedImport, read_ledger

    values = {"run_id": "run-1", "status": "succeeded", "val_bpb": "1.234", "training_seconds": "300.1",
              "total_seconds": "340.2", "peak_vram_mb": "40000", "mfu_percent": "38.5"}
    path = tmp_path / "results.tsv"
    path.write_text("\t".join(SEED_COLUMNS) + "\n" + "\t".join(values.get(c, "") for c in SEED_COLUMNS)
                    + "\n")
    found = SeedImport(source=str(tmp_path))
    read_ledger(path, found)
    assert found.rows[0][figures.COLUMN] == "val_bpb training_seconds total_seconds peak_vram_mb mfu_percent"
