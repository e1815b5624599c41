"""The optimizer step: AdamW over Llama-3.2-1B's parameters (146 tensors, 1.24 B values), bf16."""

from __future__ import annotations

import torch

from onepass import ops
from onepass.bench.case import Case, variants

OPTIONS = {"lr": 1e-4, "weight_decay": 0.01}


def _tensors(shapes):
    params = [torch.randn(s, device="cuda", dtype=torch.bfloat16) for s in shapes]
    grads = [1e-3 * torch.randn_like(p) for p in params]
    return params, grads, [1e-3 * torch.randn_like(p) for p in params], [1e-6 * torch.rand_like(p) for p in params]


def _torch_adamw(shapes, **kind):
    params, grads, _, _ = _tensors(shapes)
    params = [torch.nn.Parameter(p) for p in params]
    for p, g in zip(params, grads):
        p.grad = g
    return torch.optim.AdamW(params, **OPTIONS, **kind).step


def _make(shapes):
    def make():
        quads = _tensors(shapes)
        return variants(
            onepass=lambda: ops.adamw_step(*quads, **OPTIONS, step=10),
            torch_fused=_torch_adamw(shapes, fused=True),
            torch_foreach=_torch_adamw(shapes, foreach=True),
        )

    return make


def cases() -> list[Case]:
    from onepass.models.configs import build

    shapes = [p.shape for p in build("llama-1b").parameters()]  # on meta: nothing allocated
    n = sum(s.numel() for s in shapes)
    # read p, g, m, v and write p, m, v: 7 passes of 2 bytes
    return [Case("adamw_step", "step", f"Llama-3.2-1B's {len(shapes)} tensors, {n / 1e9:.2f} B values bf16",
                 _make(shapes), bytes=7 * 2 * n)]
