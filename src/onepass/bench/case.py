"""What a benchmark case is, and the small helpers every suite builds its cases from.

A suite module (``onepass.bench.suites.<family>``) exposes ``cases() -> list[Case]``.
Each case builds its inputs on the GPU once and returns one zero-argument callable per
variant ("onepass", "eager", "torch.compile", "liger", "torch" for a fused path PyTorch
already has, ...). The harness times every variant of a case in the same run and derives
GB/s from ``bytes`` (the op's minimum HBM traffic, as in the op's docstring) and TFLOP/s
from ``flops``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

import torch

Thunk = Callable[[], Any]


@dataclass
class Case:
    op: str  # public op name, e.g. "rms_norm"
    mode: str  # "fwd" or "fwd+bwd"
    shape: str  # e.g. "16384x4096 bf16"
    make: Callable[[], dict[str, Thunk]]  # builds inputs, returns {variant: one step}
    bytes: int = 0  # minimum HBM bytes one step must move
    flops: int = 0  # floating-point operations of one step
    measure_memory: bool = False  # also report each variant's peak memory above its inputs
    cuda_graph: bool = False  # time every variant by replaying a CUDA graph of its step (no host launch cost)


def fwd(fn: Callable, *args, **kwargs) -> Thunk:
    return lambda: fn(*args, **kwargs)


def fwd_bwd(fn: Callable, *args, **kwargs) -> Thunk:
    """One forward and backward; gradients are dropped (set to None) before each step.

    The upstream gradient is drawn once, outside the timed region, for every output; a
    scalar output (a loss) gets 1, as ``loss.backward()`` gives it. The step's ``leaves``
    let the harness drop the gradients before it takes a memory baseline.
    """
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    grads: list[torch.Tensor] = []

    def step():
        for t in leaves:
            t.grad = None
        out = fn(*args, **kwargs)
        outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,))
                if isinstance(o, torch.Tensor) and o.requires_grad]
        if not grads:
            grads.extend(torch.ones_like(o) if o.numel() == 1 else torch.randn_like(o) for o in outs)
        torch.autograd.backward(outs, grads)

    step.leaves = leaves
    return step


def compiled(fn: Callable) -> Callable:
    """torch.compile of the eager (Hugging Face style) version: the peer users reach for."""
    return torch.compile(fn)


def liger(module: str, name: str) -> Callable | None:
    """A Liger-Kernel function or class if Liger is importable here, else None (the variant is skipped)."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def variants(**thunks: Thunk | None) -> dict[str, Thunk]:
    """Drop the variants that are unavailable (None), keeping the order given.

    Keyword names use underscores; "torch_compile" becomes "torch.compile".
    """
    return {k.replace("torch_compile", "torch.compile"): v for k, v in thunks.items() if v is not None}
