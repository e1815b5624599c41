"""The LM head and its loss (linear_cross_entropy) at real heads, fwd+bwd, bf16, peak memory:
Qwen2-7B's (8192 tokens x 4096 x 151936), Gemma-2-2B's (8192 x 2304 x 256000) and Llama-3's
(8192 x 4096 x 128256). onepass's default (dW accumulated in bf16), memory="low" (four matmuls,
no accumulator) and the float32 accumulator, against torch.compile of Hugging Face's loss, Liger's
fused linear cross-entropy and Apple's Cut Cross-Entropy (``cut-cross-entropy``, its default
gradient filter); the three matmuls alone are the floor.
"""

from __future__ import annotations

import torch

from onepass import ops
from onepass.bench.case import Case, compiled, fwd, fwd_bwd, liger, variants
from onepass.bench.suites.loss import hf_linear_cross_entropy, three_matmuls

HEADS = [(8192, 4096, 151936), (8192, 2304, 256000), (8192, 4096, 128256)]
DTYPE = torch.bfloat16


def _make(tokens: int, hidden_size: int, vocab: int):
    def make():
        hidden = torch.randn(tokens, hidden_size, device="cuda", dtype=DTYPE, requires_grad=True)
        weight = (torch.randn(vocab, hidden_size, device="cuda") / hidden_size**0.5).to(DTYPE).requires_grad_(True)
        target = torch.randint(0, vocab, (tokens,), device="cuda")
        liger_flce = liger("liger_kernel.transformers.functional", "liger_fused_linear_cross_entropy")
        try:
            from cut_cross_entropy import linear_cross_entropy as cce
        except ImportError:
            cce = None
        return variants(
            onepass=fwd_bwd(ops.linear_cross_entropy, hidden, weight, target),
            onepass_low_memory=fwd_bwd(ops.linear_cross_entropy, hidden, weight, target, memory="low"),
            onepass_fp32_accum=fwd_bwd(ops.linear_cross_entropy, hidden, weight, target, accum_dtype=torch.float32),
            three_matmuls=fwd(three_matmuls, hidden.detach(), weight.detach()),
            torch_compile=fwd_bwd(compiled(hf_linear_cross_entropy), hidden, weight, target),
            liger=fwd_bwd(liger_flce, hidden, weight, target) if liger_flce else None,
            cut_cross_entropy=fwd_bwd(cce, hidden, weight, target) if cce else None,
        )

    return make


def cases() -> list[Case]:
    return [Case("linear_cross_entropy", "fwd+bwd", f"{t}x{h}x{v} bf16", _make(t, h, v), flops=6 * t * h * v,
                 measure_memory=True) for t, h, v in HEADS]
