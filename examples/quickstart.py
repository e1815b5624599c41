"""Fused ops in eager PyTorch: the pre-norm residual step and the gated MLP activation.

    python examples/quickstart.py        (on a machine without a GPU: TRITON_INTERPRET=1 runs the kernels)
"""

import torch

from onepass import ops, reference

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if device == "cuda" else torch.float32
rows, hidden = (8 * 2048, 4096) if device == "cuda" else (4, 64)

x = torch.randn(rows, hidden, device=device, dtype=dtype, requires_grad=True)
residual = torch.randn(rows, hidden, device=device, dtype=torch.float32)  # an fp32 residual stream
weight = torch.ones(hidden, device=device, dtype=dtype, requires_grad=True)

normed, residual = ops.add_rms_norm(x, residual, weight, eps=1e-6)  # one pass: h = r + x; (rms_norm(h), h)
gate, up = normed.chunk(2, dim=-1)
out = ops.swiglu(gate, up)  # silu(gate) * up, one pass
out.float().sum().backward()  # the fused backward kernels

expected = reference.swiglu(*reference.add_rms_norm(x.double(), residual.double() - x.double(),
                                                    weight.double())[0].chunk(2, dim=-1))
print(f"{device}: out {tuple(out.shape)} {out.dtype}, residual stream {residual.dtype}, "
      f"max |out - reference| = {(out.double() - expected).abs().max().item():.2e}, "
      f"|dx| = {x.grad.norm().item():.3f}")
