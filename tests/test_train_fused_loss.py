"""bench/train.py's fused loss (CUDA only) gives the loss and gradients of the plain formula.

On a GPU, train.py computes lm_head + soft-cap + cross-entropy with a Triton kernel of its own
(`FusedHeadLoss`). CI has no GPU, so this runs that very code (cut out of train.py between its
section heading and the next one) in Triton's interpreter, on the CPU, and compares it with
the unfused path GPT.forward takes everywhere else: bf16 logits, fp32 soft-cap, mean
cross-entropy. The vocabulary is not a power of two (the kernel masks the tail of its block),
one target is the last token, and some logits are large enough to saturate the soft-cap.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# `./dev` installs triton here, off the venv's path: importable, it slows every export and evaluation.
TRITON = Path(sys.prefix) / "triton"
pytestmark = pytest.mark.skipif(not (TRITON / "triton").is_dir(),
                                reason=f"no triton in {TRITON} (./dev installs it there)")

CHECK = textwrap.dedent('''
    import importlib.util, sys
    import torch
    import torch.nn.functional as F

    source = open(sys.argv[1]).read()
    start = source.index("# The loss on CUDA")
    start = source.rindex("# ----", 0, start)
    section = source[start:source.index("# Windows of the pre-tokenised")]
    path = sys.argv[2]
    open(path, "w").write("import torch\\nuse_cuda = FUSED_LOSS = True\\nLOGIT_SOFTCAP = 15.0\\n" + section)
    spec = importlib.util.spec_from_file_location("fused", path)  # triton reads kernels from files
    fused = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fused)

    torch.manual_seed(0)
    B, T, D, V = 2, 5, 16, 300
    x0 = torch.randn(B, T, D).bfloat16()
    x0[0, 0] *= 400  # logits far past the soft-cap: tanh saturates
    w = torch.randn(V, D) * 0.5
    y = torch.randint(0, V, (B, T))
    y[1, 4] = V - 1  # the last token of the vocabulary

    def plain(x, w):
        logits = (x @ w.bfloat16().t()).float()  # autocast's matmul: bf16 in, bf16 out
        logits = 15.0 * torch.tanh(logits / 15.0)
        return F.cross_entropy(logits.view(-1, V), y.view(-1))

    results = []
    for fn in (fused.fused_head_loss, plain):
        x, wt = x0.clone().requires_grad_(), w.clone().requires_grad_()
        loss = fn(x, wt, y) if fn is fused.fused_head_loss else fn(x, wt)
        (loss / 4).backward()  # as train.py scales it for gradient accumulation
        results.append((loss.item(), x.grad.float(), wt.grad))
    (lf, gxf, gwf), (lp, gxp, gwp) = results
    assert gwf.dtype == torch.float32, gwf.dtype
    assert abs(lf - lp) < 1e-4 * abs(lp), (lf, lp)
    assert (gxf - gxp).abs().max() <= 0.02 * gxp.abs().max(), (gxf - gxp).abs().max()
    assert (gwf - gwp).abs().max() <= 0.02 * gwp.abs().max(), (gwf - gwp).abs().max()
    assert gxp.abs().max() > 0 and gwp.abs().max() > 0
    print("fused", lf, "plain", lp)
''')


def test_the_fused_loss_matches_the_plain_formula_in_triton_s_interpreter(tmp_path):
    script = tmp_path / "check.py"
    script.write_text(CHECK)
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(TRITON), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, str(script), str(REPO / "bench" / "train.py"),
                          str(tmp_path / "fused.py")], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "fused" in out.stdout
