"""The metric: validation bits per byte, computed from the model's logits.

`evaluate_bpb` scores the first `EVAL_TOKENS` tokens of the pinned validation split, never a
loss the model reports. The run harness's evaluator calls it on the exported program, with a
probe that checks causality in every batch (see evaluate.py); train.py calls it run by hand.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from prepare import EVAL_BATCH_SIZE, EVAL_TOKENS, MAX_SEQ_LEN, PrepareError
from prepare_cache import active_data


def _model_device(model: Any):
    import torch

    for t in itertools.chain(getattr(model, "parameters", lambda: [])(), getattr(model, "buffers", lambda: [])()):
        return t.device
    return torch.device("cpu")


def evaluate_bpb(model: Callable, batch_size: int = EVAL_BATCH_SIZE, *, tokens: np.ndarray | None = None,
                 token_bytes: np.ndarray | None = None, seq_len: int = MAX_SEQ_LEN,
                 eval_tokens: int = EVAL_TOKENS, device: Any = None,
                 probe: Callable[[int, list[int], Any, Any], None] | None = None) -> float:
    """Validation bits per byte of `model` (idx (B, T) -> logits (B, T, V)).

    The first eval_tokens tokens of the validation stream are cut into W
    windows of seq_len inputs (targets: the next token), scored in
    n = ceil(W / batch_size) calls in a strided order: call k holds windows
    k, k+n, k+2n, ..., so no row of a batch is the continuation of another
    (a model reading across rows finds no target there). Rows past W are
    padded with a repeat of window k and not scored. Every window is scored
    once, so the sum is the one a consecutive order gives.
    bpb = sum of cross-entropy (nats) over target tokens / (ln 2 * their bytes),
    where targets that are special tokens (0 bytes, e.g. BOS) are left out of
    both sums. Each prediction is scored over the text tokens alone (the
    special tokens' logits, and any past the byte table, are set to -inf for
    every model alike): a target that is never scored has no probability
    worth keeping, so a model that gave them none would otherwise gain
    -log(1 - p(special)) on every scored token for nothing it learned.
    Deterministic for the same weights on the same device.
    probe(k, windows, x, logits), if given, sees every scored batch (the
    evaluator's causality check runs there).
    """
    import torch
    import torch.nn.functional as F

    if tokens is None:
        tokens = active_data().tokens("val")
    if token_bytes is None:
        token_bytes = active_data().token_bytes()
    device = torch.device(device) if device is not None else _model_device(model)
    windows = min(eval_tokens, len(tokens) - 1) // seq_len
    if windows < 1:
        raise PrepareError(f"the validation split has {len(tokens)} tokens, fewer than one window of {seq_len}")
    stream = torch.from_numpy(np.asarray(tokens[: windows * seq_len + 1], dtype=np.int64))
    table = torch.from_numpy(np.asarray(token_bytes, dtype=np.int64)).to(device)
    nats = torch.zeros((), dtype=torch.float64, device=device)
    nbytes = torch.zeros((), dtype=torch.int64, device=device)
    batches = -(-windows // batch_size)
    not_text = None  # (V,) True for the logits no prediction is scored over
    with torch.no_grad():
        for k in range(batches):
            rows = [k + j * batches for j in range(batch_size)]  # strided: no row continues another
            valid = torch.tensor([w < windows for w in rows], device=device)
            rows = [w if w < windows else k for w in rows]  # padding, not scored
            idx = torch.tensor(rows)[:, None] * seq_len + torch.arange(seq_len + 1)[None, :]
            window = stream[idx].to(device)
            x, y = window[:, :-1].clone(), window[:, 1:]  # x owns its memory: writing to it cannot reach y
            logits = model(x)
            if tuple(logits.shape[:2]) != (batch_size, seq_len) or logits.dim() != 3:
                raise ValueError(f"model returned logits of shape {tuple(logits.shape)}, "
                                 f"expected ({batch_size}, {seq_len}, vocab)")
            if probe is not None:
                probe(k, rows, x, logits)
            vocab = logits.size(-1)
            if not_text is None or not_text.numel() != vocab:
                not_text = torch.ones(vocab, dtype=torch.bool, device=device)
                known = min(vocab, table.numel())
                not_text[:known] = table[:known] == 0
            text_logits = torch.where(not_text, float("-inf"), logits.float())
            ce = F.cross_entropy(text_logits.reshape(-1, vocab), y.reshape(-1), reduction="none")
            b = table[y]
            scored = (b > 0) & valid[:, None]
            nats += torch.where(scored, ce.view(batch_size, seq_len), 0.0).sum(dtype=torch.float64)
            nbytes += torch.where(scored, b, 0).sum()
    return float(nats.item() / (math.log(2) * max(int(nbytes.item()), 1)))
