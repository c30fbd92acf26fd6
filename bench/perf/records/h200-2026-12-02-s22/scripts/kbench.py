"""Fused lm_head+softcap+CE vs the compiled unfused path, one micro-batch's shapes, on CUDA."""
import sys, time, torch, torch.nn.functional as F
src = open(sys.argv[1]).read()
sec = src[src.index("if use_cuda and FUSED_LOSS:"):src.index("# Windows of the pre-tokenised")]
import importlib.util, os, tempfile
d = tempfile.mkdtemp(); f = os.path.join(d, "fusedsec.py")
open(f, "w").write("import torch\nuse_cuda = FUSED_LOSS = True\nLOGIT_SOFTCAP = 15.0\n" + sec)
spec = importlib.util.spec_from_file_location("fusedsec", f); mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
g = vars(mod)
B, T, D, V = 128, 2048, 512, 8192
x0 = torch.randn(B, T, D, device="cuda", dtype=torch.bfloat16)
w = (torch.randn(V, D, device="cuda") * 0.02).requires_grad_()
y = torch.randint(0, V, (B, T), device="cuda")

def ref(x, w, y):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        lg = F.linear(x, w).float()
    lg = 15.0 * torch.tanh(lg / 15.0)
    return F.cross_entropy(lg.view(-1, V), y.view(-1))
cref = torch.compile(ref, dynamic=False)

def run(fn, n=10):
    for _ in range(3):
        x = x0.clone().requires_grad_(); w.grad = None
        (fn(x, w, y) / 2).backward()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(n):
        x = x0.clone().requires_grad_()
        l = fn(x, w, y); (l / 2).backward()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3, float(l), x.grad.float(), w.grad.clone()

w.grad = None
tf, lf, gxf, _ = run(g["fused_head_loss"])
tr, lr_, gxr, _ = run(cref)
print(f"fused: {tf:.2f} ms per micro-batch (fwd+bwd incl. lm_head matmuls), loss {lf:.5f}")
print(f"compiled unfused: {tr:.2f} ms, loss {lr_:.5f}")
print(f"max |grad_x diff| {(gxf - gxr).abs().max().item():.3e} of max {gxr.abs().max().item():.3e}")
