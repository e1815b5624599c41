"""Knowledge distillation through both LM heads at Llama 3 8B's head (8192 tokens x 4096 x 128256, bf16).

``linear_jsd_loss`` (generalized JSD, beta 0.5, plus the hard CE) fwd+bwd against the plain
definition (both heads' full logits, float32 upcasts) eager and under torch.compile, and
Liger-Kernel's LigerFusedLinearJSDLoss (its defaults: chunks of 1024 tokens, torch.compile'd
chunk step), each with its peak memory. The teacher is frozen; the student's hidden state and
head get gradients. The step is ``loss.backward()`` (upstream gradient 1), as in the loss suite.
"""

from __future__ import annotations

import torch

from onepass import ops, reference
from onepass.bench.case import Case, compiled, fwd_bwd, liger, variants

TOKENS, HIDDEN, VOCAB, DTYPE = 8192, 4096, 128256, torch.bfloat16
BETA = 0.5


def _head(requires_grad: bool):
    hidden = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=DTYPE, requires_grad=requires_grad)
    weight = (torch.randn(VOCAB, HIDDEN, device="cuda") / HIDDEN**0.5).to(DTYPE).requires_grad_(requires_grad)
    return hidden, weight


def _make_linear_jsd():
    s_hidden, s_weight = _head(True)
    t_hidden, t_weight = _head(False)
    target = torch.randint(0, VOCAB, (TOKENS,), device="cuda")
    target[::8] = -100  # prompt tokens
    args = (s_hidden, s_weight, t_hidden, t_weight, target)
    liger_jsd = liger("liger_kernel.chunked_loss", "LigerFusedLinearJSDLoss")
    return variants(
        onepass=fwd_bwd(ops.linear_jsd_loss, *args, beta=BETA),
        onepass_fp32_accum=fwd_bwd(ops.linear_jsd_loss, *args, beta=BETA, accum_dtype=torch.float32),
        eager=fwd_bwd(reference.linear_jsd_loss, *args, beta=BETA),
        torch_compile=fwd_bwd(compiled(reference.linear_jsd_loss), *args, beta=BETA),
        liger=fwd_bwd(liger_jsd(beta=BETA), *args) if liger_jsd else None,
    )


def cases() -> list[Case]:
    # the four GEMMs: student logits, d hidden, d weight (6 T H V) and the teacher's logits (2 T H V)
    return [Case("linear_jsd_loss", "fwd+bwd", f"{TOKENS}x{HIDDEN}x{VOCAB} bf16", _make_linear_jsd,
                 flops=8 * TOKENS * HIDDEN * VOCAB, measure_memory=True)]
