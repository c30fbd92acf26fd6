import re
src = open("bench/train.py").read()
def rep(s, old, new):
    assert s.count(old) == 1, old
    return s.replace(old, new)

b128 = rep(src, "DEVICE_BATCH = 64  # sequences per forward/backward pass (64 x 2048 tokens)",
           "DEVICE_BATCH = 128  # sequences per forward/backward pass (128 x 2048 tokens)")

FUSED_KNOB = 'COMPILE = True  # torch.compile the model (CUDA only)\n'
FUSED_SECTION = '''

# ---------------------------------------------------------------------------
# The loss on CUDA: lm_head, soft-cap and cross-entropy fused
#
# Unfused, the (tokens x vocab) logits are written, read back by the loss, kept for the
# backward pass, read again and their gradient written: about a tenth of a step's GPU time,
# mostly moving bytes. Here one Triton program per token row reads its logits once, and
# writes the loss and, in place, the gradient of the mean loss; the two lm_head gradient
# matmuls follow at once, so no logits outlive the forward pass. The backward pass only
# scales what the forward pass saved. Same arithmetic as the unfused path (bf16 logits,
# fp32 soft-cap and softmax); on CPU the plain formula in GPT.forward runs.

if use_cuda and FUSED_LOSS:
    import triton
    import triton.language as tl

    @triton.jit
    def _softcap_cross_entropy(logits_ptr, targets_ptr, losses_ptr, cap, grad_scale,
                               V: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        inside = cols < V
        ptrs = logits_ptr + row * V + cols
        x = tl.load(ptrs, mask=inside, other=0.0).to(tl.float32)
        t = 1.0 - 2.0 / (tl.exp(2.0 * x / cap) + 1.0)  # tanh(x / cap), saturating cleanly at +-1
        z = tl.where(inside, cap * t, float("-inf"))  # soft-capped logits
        m = tl.max(z, 0)
        e = tl.exp(z - m)
        s = tl.sum(e, 0)
        hit = cols == tl.load(targets_ptr + row)
        tl.store(losses_ptr + row, tl.log(s) + m - tl.sum(tl.where(hit, z, 0.0), 0))
        # d(mean loss)/d(logit) = (softmax - onehot) * d(softcap)/d(logit) / rows
        grad = (e / s - tl.where(hit, 1.0, 0.0)) * (1.0 - t * t) * grad_scale
        tl.store(ptrs, grad.to(logits_ptr.dtype.element_ty), mask=inside)


class FusedHeadLoss(torch.autograd.Function):
    """Mean cross-entropy of soft-capped lm_head logits; the gradients are worked out in forward."""

    @staticmethod
    def forward(ctx, x, weight, targets):  # x: (B, T, D) bf16, weight: (V, D) fp32
        rows = x.reshape(-1, x.size(-1))
        w = weight.to(x.dtype)
        logits = rows @ w.t()
        n, v = logits.shape
        losses = torch.empty(n, device=x.device, dtype=torch.float32)
        _softcap_cross_entropy[(n,)](logits, targets.reshape(-1), losses, LOGIT_SOFTCAP, 1.0 / n,
                                     V=v, BLOCK=triton.next_power_of_2(v), num_warps=NUM_WARPS_LOSS)
        ctx.save_for_backward((logits @ w).view_as(x), logits.t() @ rows)  # logits now hold the gradient
        return losses.mean()

    @staticmethod
    def backward(ctx, grad_loss):
        grad_x, grad_w = ctx.saved_tensors
        return grad_x * grad_loss.to(grad_x.dtype), grad_w.float() * grad_loss, None


@torch.compiler.disable  # a Triton kernel of its own: torch.compile leaves it as it is
def fused_head_loss(x, weight, targets):
    return FusedHeadLoss.apply(x, weight, targets)

'''

def fused(s, warps=8):
    s = rep(s, FUSED_KNOB, FUSED_KNOB + "FUSED_LOSS = True  # CUDA: lm_head + soft-cap + cross-entropy in one pass (needs LOGIT_SOFTCAP > 0)\n")
    s = rep(s, "\n\n# Windows of the pre-tokenised", FUSED_SECTION.replace("NUM_WARPS_LOSS", str(warps)) + "\n# Windows of the pre-tokenised")
    s = rep(s, "            x = block(x, cos, sin, ve)\n        logits = self.lm_head(norm(x)).float()\n",
            "            x = block(x, cos, sin, ve)\n"
            "        if targets is not None and use_cuda and FUSED_LOSS and LOGIT_SOFTCAP > 0:\n"
            "            return fused_head_loss(norm(x).to(torch.bfloat16), self.lm_head.weight, targets)\n"
            "        logits = self.lm_head(norm(x)).float()\n")
    return s

def qkv(s):
    return rep(s, """        q = self.c_q(x).view(B, T, N_HEAD, HEAD_DIM)
        k = self.c_k(x).view(B, T, N_HEAD, HEAD_DIM)
        v = self.c_v(x).view(B, T, N_HEAD, HEAD_DIM)
""", """        # One matmul for queries, keys and values (three weights, as Muon sees them)
        qkv = F.linear(x, torch.cat((self.c_q.weight, self.c_k.weight, self.c_v.weight)))
        q, k, v = qkv.view(B, T, 3 * N_HEAD, HEAD_DIM).chunk(3, dim=2)
""")

def bf16res(s):
    return rep(s, "        x = norm(self.wte(idx))\n",
               "        x = norm(self.wte(idx)).to(ACT_DTYPE)  # the residual stream: bf16 on CUDA\n").replace(
        'use_cuda = device.type == "cuda"\n', 'use_cuda = device.type == "cuda"\nACT_DTYPE = torch.bfloat16 if use_cuda else torch.float32\n', 1)

out = {
    "base": src,
    "b128": b128,
    "b128_fused": fused(b128),
    "b128_fused_qkv": qkv(fused(b128)),
    "b128_fused_qkv_bf16": bf16res(qkv(fused(b128))),
    "b128_fused16w": fused(b128, 16),
}
for k, v in out.items():
    open(f".devtools/v/{k}.py", "w").write(v)
    compile(v, k, "exec")
print("ok")
