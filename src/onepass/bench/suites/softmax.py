"""Scale + causal mask + softmax on attention scores: 64 x 4096 x 4096, bf16
(any shape: ``cases(batch_heads, seq)``)."""

from __future__ import annotations

import torch

from onepass import ops
from onepass.bench.case import Case, compiled, fwd, fwd_bwd, variants

BATCH_HEADS, SEQ, DTYPE = 64, 4096, torch.bfloat16
SCALE = 128 ** -0.5  # 1 / sqrt(head_dim)


def eager_softmax(x, mask, scale):
    # HF eager attention: read x, write x*scale; read it and the mask, write z; softmax in
    # fp32 (read z, write fp32 probs); cast back (read, write)
    z = x * scale if mask is None else x * scale + mask
    return torch.softmax(z, dim=-1, dtype=torch.float32).to(x.dtype)


def _causal_additive_mask(seq):
    """The [S, S] additive mask HF builds: 0 where visible, the dtype's minimum above the diagonal."""
    hidden = torch.ones(seq, seq, dtype=torch.bool, device="cuda").triu(1)
    return torch.zeros(seq, seq, dtype=DTYPE, device="cuda").masked_fill(hidden, torch.finfo(DTYPE).min)


def _make(causal: bool, mode: str, batch_heads: int, seq: int):
    grad = mode == "fwd+bwd"
    step = fwd_bwd if grad else fwd

    def make():
        x = torch.randn(batch_heads, seq, seq, device="cuda", dtype=DTYPE, requires_grad=grad)
        mask = _causal_additive_mask(seq) if causal else None
        return variants(
            onepass=step(ops.softmax, x, -1, SCALE, None, causal),
            eager=step(eager_softmax, x, mask, SCALE),
            torch_compile=step(compiled(eager_softmax), x, mask, SCALE),
        )

    return make


def cases(batch_heads: int = BATCH_HEADS, seq: int = SEQ) -> list[Case]:
    # minimum bytes, as in ops/softmax.py: fwd reads x and writes y (the causal kernel reads
    # only the visible half, but a full read is counted); bwd reads y and dy and writes dx
    size = batch_heads * seq * seq * DTYPE.itemsize
    shape = f"{batch_heads}x{seq}x{seq} bf16"
    return [
        Case("softmax", "fwd", f"{shape}, scale + causal", _make(True, "fwd", batch_heads, seq), bytes=2 * size),
        Case("softmax", "fwd+bwd", f"{shape}, scale + causal", _make(True, "fwd+bwd", batch_heads, seq),
             bytes=5 * size),
        Case("softmax", "fwd", f"{shape}, scale", _make(False, "fwd", batch_heads, seq), bytes=2 * size),
    ]
