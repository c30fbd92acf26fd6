"""Where the evaluator's time goes, on the default profile's model (issue 15).

Builds the model bench/train.py defines (its source up to the torch.compile line, run
with the profile you name), exports it with prepare.export_model, then times each stage
of bench/evaluate.py on that archive in this process: reading and checking the zip,
torch.export.load, the program checks, .module(), the tensor snapshot. Scoring
(`prepare.evaluate_bpb` plus the causality probe) needs the validation data and, at
this size, a GPU: with --data-dir it also runs the real evaluator as the harness does
(`python -I evaluate.py`) and prints its own stage_seconds.

    python bench/perf/evaluator_bench.py [--profile default] [--repeat 3] [--data-dir DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]


def build_model(profile: str):
    """train.py's model, initialised, on its device: the master as a candidate would export it."""
    os.environ["AUTOLAB_BENCH_PROFILE"] = profile
    os.environ.pop("AUTOLAB_EXPORT_DIR", None)
    sys.path.insert(0, str(BENCH))
    source = (BENCH / "train.py").read_text()
    cut = source.index("model = torch.compile(")
    scope: dict = {"__name__": "train_model_only", "__file__": str(BENCH / "train.py")}
    exec(compile(source[:cut], str(BENCH / "train.py"), "exec"), scope)
    return scope["raw_model"], scope["prepare"]


def timed_stages(evaluate, prepare, export_dir: Path) -> dict[str, float]:
    stages = evaluate.Stages()
    members = evaluate.check_archive(evaluate.read_archive(export_dir / "model.pt2"))
    stages.done("read_archive")
    program = evaluate.load_program(members)
    stages.done("load")
    evaluate.check_program(program, prepare.EVAL_BATCH_SIZE, prepare.MAX_SEQ_LEN)
    stages.done("check_program")
    model = program.module()
    stages.done("module")
    evaluate.snapshot(model)
    stages.done("snapshot")
    return stages.seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="default")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--data-dir", type=Path, help="a prepared data directory: also run the real evaluator")
    ap.add_argument("--profile-scoring", action="store_true",
                    help="with --data-dir: time scoring in this process with and without the causality "
                         "probe, and print torch.profiler's top operations of one probed scoring")
    a = ap.parse_args()
    t0 = time.perf_counter()
    model, prepare = build_model(a.profile)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters on "
          f"{prepare._model_device(model)} ({time.perf_counter() - t0:.1f}s to build)")
    import importlib.util
    spec = importlib.util.spec_from_file_location("evaluate", BENCH / "evaluate.py")
    evaluate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(evaluate)
    with tempfile.TemporaryDirectory(prefix="autolab-evalbench-") as tmp:
        t0 = time.perf_counter()
        export_dir = prepare.export_model(model, {"num_steps": 0}, export_dir=Path(tmp) / "export")
        size = (export_dir / "model.pt2").stat().st_size
        print(f"export: {time.perf_counter() - t0:.2f}s, model.pt2 {size / 2**20:.0f} MiB")
        for i in range(a.repeat):
            seconds = timed_stages(evaluate, prepare, export_dir)
            print(f"in-process stages, round {i + 1}: " + ", ".join(f"{k} {v:.2f}s" for k, v in seconds.items())
                  + f"; total {sum(seconds.values()):.2f}s")
        if a.data_dir:
            digest = {n: hashlib.sha256((a.data_dir / n).read_bytes()).hexdigest()
                      for n in ("val.bin", "token_bytes.npy")}
            out = Path(tmp) / "evaluation.json"
            env = {**os.environ, "AUTOLAB_BENCH_PROFILE": a.profile}
            t0 = time.perf_counter()
            proc = subprocess.run(
                [sys.executable, "-I", str(BENCH / "evaluate.py"), "--export-dir", str(export_dir),
                 "--data-dir", str(a.data_dir), "--val-sha256", digest["val.bin"],
                 "--token-bytes-sha256", digest["token_bytes.npy"], "--out", str(out)],
                env=env, capture_output=True, text=True)
            wall = time.perf_counter() - t0
            result = json.loads(out.read_text()) if out.exists() else {"error": proc.stderr[-2000:]}
            print(f"evaluator process: {wall:.2f}s wall; stages {result.get('stage_seconds')}; "
                  f"eval_seconds {result.get('eval_seconds')}; ok {result.get('ok')} "
                  f"{result.get('reason', '')}")
            if a.profile_scoring:
                profile_scoring(evaluate, prepare, export_dir, a.data_dir, digest)
    return 0


def profile_scoring(evaluate, prepare, export_dir: Path, data_dir: Path, digest: dict[str, str]) -> None:
    """Scoring's seconds without and with the probe, then where one probed scoring spends them."""
    import torch

    tokens, token_bytes = evaluate.read_data(data_dir, digest["val.bin"], digest["token_bytes.npy"])
    members = evaluate.check_archive(evaluate.read_archive(export_dir / "model.pt2"))
    model = evaluate.load_program(members).module()
    windows = max(1, min(prepare.EVAL_TOKENS, len(tokens) - 1) // prepare.MAX_SEQ_LEN)
    cuts_per_pass = -(-windows // prepare.EVAL_BATCH_SIZE) * max(1, prepare.EVAL_BATCH_SIZE - 1)
    passes = -(-prepare.MAX_SEQ_LEN // cuts_per_pass)

    def sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def score(probed: bool) -> float:
        probe = evaluate.CausalityProbe(model, tokens, 1.0, b"bench", passes=passes) if probed else None
        sync()
        t0 = time.perf_counter()
        prepare.evaluate_bpb(model, prepare.EVAL_BATCH_SIZE, tokens=tokens, token_bytes=token_bytes, probe=probe)
        sync()
        return time.perf_counter() - t0

    score(False)  # warm-up: the allocator and the first kernels
    plain, probed = score(False), score(True)
    print(f"scoring in this process ({windows} windows, {passes} probe passes): without the probe "
          f"{plain:.2f}s, with it {probed:.2f}s")
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        score(True)
    table = prof.key_averages()
    if torch.cuda.is_available():
        print(table.table(sort_by="cuda_time_total", row_limit=25))
    print(table.table(sort_by="cpu_time_total", row_limit=15))
    return 0


if __name__ == "__main__":
    sys.exit(main())
