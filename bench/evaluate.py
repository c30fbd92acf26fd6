"""The evaluator: measures val_bpb of an exported model that hostile code may have written.

The run harness starts this after the candidate and every process it left
have gone, as `python -I evaluate.py ...` (isolated: no PYTHONPATH, no user
site, no working directory on sys.path). It imports nothing but the standard
library, the installed packages and the harness's own modules next to this file
(its parts and prepare.py; see below). The archive `model.pt2` is the only thing
the candidate made that it reads, and it treats it as hostile:

1. The archive, before torch sees it. `torch.export.load` would unpickle
   several members (sample inputs with a fallback to full pickle, weights or
   constants marked `use_pickle`, torchbind and opaque objects), `exec` the
   program's `guards_code`, `eval` symbolic shape expressions through sympy,
   and load AOTInductor shared libraries. So the zip is read once into memory
   and every member is checked against the layout that `prepare.export_model`
   writes (torch 2.11-2.13):

       <root>/archive_format, archive_version, byteorder, .data/version, .data/serialization_id
       <root>/models/model.json                          the graph, as JSON
       <root>/data/weights/model_weights_config.json     name -> raw tensor member
       <root>/data/weights/weight_<n>                    raw tensor bytes, never a pickle
       <root>/data/constants/model_constants_config.json
       <root>/data/constants/tensor_<n>
       <root>/data/sample_inputs/model.pt                must be EMPTY (export_model saves none)

   Anything else, a payload with `use_pickle`, a compressed, encrypted,
   duplicated, absolute or `..` member, or an archive over MAX_ARCHIVE_BYTES
   is refused (reason_code ExportRefused). In `model.json` only plain
   argument kinds are allowed (no symbolic shapes, custom objects or
   operators passed as values), `guards_code` and `range_constraints` must be
   empty, and every node calls an `aten` operator (minus the few that touch
   files or global state) or an allowed higher-order operator (the bf16
   autocast region). Node metadata (stack traces, module paths) is dropped.
   Torch then loads a NEW archive rebuilt from exactly the checked bytes, so
   no zip-parser disagreement can slip a member past the checks.
2. The loaded program. Every call is an aten OpOverload, an allowed
   higher-order operator or `getitem`. Functionalised
   (`run_decompositions({})`; skipped when no operator writes to a tensor
   and every composite one is a known plain one, as in train.py's model,
   for then it would change nothing), it must mutate nothing (no buffer, parameter
   or input mutation; torch 2.13's export leaves `self.calls.add_(1)` as an
   in-place op with an empty `buffers_to_mutate`, functionalisation surfaces
   it) and call no random-number operator. After scoring, every tensor of
   the module must be bit-for-bit what it was: a program whose output can
   depend on how often it was called is refused.
3. Causality, in every scored batch. `prepare.evaluate_bpb` scores windows
   in a strided order (batch k holds windows k, k+n, k+2n, ...), so no row
   of a batch continues another. For each batch the evaluator also runs a
   perturbed copy: each row gets a cut point c (secret per-evaluation seed
   from os.urandom; cuts are drawn as shuffled sweeps over 1..T so every
   position is a cut once the rows outnumber it), the tokens from c on are
   replaced with real validation text from elsewhere in the stream (its
   first token differs from the original), one row per batch is left whole
   (every position of it checked while only its neighbours change), and the
   rows are shuffled. The
   log-probabilities of each row before its cut must not move by more than
   CAUSALITY_TOLERANCE; otherwise reason_code NotCausal, naming the batch,
   row, window and position. A model that reads token t+1 at position t is
   caught in a row whose cut is t+1; reading other rows is caught because
   the neighbours change. Together with the refusal of mutable state this
   leaves no calls, rows or positions where cheating goes unchecked, only
   positions that happen not to be cut (where the scored rows are fewer than
   T, as in the tiny profile, each batch gets as many perturbed copies as
   it takes for the cuts to sweep every position): a peek at one position in every row
   survives with probability (1 - 1/T)^rows, zero once rows >= T (the
   default profile scores 5120 rows of 2048).

4. What the model costs, read off the checked graph (`model_figures`), for
   the harness's own MFU: the benchmark's FLOPs per token, as train.py counts
   them (6 per parameter a token's matmuls use, forward and backward; token
   and value embeddings are lookups and cost none; plus 12 x seq_len x width
   per attention layer, PaLM's convention), and the depth, one layer per
   scaled_dot_product_attention call. Parameters the graph never reads are
   not counted, so a candidate cannot raise its MFU by exporting weights it
   does not use. Informational: nothing here fails an evaluation.

It writes one JSON object to --out: {"ok": true, "val_bpb", "num_params",
"flops_per_token", "depth", "device_name", "eval_seconds", "device", "reason_code": "Succeeded",
"causality_max_nats", "stage_seconds"} or {"ok": false,
"blame": "candidate"|"harness", "reason", "reason_code"}. "harness" means the
fault is not the candidate's (e.g. no GPU for a program exported on one):
the run is an infrastructure error. `device_name` is the GPU's name as CUDA
gives it (None on a CPU): run.py looks up its peak FLOP/s by it.

With --tell-ready FILE it writes FILE once it is ready (the data read and
checked, torch imported, the device opened) and before it reads anything of
the export. An evaluator that dies with no verdict and no FILE died of its
environment (a broken interpreter, the kernel's OOM killer), never of the
candidate's model: the harness does not blame the candidate for it.

The parts, one concern each, are sibling modules pinned with this file (bench/HARNESS):

    evaluate.py             the command line and an evaluation put together (this file)
    evaluate_common.py      limits, reason codes, Failure, the rules of a plain program
    evaluate_archive.py     1. the archive, before torch sees it
    evaluate_program.py     2. the loaded program
    evaluate_causality.py   3. causality, in every scored batch
    evaluate_figures.py     4. what the model costs

`python -I` puts neither this file's directory nor the working directory on sys.path. This file
puts its own directory first, so its siblings and prepare.py (with its siblings) are imported
from the pinned copy beside it and from nowhere else; a module of those names already imported
from another directory (a process that imported another copy of the harness) is forgotten first.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import io
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))  # -I left it off: the siblings come from here, first (see above)


def _ours(name: str) -> bool:
    return name == "prepare" or name.startswith(("prepare_", "evaluate_"))


def _own_modules() -> None:
    """Forget a module of the evaluator's or of prepare.py's imported from another directory (a
    caller that imported another copy of the harness in this process): this copy runs with its
    own siblings only."""
    for name in list(sys.modules):
        path = getattr(sys.modules[name], "__file__", None)
        if _ours(name) and path and Path(path).resolve().parent != BENCH_DIR:
            del sys.modules[name]


_own_modules()

# The parts, each in its sibling module; their names are importable from here too.
from evaluate_common import (MAX_ARCHIVE_BYTES, MAX_ARCHIVE_MEMBERS, MAX_JSON_BYTES,
                             CAUSALITY_TOLERANCE, OTHER_TEXT_TRIES, SUCCEEDED, NO_EXPORT,
                             EXPORT_REFUSED, NOT_CAUSAL, DATA_TAMPERED, EVALUATION_FAILED,
                             HARNESS_ERROR, FIXED_MEMBERS, COUNTER_MEMBERS, PROGRAM_JSON,
                             SAMPLE_INPUTS, PAYLOADS, PLAIN_ARGUMENTS, ATEN_TARGET,
                             ALLOWED_HIGHER_ORDER_OPS, PLAIN_COMPOSITES, DENIED_ATEN_OPS,
                             STATE_NAME, Failure, refuse)  # noqa: E402,F401
from evaluate_archive import (read_archive, _member_parts, check_archive, _expected_member,
                              _check_payload_config, _json_member, check_program_json,
                              _check_signature_json, _walk_program_json, _check_target_json,
                              rebuild_archive)  # noqa: E402,F401
from evaluate_program import (load_program, check_program, _plainly_functional,
                              _draws_random_numbers, _check_calls, _attr, snapshot, check_state,
                              check_unchanged)  # noqa: E402,F401
from evaluate_causality import (CausalityProbe, _same_bits, _moved, _moved_before_cut)  # noqa: E402,F401
from evaluate_figures import (MATMUL_FLOPS_PER_PARAM, PASS_THROUGH_OPS, model_figures,
                              _figures_or_none, _device_name)  # noqa: E402,F401


def load_prepare():
    """The harness's prepare.py next to this file, by path; its siblings come from this directory
    too (first on sys.path, and any copy from elsewhere forgotten)."""
    path = BENCH_DIR / "prepare.py"
    loaded = sys.modules.get("prepare")
    if loaded is not None and Path(getattr(loaded, "__file__", "") or "").resolve() == path:
        return loaded
    _own_modules()
    spec = importlib.util.spec_from_file_location("prepare", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["prepare"] = module
    spec.loader.exec_module(module)
    return module



# ---------------------------------------------------------------------------
# 5. Putting it together


class Stages:
    """Seconds per stage of one evaluation, in order: where the evaluator's time goes."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def done(self, stage: str) -> None:
        now = time.perf_counter()
        self.seconds[stage] = round(self.seconds.get(stage, 0.0) + now - self._last, 2)
        self._last = now


def read_data(data_dir: Path, val_sha256: str, token_bytes_sha256: str):
    import numpy as np

    val_bytes = (data_dir / "val.bin").read_bytes()
    if hashlib.sha256(val_bytes).hexdigest() != val_sha256:
        raise Failure("candidate", f"{data_dir / 'val.bin'} does not match the sha256 its manifest records (it "
                                   "changed since it was prepared); the result is void", DATA_TAMPERED)
    tb_bytes = (data_dir / "token_bytes.npy").read_bytes()
    if hashlib.sha256(tb_bytes).hexdigest() != token_bytes_sha256:
        raise Failure("candidate", f"{data_dir / 'token_bytes.npy'} does not match the sha256 its manifest "
                                   "records (it changed since it was prepared); the result is void", DATA_TAMPERED)
    return np.frombuffer(val_bytes, dtype=np.uint16), np.load(io.BytesIO(tb_bytes), allow_pickle=False)


def rehearse(device: str, autocast: bool | None = None) -> None:
    """Export, load, check and run a toy program of our own the way a candidate's is.

    The first torch.export.load, run_decompositions and run of a process pay for imports and
    tables that every later one reuses (about 2 s on an H200 machine). A waiting evaluator pays
    them here, before the candidate's export exists; nothing of the toy is kept. The toy is
    exported by prepare.export_program, the function export_model uses (bf16 autocast inside the
    program on CUDA), so the rehearsal fails where a real export would.
    """
    import torch
    import torch.nn.functional as F

    class Toy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = torch.nn.Embedding(32, 16)
            self.proj = torch.nn.Linear(16, 16, bias=False)
            self.head = torch.nn.Linear(16, 32, bias=False)

        def forward(self, idx):
            x = F.rms_norm(self.wte(idx), (16,))
            q = self.proj(x).view(idx.size(0), idx.size(1), 1, 16).transpose(1, 2)
            x = x + F.scaled_dot_product_attention(q, q, q, is_causal=True).transpose(1, 2).reshape(x.shape)
            return (4.0 * torch.tanh(self.head(F.relu(x).square()) / 4.0)).float()

    idx = torch.zeros(2, 8, dtype=torch.int64, device=device)
    autocast = device == "cuda" if autocast is None else autocast
    program = load_prepare().export_program(Toy().to(device), idx, autocast=autocast)
    buf = io.BytesIO()
    torch.export.save(program, buf)
    buf.seek(0)
    program = torch.export.load(buf)
    check_program(program, 2, 8)
    with torch.no_grad():
        program.module()(idx).sum().item()


def _uses_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def get_ready(data_dir: Path, val_sha256: str, token_bytes_sha256: str,
              rehearsal: bool = False) -> tuple[Any, Any, dict[str, float]]:
    """What needs no export: torch imported, the GPU opened, the validation data read and checked.

    The harness starts the evaluator this far while the candidate is still starting up
    (--export-dir -), so these seconds are not spent after training; with `rehearsal` on a GPU
    it also rehearses an evaluation (`rehearse`). Returns the tokens, the token byte lengths and
    the seconds of each step.
    """
    stages = Stages()
    tokens, token_bytes = read_data(data_dir, val_sha256, token_bytes_sha256)  # first: the data as it was
    stages.done("data")
    load_prepare()
    import torch

    stages.done("import")
    if torch.cuda.is_available():  # the CUDA context and the matmul libraries load lazily: now
        a = torch.ones(64, 64, device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            (a @ a).sum().item()
        stages.done("device")
        if rehearsal:
            try:
                rehearse("cuda")
            except Exception as e:  # only a head start: the evaluation itself goes on without it
                print(f"the rehearsal failed ({type(e).__name__}: {e}); evaluating without it", flush=True)
            stages.done("rehearsal")
    return tokens, token_bytes, stages.seconds


def evaluate(export_dir: Path, data_dir: Path, val_sha256: str, token_bytes_sha256: str,
             seed: bytes | None = None, ready: tuple[Any, Any, dict[str, float]] | None = None,
             tell_peak: Path | None = None, candidate_had_gpu: bool = True) -> dict:
    tokens, token_bytes, early = ready or get_ready(data_dir, val_sha256, token_bytes_sha256)
    prepare = load_prepare()
    stages = Stages()
    try:  # whatever a malformed archive makes the checks or torch raise is the candidate's fault
        members = check_archive(read_archive(export_dir / "model.pt2"))
        stages.done("read_archive")
        program = load_program(members, candidate_had_gpu)
        del members
        stages.done("load")
        check_program(program, prepare.EVAL_BATCH_SIZE, prepare.MAX_SEQ_LEN)
        stages.done("check_program")
        figures = _figures_or_none(program)
        stages.done("figures")
        model = program.module()
        check_state(model)
        stages.done("module")
    except Failure:
        raise
    except Exception as e:
        raise refuse(f"{type(e).__name__}: {e}") from e
    device = prepare._model_device(model)
    windows = max(1, min(prepare.EVAL_TOKENS, len(tokens) - 1) // prepare.MAX_SEQ_LEN)
    batch = prepare.EVAL_BATCH_SIZE
    cuts_per_pass = -(-windows // batch) * max(1, batch - 1)  # one row of each batch stays whole
    probe = CausalityProbe(model, tokens, CAUSALITY_TOLERANCE.get(device.type, CAUSALITY_TOLERANCE["cuda"]),
                           seed or os.urandom(16), passes=-(-prepare.MAX_SEQ_LEN // cuts_per_pass))
    try:  # check_state bounds the copies by the archive's bytes: failing here is the candidate's doing
        before = snapshot(model)
    except Exception as e:
        raise refuse(f"its tensors cannot be copied: {type(e).__name__}: {e}") from e
    stages.done("snapshot")
    t0 = time.time()
    try:
        def probe_and_tell(k: int, rows: list[int], x, logits) -> None:
            probe(k, rows, x, logits)
            if k == 1 and tell_peak is not None and device.type == "cuda":  # every batch has the same shapes:
                tell_peak.write_text("the evaluation holds the GPU memory it needs\n")  # it reuses it

        val_bpb = prepare.evaluate_bpb(model, prepare.EVAL_BATCH_SIZE, tokens=tokens, token_bytes=token_bytes,
                                       probe=probe_and_tell)
    except Failure:
        raise
    except Exception as e:
        raise Failure("candidate", f"running the exported model failed: {type(e).__name__}: {e}",
                      EVALUATION_FAILED) from e
    stages.done("score")
    try:
        check_unchanged(model, before)
    except Failure:
        raise
    except Exception as e:
        raise refuse(f"its tensors cannot be compared after scoring: {type(e).__name__}: {e}") from e
    stages.done("check_unchanged")
    if not math.isfinite(val_bpb):
        raise Failure("candidate", f"val_bpb is {val_bpb} (not finite)", EVALUATION_FAILED)
    return {
        "ok": True,
        "val_bpb": val_bpb,
        "num_params": sum(p.numel() for p in model.parameters()),
        "flops_per_token": figures["flops_per_token"],
        "depth": figures["depth"],
        "eval_seconds": round(time.time() - t0, 2),
        "device": str(device),
        "device_name": _device_name(device),
        "reason_code": SUCCEEDED,
        "causality_max_nats": probe.max_moved,
        "stage_seconds": stages.seconds,
        "ready_seconds": early,
    }


def _not_dumpable() -> None:
    """No /proc/<pid>/fd, mem or environ of this process for anyone but root (Linux prctl).

    An evaluator waiting for its export lives while the candidate runs: where the
    candidate shares its uid (an unsandboxed run), this keeps it from opening the
    evaluator's stdin through /proc and naming an export of its own choosing. Where
    the call fails the evaluator does not wait (a harness error, not an open door).
    """
    if not sys.platform.startswith("linux"):
        return  # no /proc/<pid>/fd to close
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE, 0
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Measure val_bpb of an exported model (run by run.py).")
    parser.add_argument("--export-dir", required=True,
                        help="the directory holding model.pt2; '-': get ready first (torch, the GPU, the data), "
                             "then read the directory from the first line of stdin (end of input: exit, "
                             "writing nothing)")
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--val-sha256", required=True)
    parser.add_argument("--token-bytes-sha256", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tell-peak", type=Path, default=None, metavar="FILE",
                        help="write FILE once the evaluation holds all the GPU memory it will use (two batches "
                             "scored and probed; the allocator keeps what it took): another process may then "
                             "use the GPU's free memory without starving this evaluation")
    parser.add_argument("--tell-ready", type=Path, default=None, metavar="FILE",
                        help="write FILE once ready (data checked, torch imported, device opened), before "
                             "anything of the export is read")
    parser.add_argument("--candidate-had-no-gpu", action="store_true",
                        help="the candidate trained without a GPU: an archive naming a CUDA device is refused "
                             "(the candidate's fault), not reported as this machine's")
    parser.add_argument("--seed", type=bytes.fromhex, default=None,
                        help="hex seed of the causality check, to reproduce a report (default: os.urandom)")
    args = parser.parse_args(argv)
    try:
        ready = None
        export_dir = args.export_dir
        if export_dir == "-":
            _not_dumpable()
        ready = get_ready(args.data_dir, args.val_sha256, args.token_bytes_sha256, rehearsal=export_dir == "-")
        if args.tell_ready is not None:
            args.tell_ready.write_text("ready: the export has not been read\n")
        if export_dir == "-":
            export_dir = sys.stdin.readline().rstrip("\n")
            if not export_dir:
                return 0  # the run ended before there was an export to measure
            if args.tell_peak is not None and not _uses_gpu():  # it will hold no GPU memory at all
                args.tell_peak.write_text("the evaluation uses no GPU memory\n")
        result = evaluate(Path(export_dir), args.data_dir, args.val_sha256, args.token_bytes_sha256, args.seed,
                          ready, args.tell_peak, not args.candidate_had_no_gpu)
    except Failure as e:
        result = {"ok": False, "blame": e.blame, "reason": str(e), "reason_code": e.code}
    except Exception as e:  # a fault of the evaluator itself or of its environment
        traceback.print_exc()
        result = {"ok": False, "blame": "harness", "reason": f"evaluator error: {type(e).__name__}: {e}",
                  "reason_code": HARNESS_ERROR}
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, args.out)
    print(json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # The verdict is written: skip the interpreter's and torch's teardown (finalisers, the CUDA
    # context's), which took 1.9-2.6 s after every evaluation on an H200 (docs/results.md).
    os._exit(code)
