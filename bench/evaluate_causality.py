"""3. Causality, in every scored batch: `CausalityProbe`.

For each batch `prepare.evaluate_bpb` scores, the probe runs a perturbed copy (each row cut at a
secret point and continued with other validation text, one row left whole, the rows shuffled)
and checks that no row's log-probabilities before its cut moved by more than the device's
tolerance; otherwise the verdict is NotCausal. evaluate.py's docstring explains why this leaves
no position unchecked.
"""

from __future__ import annotations

import math

from evaluate_common import Failure, NOT_CAUSAL, OTHER_TEXT_TRIES


class CausalityProbe:
    """For each scored batch, runs a perturbed copy and compares log-probabilities before each row's cut.

    `evaluate_bpb` calls it as probe(k, windows, x, logits) after scoring batch k.
    """

    def __init__(self, model, tokens, tolerance: float, seed: bytes, passes: int = 1) -> None:
        import numpy as np

        self.passes = passes  # perturbed copies per batch: enough that the cuts sweep every position
        self.model = model
        self.tokens = tokens
        self.tolerance = tolerance
        self.seed = seed
        self.rng = np.random.default_rng(int.from_bytes(seed, "little"))
        self._cuts: list[int] = []
        self.max_moved = 0.0  # the largest change seen in an honest run: the device's noise floor

    def _next_cut(self, seq_len: int) -> int:
        if not self._cuts:  # a shuffled sweep over every cut: rows >= seq_len cover each position
            self._cuts = [int(c) for c in self.rng.permutation(seq_len) + 1]
        return self._cuts.pop()

    def _other_text(self, length: int, avoid: int):
        import numpy as np

        for _ in range(OTHER_TEXT_TRIES):
            start = int(self.rng.integers(0, len(self.tokens) - length + 1))
            text = np.asarray(self.tokens[start : start + length], dtype=np.int64)
            if text[0] != avoid:
                break
        return text

    def _permutation(self, rows: int):
        while True:
            perm = self.rng.permutation(rows)
            if rows < 2 or (perm != range(rows)).any():
                return perm

    def __call__(self, batch: int, windows: list[int], x, logits) -> None:
        for _ in range(self.passes):
            self._check(batch, windows, x, logits)

    def _check(self, batch: int, windows: list[int], x, logits) -> None:
        import torch

        rows, seq_len = x.shape
        original = x.cpu()
        changed = original.clone()
        # One row per batch stays whole (cut at the end): every position of it is compared while only
        # the other rows change, so reading other rows is caught at any position, the last included.
        # The others take the next cuts of the sweep.
        whole = int(self.rng.integers(rows)) if rows > 1 else -1
        cuts = [seq_len if r == whole else self._next_cut(seq_len) for r in range(rows)]
        for r, cut in enumerate(cuts):
            if cut < seq_len:
                changed[r, cut:] = torch.from_numpy(self._other_text(seq_len - cut, int(original[r, cut])))
        perm = torch.from_numpy(self._permutation(rows))
        with torch.no_grad():
            out = self.model(changed[perm].to(x.device))
        if tuple(out.shape) != tuple(logits.shape):
            raise ValueError(f"model returned logits of shape {tuple(out.shape)} for the perturbed batch, "
                             f"{tuple(logits.shape)} for the scored one")
        unshuffled = torch.empty_like(out)
        unshuffled[perm.to(out.device)] = out
        cut_t = torch.tensor(cuts, dtype=torch.int64, device=out.device)
        moved_rows = _moved_before_cut(logits, unshuffled, cut_t)  # (rows, seq_len); 0 from each cut on
        worst_rows = moved_rows.amax(-1).tolist()  # one host read per batch
        for r, cut in enumerate(cuts):
            worst = worst_rows[r]
            self.max_moved = max(self.max_moved, worst)
            if worst > self.tolerance:
                moved = moved_rows[r, :cut]
                pos = int((moved > self.tolerance).nonzero()[0, 0])
                after = f"the tokens from position {cut} on were replaced and " if cut < seq_len else ""
                raise Failure(
                    "candidate",
                    f"the exported model is not causal: in batch {batch}, row {r} (validation window "
                    f"{windows[r]}), the log-probabilities at position {pos} moved by {float(moved[pos]):.3g} nats "
                    f"(tolerance {self.tolerance:g}) when {after}the rows of the batch were shuffled; a "
                    "prediction may depend only on its own row up to its own position "
                    f"(evaluation seed {self.seed.hex()})",
                    NOT_CAUSAL,
                )


def _same_bits(a, b) -> bool:
    """Equal dtype, shape and bytes (NaN included, which torch.equal calls unequal)."""
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))


def _moved(a, b):
    """Per position, the largest |a - b| over the vocabulary; equal entries (equal infinities too) count 0."""
    import torch

    same = (a == b) | (a.isnan() & b.isnan())
    return torch.where(same, 0.0, (a - b).abs().nan_to_num(nan=math.inf)).amax(-1)


def _moved_before_cut(a, b, cuts):
    """moved of the log-probabilities of logits a and b (rows, seq_len, vocab) at each position
    before its row's cut; 0 from the cut on. Rows and positions are independent, so this is what
    each row's a[r, :cut] and b[r, :cut] give on their own, for the whole batch in a few passes.

    Where every entry of both is finite (an honest model's), the entries that are equal differ
    by exactly 0, so the largest |a - b| is `_moved`'s answer without its masks; a position with
    anything else (an infinity, a NaN) is compared again by `_moved` itself.
    """
    import torch

    before = torch.arange(a.size(1), device=a.device)[None, :] < cuts[:, None]
    A, B = a[before].float().log_softmax(-1), b[before].float().log_softmax(-1)  # (positions, vocab)
    moved = (A - B).abs().amax(-1)
    odd = ~moved.isfinite()
    if bool(odd.any()):
        moved[odd] = _moved(A[odd], B[odd])
    out = torch.zeros(before.shape, dtype=moved.dtype, device=a.device)
    out[before] = moved
    return out
