"""The hooks train.py calls: the step curve and the export of the trained model.

`report_step` appends JSON lines to `$AUTOLAB_CURVE_PATH`. `export_model` stops the harness's
clock (`training_done`) and writes the model as a `torch.export` program, `model.pt2`, that the
run harness evaluates in a separate process (see README.md, "Anti-forgery"); `export_program` is
the export itself, which the evaluator's rehearsal uses too.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from prepare import CURVE_EVERY_STEPS, EVAL_BATCH_SIZE, MAX_SEQ_LEN
from prepare_loader import training_done
from prepare_metric import _model_device


_curve_last_step: int | None = None


def report_step(step: int, loss: float, tokens_per_sec: float) -> None:
    """Append {"step", "loss", "tokens_per_sec", "time"} to $AUTOLAB_CURVE_PATH, at most
    one line per CURVE_EVERY_STEPS steps; a no-op when the variable is unset."""
    global _curve_last_step
    path = os.environ.get("AUTOLAB_CURVE_PATH")
    if not path or (_curve_last_step is not None and step - _curve_last_step < CURVE_EVERY_STEPS):
        return
    _curve_last_step = step
    line = {"step": int(step), "loss": float(loss), "tokens_per_sec": float(tokens_per_sec), "time": time.time()}
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")


def export_program(module: Any, example: Any, autocast: bool) -> Any:
    """The torch.export program of module(idx) -> logits for `example`'s shape, as the evaluator
    loads it: no gradients, state as parameters and buffers, no example inputs kept (saved, they
    would be a pickle; the evaluator refuses archives with one). With `autocast` the program runs
    the module under bf16 autocast, the region inside the graph (export_model sets it on CUDA;
    the evaluator's rehearsal exports its toy the same way)."""
    import torch

    class AutocastLogits(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.model = inner

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            if autocast:
                with torch.autocast(idx.device.type, dtype=torch.bfloat16):
                    return self.model(idx)
            return self.model(idx)

    with torch.no_grad():
        program = torch.export.export(AutocastLogits(module), (example,), strict=False)
    program.example_inputs = None
    return program


def export_model(model: Any, stats: dict[str, Any], export_dir: str | os.PathLike | None = None) -> Path | None:
    """Export the trained model for the harness's evaluator; returns the directory.

    Writes `model.pt2` (torch.export program of model(idx) -> logits for one
    fixed input shape, (EVAL_BATCH_SIZE, MAX_SEQ_LEN); on CUDA the program
    runs the model under bf16 autocast) and then `stats.json` (the training
    statistics: informational). Without export_dir or $AUTOLAB_EXPORT_DIR
    (a run by hand) it does nothing and returns None.
    """
    import torch

    training_done()
    export_dir = export_dir or os.environ.get("AUTOLAB_EXPORT_DIR")
    if not export_dir:
        return None
    out = Path(export_dir)
    out.mkdir(parents=True, exist_ok=True)
    module = getattr(model, "_orig_mod", model)  # the uncompiled module
    module.eval()
    device = _model_device(module)
    example = torch.zeros(EVAL_BATCH_SIZE, MAX_SEQ_LEN, dtype=torch.long, device=device)
    t0 = time.time()
    program = export_program(module, example, autocast=device.type == "cuda")
    torch.export.save(program, str(out / "model.tmp.pt2"))
    os.replace(out / "model.tmp.pt2", out / "model.pt2")
    record = {**{k: v for k, v in stats.items()}, "export_device": str(device),
              "export_seconds": round(time.time() - t0, 2)}
    (out / "stats.json.tmp").write_text(json.dumps(record, default=str))
    os.replace(out / "stats.json.tmp", out / "stats.json")
    return out
