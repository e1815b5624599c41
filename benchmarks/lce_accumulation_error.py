"""Relative error (Frobenius) of dW and dx against a float32 reference computed from the same bf16 inputs, at the
Llama-3 head (hidden 4096, vocab 128256), 8192 and 16384 tokens: the default (dW summed in bf16 over the chunks),
accum_dtype=torch.float32, memory="low". Run on a GPU:
    python benchmarks/lce_accumulation_error.py"""
import torch
import torch.nn.functional as F

from onepass import ops

for tokens in (8192, 16384):
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(tokens, 4096, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(128256, 4096, device="cuda", generator=g) / 64).to(torch.bfloat16)
    t = torch.randint(0, 128256, (tokens,), device="cuda", generator=g)
    hf, wf = h.float().requires_grad_(True), w.float().requires_grad_(True)
    F.cross_entropy(F.linear(hf, wf), t).backward()
    ref_dh, ref_dw = hf.grad, wf.grad
    del hf, wf
    rounding = ((ref_dw.bfloat16().float() - ref_dw).norm() / ref_dw.norm()).item()
    print(f"{tokens} tokens: the fp32 dW rounded once to bf16: {rounding:.2e}")
    variants = ("default", {}), ("accum fp32", {"accum_dtype": torch.float32}), ("memory=low", {"memory": "low"})
    for name, kw in variants:
        hx, wx = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        ops.linear_cross_entropy(hx, wx, t, **kw).backward()
        e_h = ((hx.grad.float() - ref_dh).norm() / ref_dh.norm()).item()
        e_w = ((wx.grad.float() - ref_dw).norm() / ref_dw.norm()).item()
        print(f"  {name:<11} dx {e_h:.2e}  dW {e_w:.2e}", flush=True)
        del hx, wx
    del ref_dh, ref_dw
    torch.cuda.empty_cache()
