"""The evaluator: measures val_bpb of an exported model in a process of its own.

The run harness starts this after the candidate has exited. It loads
`model.pt2` with `torch.export.load` (a graph of tensor operations plus
weights: no Python code of the candidate comes with it), checks that the
validation tokens and the byte table are the ones prepared before the
candidate ran (sha256 of the bytes it then uses), checks that the program is
causal (the logits of a position do not move when later positions, or other
rows of the batch, change), and scores it with `prepare.evaluate_bpb`.

It writes one JSON object to --out: {"ok": true, "val_bpb", "num_params",
"eval_seconds", "device"} or {"ok": false, "blame": "candidate"|"harness",
"reason"}. "harness" means the fault is not the candidate's (e.g. no GPU for
a program exported on one): the run is an infrastructure error.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

CAUSALITY_TOLERANCE = 1e-2  # nats; the same kernels on the same shapes give equal numbers


class Failure(Exception):
    def __init__(self, blame: str, reason: str) -> None:
        super().__init__(reason)
        self.blame = blame


def check_causal(model, tokens, token_bytes, batch: int, seq_len: int) -> None:
    """Raise Failure if row 0's first half of logits depends on anything after it."""
    import numpy as np
    import torch

    import prepare

    device = prepare._model_device(model)
    n = batch * seq_len
    x = torch.from_numpy(np.asarray(tokens[:n], dtype=np.int64)).view(batch, seq_len)
    if len(tokens) >= 2 * n:
        other = torch.from_numpy(np.asarray(tokens[n : 2 * n], dtype=np.int64)).view(batch, seq_len)
    else:
        gen = torch.Generator().manual_seed(0)
        other = torch.randint(len(prepare.SPECIAL_TOKENS), len(token_bytes), (batch, seq_len), generator=gen)
    half = seq_len // 2
    changed = x.clone()
    changed[0, half:] = other[0, half:]
    changed[1:] = other[1:]
    with torch.no_grad():
        a = model(x.to(device))[0, :half].float().log_softmax(-1)
        b = model(changed.to(device))[0, :half].float().log_softmax(-1)
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return  # non-finite logits fail the metric itself
    diff = (a - b).abs().max().item()
    if diff > CAUSALITY_TOLERANCE:
        raise Failure(
            "candidate",
            f"the exported model is not causal: its predictions for early positions change by up to {diff:.3g} "
            "nats when later tokens or other rows of the batch change",
        )


def evaluate(export_dir: Path, data_dir: Path, val_sha256: str, token_bytes_sha256: str) -> dict:
    import numpy as np
    import torch

    import prepare

    val_bytes = (data_dir / "val.bin").read_bytes()
    if hashlib.sha256(val_bytes).hexdigest() != val_sha256:
        raise Failure("candidate", f"{data_dir / 'val.bin'} changed during the run; the result is void")
    tb_bytes = (data_dir / "token_bytes.npy").read_bytes()
    if hashlib.sha256(tb_bytes).hexdigest() != token_bytes_sha256:
        raise Failure("candidate", f"{data_dir / 'token_bytes.npy'} changed during the run; the result is void")
    tokens = np.frombuffer(val_bytes, dtype=np.uint16)
    token_bytes = np.load(io.BytesIO(tb_bytes))

    path = export_dir / "model.pt2"
    try:
        program = torch.export.load(str(path))
        model = program.module()
    except Exception as e:
        raise Failure("candidate", f"cannot load the exported model {path}: {type(e).__name__}: {e}") from e
    device = prepare._model_device(model)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise Failure("harness", "the model was exported on a GPU but the evaluator has none")
    t0 = time.time()
    try:
        check_causal(program.module(), tokens, token_bytes, prepare.EVAL_BATCH_SIZE, prepare.MAX_SEQ_LEN)
        val_bpb = prepare.evaluate_bpb(model, prepare.EVAL_BATCH_SIZE, tokens=tokens, token_bytes=token_bytes)
    except Failure:
        raise
    except Exception as e:
        raise Failure("candidate", f"running the exported model failed: {type(e).__name__}: {e}") from e
    return {
        "ok": True,
        "val_bpb": val_bpb,
        "num_params": sum(p.numel() for p in model.parameters()),
        "eval_seconds": round(time.time() - t0, 2),
        "device": str(device),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Measure val_bpb of an exported model (run by run.py).")
    parser.add_argument("--export-dir", type=Path, required=True)
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--val-sha256", required=True)
    parser.add_argument("--token-bytes-sha256", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        result = evaluate(args.export_dir, args.data_dir, args.val_sha256, args.token_bytes_sha256)
        if not math.isfinite(result["val_bpb"]):
            result = {"ok": False, "blame": "candidate", "reason": f"val_bpb is {result['val_bpb']} (not finite)"}
    except Failure as e:
        result = {"ok": False, "blame": e.blame, "reason": str(e)}
    except Exception as e:  # a fault of the evaluator itself or of its environment
        traceback.print_exc()
        result = {"ok": False, "blame": "harness", "reason": f"evaluator error: {type(e).__name__}: {e}"}
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, args.out)
    print(json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
