"""Rotary embedding of q [4, 32, 4096, 128] and k [4, 8, 4096, 128] (grouped-query), bf16."""

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


def _tables():
    """cos/sin [B, S, D] as LlamaRotaryEmbedding returns them (theta 500000, in the model's dtype)."""
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, HEAD_DIM, 2, device="cuda", dtype=torch.float32) / HEAD_DIM)
    pos = torch.arange(SEQ, device="cuda", dtype=torch.float32)
    emb = torch.cat((pos[:, None] * inv_freq,) * 2, dim=-1).expand(BATCH, SEQ, HEAD_DIM)
    return emb.cos().to(DTYPE), emb.sin().to(DTYPE)


def _make(mode: str):
    grad = mode == "fwd+bwd"
    step = fwd_bwd if grad else fwd

    def make():
        q = torch.randn(BATCH, Q_HEADS, SEQ, HEAD_DIM, device="cuda", dtype=DTYPE, requires_grad=grad)
        k = torch.randn(BATCH, K_HEADS, SEQ, HEAD_DIM, device="cuda", dtype=DTYPE, requires_grad=grad)
        cos, sin = _tables()
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


def cases() -> list[Case]:
    # minimum bytes, as in ops/rope.py: fwd reads q, k and writes q', k'; bwd the same again
    # for the gradients (cos/sin, 8 MiB in all, are not counted)
    qk = BATCH * (Q_HEADS + K_HEADS) * SEQ * HEAD_DIM * DTYPE.itemsize
    shape = f"q {BATCH}x{Q_HEADS}x{SEQ}x{HEAD_DIM}, k {BATCH}x{K_HEADS}x{SEQ}x{HEAD_DIM} bf16"
    return [Case("rope", "fwd", shape, _make("fwd"), bytes=2 * qk),
            Case("rope", "fwd+bwd", shape, _make("fwd+bwd"), bytes=4 * qk)]
