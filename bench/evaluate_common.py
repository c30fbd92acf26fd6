"""What every part of the evaluator shares: its limits, its verdicts and the rules of a plain program.

A verdict is a `Failure` (who is to blame, why, and a reason_code; `refuse` makes the candidate's
ExportRefused) or success. The reason codes live here once: run.py copies them into
result["reason_code"]. The rules (which archive members, argument kinds and operators a plain
tensor program may have) are read by both the archive's checks (evaluate_archive, on model.json
before torch sees it) and the loaded program's (evaluate_program).
"""

from __future__ import annotations

import re

MAX_ARCHIVE_BYTES = 8 * 2**30  # the whole model.pt2, and the sum of its members
MAX_ARCHIVE_MEMBERS = 100_000
MAX_JSON_BYTES = 256 * 2**20  # model.json and the payload configs
# Largest change of a log-probability (nats) before a row's cut that still counts as "unchanged";
# a cheat that stays under it gains at most that many nats per token. An honest row is computed by
# the same kernels on the same shapes in both passes, and no kernel reduces across rows (matmul,
# attention and norms reduce within a row; masked attention scores contribute exactly 0), so the
# numbers are bit-equal: 0.0 measured for train.py's tiny model and a 512-wide 8-layer GPT on the
# CPU. The tolerance absorbs fp32 rounding (~1e-6 at logits of ~15) should a kernel change its
# summation order. CUDA runs the model in bf16 autocast, where a changed order would round to
# different bf16 values; it gets ten times more room, still small next to one bf16 step of a
# logit near the softcap of 15 (0.06 nats), which no useful tolerance could absorb anyway. The
# success JSON reports the largest change seen (causality_max_nats): the noise floor of a device.
CAUSALITY_TOLERANCE = {"cpu": 1e-4, "cuda": 1e-3}
OTHER_TEXT_TRIES = 16  # draws of replacement text until its first token differs from the original

# reason_code values (a fact lives once: run.py copies them into result["reason_code"])
SUCCEEDED = "Succeeded"
NO_EXPORT = "NoExport"
EXPORT_REFUSED = "ExportRefused"
NOT_CAUSAL = "NotCausal"
DATA_TAMPERED = "DataTampered"
EVALUATION_FAILED = "EvaluationFailed"
HARNESS_ERROR = "HarnessError"

# Members under the archive's single root folder; values are the bytes a text member must hold.
FIXED_MEMBERS = {"archive_format": {b"pt2"}, "archive_version": {b"0"}, "byteorder": {b"little"}}
COUNTER_MEMBERS = {".data/version", ".data/serialization_id"}  # decimal numbers the zip writer adds
PROGRAM_JSON = "models/model.json"
SAMPLE_INPUTS = "data/sample_inputs/model.pt"
PAYLOADS = {  # folder -> (its config member, the name pattern of its raw tensor members)
    "data/weights/": ("data/weights/model_weights_config.json", re.compile(r"weight_\d{1,9}")),
    "data/constants/": ("data/constants/model_constants_config.json", re.compile(r"tensor_\d{1,9}")),
}
# The argument kinds of model.json a plain tensor program needs. Left out: symbolic ints, floats
# and bools (their expressions are parsed by sympy's eval), custom objects, operators as values.
PLAIN_ARGUMENTS = frozenset({
    "as_none", "as_tensor", "as_tensors", "as_int", "as_ints", "as_float", "as_floats", "as_string",
    "as_strings", "as_scalar_type", "as_memory_format", "as_layout", "as_device", "as_bool", "as_bools",
    "as_graph", "as_optional_tensors", "as_optional_tensor", "as_int_lists", "as_float_lists",
})
ATEN_TARGET = re.compile(r"torch\.ops\.aten\.([A-Za-z0-9_]+)\.([A-Za-z0-9_]+)")
ALLOWED_HIGHER_ORDER_OPS = frozenset({"wrap_with_autocast", "wrap_with_set_grad_enabled"})
# Composite operators (a decomposition, no kernel of their own) that torch.export keeps whole and
# whose decompositions write nothing visible and draw no random numbers (attention's dropout is
# checked by its dropout_p). A program of these and of operators with kernels, none of them
# writing, has nothing for functionalisation to find: check_program checks it as it is. Any other
# composite sends the program through run_decompositions, which shows what it hides.
PLAIN_COMPOSITES = frozenset({
    "aten.linear.default", "aten.reshape.default", "aten.rms_norm.default", "aten.square.default",
    "aten.to.dtype", "aten.scaled_dot_product_attention.default",
})
# aten operators that read or write files, print, or change process-wide state.
DENIED_ATEN_OPS = frozenset({
    "from_file", "save", "_print", "warn", "manual_seed", "seed", "initial_seed", "set_data",
    "record_stream", "wait", "backward", "_backward", "retain_grad", "dist_backward",
    "_cufft_clear_plan_cache", "_cufft_set_plan_cache_max_size", "set_grad_enabled",
    # Uninitialised memory: what such a tensor holds is whatever the allocator last freed there, which
    # can be what the program itself left at the end of its previous call (state across calls, out of
    # the snapshot's sight: the probe's perturbed copy finds the scored batch there and repeats its
    # cheating logits). A tensor program builds its tensors with zeros, full, arange, ... instead.
    "empty", "empty_like", "empty_strided", "empty_permuted", "new_empty", "new_empty_strided",
    "empty_quantized", "_empty_affine_quantized", "_empty_per_channel_affine_quantized",
    "resize", "resize_", "resize_as", "resize_as_", "_resize_output", "_resize_output_",
})
STATE_NAME = re.compile(r"(?!__)[A-Za-z0-9_]+(\.(?!__)[A-Za-z0-9_]+)*")  # parameter/buffer/constant names


class Failure(Exception):
    def __init__(self, blame: str, reason: str, code: str) -> None:
        super().__init__(reason)
        self.blame = blame
        self.code = code


def refuse(reason: str) -> Failure:
    return Failure("candidate", f"the exported model is refused: {reason}", EXPORT_REFUSED)
