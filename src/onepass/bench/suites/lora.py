"""A linear layer with a LoRA adapter: Llama-3.2-1B's projection shapes, 8192 tokens, rank 16, bf16.

The base weight is frozen (LoRA fine-tuning); x, A and B take gradients. Beside the peers,
``base_matmuls`` is the frozen base layer's own GEMMs alone (x W^T; with backward, also
dy W): the floor an adapter adds to. PEFT's module, when importable, is the row users run.
"""

from __future__ import annotations

import torch

from onepass import ops, reference
from onepass.bench.case import Case, compiled, fwd, fwd_bwd, variants

TOKENS, RANK, SCALING, DTYPE = 8192, 16, 2.0, torch.bfloat16
SHAPES = [(2048, 2048), (2048, 8192), (8192, 2048)]  # (in, out): q/o, gate/up, down


def _peft_layer(w, a, b):
    """PEFT's lora.Linear around a frozen nn.Linear holding ``w``, its factors set to a and b."""
    try:
        from peft import LoraConfig
        from peft.tuners.lora.layer import Linear
    except ImportError:
        return None
    base = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device="cuda", dtype=DTYPE)
    base.weight = torch.nn.Parameter(w, requires_grad=False)
    layer = Linear(base, "default", LoraConfig(r=RANK, lora_alpha=int(SCALING * RANK)), r=RANK,
                   lora_alpha=int(SCALING * RANK))
    for factor, value in zip(_factors(layer), (a, b)):
        factor.data = value.detach().clone()
        factor.requires_grad_(a.requires_grad)
    return layer


def _factors(layer):
    return layer.lora_A["default"].weight, layer.lora_B["default"].weight


def _make(k: int, n: int, mode: str):
    def make():
        grad = mode == "fwd+bwd"
        x = torch.randn(TOKENS, k, device="cuda", dtype=DTYPE, requires_grad=grad)
        w = (torch.randn(n, k, device="cuda") / k**0.5).to(DTYPE)
        a = (torch.randn(RANK, k, device="cuda") / k**0.5).to(DTYPE).requires_grad_(grad)
        b = (torch.randn(n, RANK, device="cuda") / RANK**0.5).to(DTYPE).requires_grad_(grad)
        step = fwd_bwd if grad else fwd
        layer = _peft_layer(w, a, b)
        dy = torch.randn(TOKENS, n, device="cuda", dtype=DTYPE)
        xd = x.detach()
        base = (lambda: (xd @ w.t(), dy @ w)) if grad else (lambda: xd @ w.t())
        return variants(
            onepass=step(ops.lora_linear, x, w, a, b, SCALING),
            base_matmuls=base,
            eager=step(reference.lora_linear, x, w, a, b, SCALING),
            torch_compile=step(compiled(reference.lora_linear), x, w, a, b, SCALING),
            # the layer's factors passed along so that the step drops their gradients too
            peft=step(lambda x, *factors: layer(x), x, *_factors(layer)) if layer is not None else None,
        )

    return make


def _flops(k: int, n: int, mode: str) -> int:
    """The base GEMM and the adapter's two; backward: dx through both, dA and dB (W frozen)."""
    base, adapter = 2 * TOKENS * k * n, 2 * TOKENS * RANK * (k + n)
    return base + adapter if mode == "fwd" else 2 * base + 3 * adapter


def cases() -> list[Case]:
    return [Case("lora_linear", mode, f"{TOKENS}x{k}->{n} r{RANK} bf16", _make(k, n, mode), flops=_flops(k, n, mode))
            for k, n in SHAPES for mode in ("fwd", "fwd+bwd")]
