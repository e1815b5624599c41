"""Rotary embedding of q [4, 32, 4096, 128] and k [4, 8, 4096, 128] (grouped-query), bf16
(any batch, sequence and head dim: ``cases(batch, seq, head_dim)``)."""

from __future__ import annotations

import torch

from onepass import ops, reference
from onepass.bench.case import Case, compiled, fwd, fwd_bwd, liger, variants

BATCH, Q_HEADS, K_HEADS, SEQ, HEAD_DIM, DTYPE = 4, 32, 8, 4096, 128, torch.bfloat16


def _hf_rope():
    """HF Llama's apply_rotary_pos_emb (rotate_half, in the input dtype) if transformers is
    installed; else the reference, which is the same formula computed in fp32."""
    try:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    except ImportError:
        return reference.rope
    return apply_rotary_pos_emb


def _tables(batch, seq, head_dim):
    """cos/sin [B, S, D] as LlamaRotaryEmbedding returns them (theta 500000, in the model's dtype)."""
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, head_dim, 2, device="cuda", dtype=torch.float32) / head_dim)
    pos = torch.arange(seq, device="cuda", dtype=torch.float32)
    emb = torch.cat((pos[:, None] * inv_freq,) * 2, dim=-1).expand(batch, seq, head_dim)
    return emb.cos().to(DTYPE), emb.sin().to(DTYPE)


def _make(mode: str, batch: int, seq: int, head_dim: int):
    grad = mode == "fwd+bwd"
    step = fwd_bwd if grad else fwd

    def make():
        q = torch.randn(batch, Q_HEADS, seq, head_dim, device="cuda", dtype=DTYPE, requires_grad=grad)
        k = torch.randn(batch, K_HEADS, seq, head_dim, device="cuda", dtype=DTYPE, requires_grad=grad)
        cos, sin = _tables(batch, seq, head_dim)
        hf = _hf_rope()
        liger_fn = liger("liger_kernel.transformers.rope", "liger_rotary_pos_emb")
        # in place (inference): rotates the same q, k again each step, same bytes
        inplace = None if grad else fwd(ops.rope, q.detach().clone(), k.detach().clone(), cos, sin, inplace=True)
        return variants(
            onepass=step(ops.rope, q, k, cos, sin),
            onepass_inplace=inplace,
            eager=step(hf, q, k, cos, sin),
            torch_compile=step(compiled(hf), q, k, cos, sin),
            liger=step(liger_fn, q, k, cos, sin) if liger_fn is not None else None,
        )

    return make


def cases(batch: int = BATCH, seq: int = SEQ, head_dim: int = HEAD_DIM) -> list[Case]:
    # minimum bytes, as in ops/rope.py: fwd reads q, k and writes q', k'; bwd the same again
    # for the gradients (cos/sin, 8 MiB in all at the default shape, are not counted)
    qk = batch * (Q_HEADS + K_HEADS) * seq * head_dim * DTYPE.itemsize
    shape = f"q {batch}x{Q_HEADS}x{seq}x{head_dim}, k {batch}x{K_HEADS}x{seq}x{head_dim} bf16"
    return [Case("rope", "fwd", shape, _make("fwd", batch, seq, head_dim), bytes=2 * qk),
            Case("rope", "fwd+bwd", shape, _make("fwd+bwd", batch, seq, head_dim), bytes=4 * qk)]
