"""Cross-entropy over a Llama 3 vocabulary (8192 tokens x 128256, bf16), alone and with its LM head (hidden 2048)
(any shape: ``cases(tokens, hidden, vocab)``).

A loss's backward starts from ``loss.backward()``, an upstream gradient of exactly 1,
so the fwd+bwd steps here do that instead of the harness's random upstream gradient
(onepass and Liger both skip the gradient's rescaling when it is 1; a random factor
would add one read and one write of the [tokens, V] gradient to both).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from onepass import ops
from onepass.bench.case import Case, compiled, fwd, fwd_bwd, liger, variants

TOKENS, HIDDEN, VOCAB, DTYPE = 8192, 2048, 128256, torch.bfloat16


def hf_cross_entropy(logits, target):
    # Hugging Face's ForCausalLMLoss: upcast (read 2 bytes, write 4 an element), then
    # log_softmax and nll in float32; backward writes float32 grads and casts them back
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), target.view(-1), ignore_index=-100)


def hf_linear_cross_entropy(hidden, weight, target):
    return hf_cross_entropy(F.linear(hidden, weight), target)  # the full [tokens, V] logits exist


def three_matmuls(hidden, weight):
    """The floor of the fused LM-head loss: its three GEMMs alone, nothing else."""
    logits = hidden @ weight.t()
    return logits @ weight, logits.t() @ hidden


def _targets(tokens, vocab):
    return torch.randint(0, vocab, (tokens,), device="cuda")


def _make_cross_entropy(mode: str, tokens: int, vocab: int):
    def make():
        grad = mode == "fwd+bwd"
        logits = torch.randn(tokens, vocab, device="cuda", dtype=DTYPE, requires_grad=grad)
        target = _targets(tokens, vocab)
        step = fwd_bwd if grad else fwd
        liger_ce = liger("liger_kernel.transformers.functional", "liger_cross_entropy")
        return variants(
            onepass=step(ops.cross_entropy, logits, target),
            onepass_inplace_grad=step(ops.cross_entropy, logits, target, inplace_grad=True) if grad else None,
            eager=step(hf_cross_entropy, logits, target),
            torch_compile=step(compiled(hf_cross_entropy), logits, target),
            # last: Liger writes its gradient over the logits it is given
            liger=step(liger_ce, logits, target) if liger_ce and grad else None,
        )

    return make


def _make_linear_cross_entropy(tokens: int, width: int, vocab: int):
    def make():
        hidden = torch.randn(tokens, width, device="cuda", dtype=DTYPE, requires_grad=True)
        weight = (torch.randn(vocab, width, device="cuda") / width**0.5).to(DTYPE).requires_grad_(True)
        target = _targets(tokens, vocab)
        liger_flce = liger("liger_kernel.transformers.functional", "liger_fused_linear_cross_entropy")
        return variants(
            onepass=fwd_bwd(ops.linear_cross_entropy, hidden, weight, target),
            onepass_fp32_accum=fwd_bwd(ops.linear_cross_entropy, hidden, weight, target, accum_dtype=torch.float32),
            three_matmuls=fwd(three_matmuls, hidden.detach(), weight.detach()),
            eager=fwd_bwd(hf_linear_cross_entropy, hidden, weight, target),
            torch_compile=fwd_bwd(compiled(hf_linear_cross_entropy), hidden, weight, target),
            liger=fwd_bwd(liger_flce, hidden, weight, target) if liger_flce else None,
        )

    return make


def cases(tokens: int = TOKENS, hidden: int = HIDDEN, vocab: int = VOCAB) -> list[Case]:
    # minimum bytes, as in ops/cross_entropy.py: read the logits once, write their gradient once
    logits_bytes = tokens * vocab * DTYPE.itemsize
    return [
        Case("cross_entropy", "fwd+bwd", f"{tokens}x{vocab} bf16", _make_cross_entropy("fwd+bwd", tokens, vocab),
             bytes=2 * logits_bytes, measure_memory=True),
        Case("cross_entropy", "fwd", f"{tokens}x{vocab} bf16", _make_cross_entropy("fwd", tokens, vocab),
             bytes=logits_bytes),
        # the three GEMMs (logits, d hidden, d weight): 6 T H V flops
        Case("linear_cross_entropy", "fwd+bwd", f"{tokens}x{hidden}x{vocab} bf16",
             _make_linear_cross_entropy(tokens, hidden, vocab), flops=6 * tokens * hidden * vocab,
             measure_memory=True),
    ]
