"""The post-training losses through the LM head at a Llama-3-8B head (hidden 4096, vocab 128256),
8 sequences of 1024 tokens (4 chosen then 4 rejected; GRPO: 8 completions), bf16, fwd+bwd:
onepass against Liger-Kernel's chunked loss modules (compiled, as Liger runs them by default)
and torch.compile of the plain definition (onepass's default accumulates dW in bf16 across
chunks, as Liger does; onepass_fp32_accum in float32); the matmuls alone are the floor (the policy's
three, plus the reference model's logits where the loss reads a reference model).

Each sequence's first 128 tokens are its prompt (ignored); GRPO's completions end at random
lengths (the attention mask), as generated ones do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from onepass import ops
from onepass.bench.case import Case, compiled, fwd, fwd_bwd, liger, variants
from onepass.bench.suites.loss import three_matmuls

BATCH, SEQ, HIDDEN, VOCAB, PROMPT, DTYPE = 8, 1024, 4096, 128256, 128, torch.bfloat16
CHUNKED = "liger_kernel.chunked_loss"


def _inputs(seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(BATCH, SEQ, HIDDEN, device="cuda", generator=g, dtype=DTYPE).requires_grad_(True)
    weight = (torch.randn(VOCAB, HIDDEN, device="cuda", generator=g) / HIDDEN**0.5).to(DTYPE).requires_grad_(True)
    target = torch.randint(0, VOCAB, (BATCH, SEQ), device="cuda", generator=g)
    target[:, :PROMPT] = -100
    ref_hidden = torch.randn(BATCH, SEQ, HIDDEN, device="cuda", generator=g, dtype=DTYPE)
    ref_weight = (torch.randn(VOCAB, HIDDEN, device="cuda", generator=g) / HIDDEN**0.5).to(DTYPE)
    return hidden, weight, target, ref_hidden, ref_weight


def _logps(hidden, weight, target):
    """Plain per-sequence log-probs: the whole batch's float32 logits exist."""
    logits = F.linear(hidden, weight).float()
    ok = target != -100
    lp = logits.log_softmax(-1).gather(-1, torch.where(ok, target, 0).unsqueeze(-1)).squeeze(-1)
    return torch.where(ok, lp, 0.0)


def plain_dpo(hidden, weight, target, ref_hidden, ref_weight, beta=0.1):
    lp = _logps(hidden, weight, target).sum(-1)
    with torch.no_grad():
        ref = _logps(ref_hidden, ref_weight, target).sum(-1)
    pairs = BATCH // 2
    margin = (lp[:pairs] - ref[:pairs]) - (lp[pairs:] - ref[pairs:])
    return -F.logsigmoid(beta * margin).mean()


def plain_grpo(hidden, weight, token_ids, mask, advantages, ref_hidden, ref_weight, beta=0.04):
    lp = _logps(hidden, weight, token_ids)
    with torch.no_grad():
        ref = _logps(ref_hidden, ref_weight, token_ids)
    ratio = torch.exp(lp - lp.detach())
    per_token = -ratio * advantages[:, None] + beta * (torch.exp(ref - lp) - (ref - lp) - 1)
    return (per_token * mask).sum() / mask.sum()  # "dapo" = "bnpo" on one process


def _floor(hidden, weight, ref_hidden=None, ref_weight=None):
    h, w = hidden.detach().view(-1, HIDDEN), weight.detach()

    def step():
        if ref_hidden is not None:
            ref_hidden.view(-1, HIDDEN) @ ref_weight.t()
        return three_matmuls(h, w)

    return step


def _make_dpo():
    hidden, weight, target, ref_hidden, ref_weight = _inputs()
    module = liger(CHUNKED, "LigerFusedLinearDPOLoss")
    liger_dpo = module(beta=0.1) if module else None
    return variants(
        onepass=fwd_bwd(ops.linear_dpo_loss, hidden, weight, target, None, ref_hidden, ref_weight, beta=0.1),
        onepass_fp32_accum=fwd_bwd(ops.linear_dpo_loss, hidden, weight, target, None, ref_hidden, ref_weight,
                                   beta=0.1, accum_dtype=torch.float32),
        matmuls=fwd(_floor(hidden, weight, ref_hidden, ref_weight)),
        torch_compile=fwd_bwd(compiled(plain_dpo), hidden, weight, target, ref_hidden, ref_weight),
        liger=fwd_bwd(lambda h, w: liger_dpo(w, h, target, None, ref_hidden, ref_weight), hidden, weight)
        if liger_dpo else None,
    )


def _make_reference_free(ours, liger_name: str):
    def make():
        hidden, weight, target, _, _ = _inputs()
        module = liger(CHUNKED, liger_name)
        theirs = module() if module else None
        return variants(
            onepass=fwd_bwd(ours, hidden, weight, target),
            onepass_fp32_accum=fwd_bwd(ours, hidden, weight, target, accum_dtype=torch.float32),
            matmuls=fwd(_floor(hidden, weight)),
            liger=fwd_bwd(lambda h, w: theirs(w, h, target), hidden, weight) if theirs else None,
        )

    return make


def _make_kto():
    hidden, weight, target, ref_hidden, ref_weight = _inputs()
    labels = torch.arange(BATCH, device="cuda") % 2 == 0
    kl = torch.tensor(0.1, device="cuda")
    module = liger(CHUNKED, "LigerFusedLinearKTOLoss")
    theirs = module(use_ref_model=True) if module else None
    return variants(
        onepass=fwd_bwd(ops.linear_kto_loss, hidden, weight, target, labels, None, ref_hidden, ref_weight, kl=kl),
        onepass_fp32_accum=fwd_bwd(ops.linear_kto_loss, hidden, weight, target, labels, None, ref_hidden,
                                   ref_weight, kl=kl, accum_dtype=torch.float32),
        matmuls=fwd(_floor(hidden, weight, ref_hidden, ref_weight)),
        liger=fwd_bwd(lambda h, w: theirs(h, w, target, None, labels, ref_hidden, ref_weight, None, kl),
                      hidden, weight) if theirs else None,
    )


def _make_grpo():
    hidden, weight, target, ref_hidden, ref_weight = _inputs()
    token_ids = target.clamp(min=0)
    lengths = torch.randint(SEQ // 4, SEQ + 1, (BATCH, 1), device="cuda")
    mask = (torch.arange(SEQ, device="cuda") < lengths).float()
    advantages = torch.randn(BATCH, device="cuda")
    module = liger(CHUNKED, "LigerFusedLinearGRPOLoss")
    theirs = module(beta=0.04, use_ref_model=True) if module else None
    return variants(
        onepass=fwd_bwd(ops.linear_grpo_loss, hidden, weight, token_ids, mask, advantages, None,
                        ref_hidden=ref_hidden, ref_weight=ref_weight),
        onepass_fp32_accum=fwd_bwd(ops.linear_grpo_loss, hidden, weight, token_ids, mask, advantages, None,
                                   ref_hidden=ref_hidden, ref_weight=ref_weight, accum_dtype=torch.float32),
        matmuls=fwd(_floor(hidden, weight, ref_hidden, ref_weight)),
        torch_compile=fwd_bwd(compiled(plain_grpo), hidden, weight, token_ids, mask, advantages, ref_hidden,
                              ref_weight),
        liger=fwd_bwd(lambda h, w: theirs(h, w, token_ids, mask, advantages, ref_input=ref_hidden,
                                          ref_weight=ref_weight), hidden, weight) if theirs else None,
    )


def cases() -> list[Case]:
    shape = f"{BATCH}x{SEQ}x{HIDDEN}x{VOCAB} bf16"
    policy = 6 * BATCH * SEQ * HIDDEN * VOCAB  # the three GEMMs (logits, d hidden, d weight)
    with_ref = policy + 2 * BATCH * SEQ * HIDDEN * VOCAB
    return [
        Case("linear_dpo_loss", "fwd+bwd", shape, _make_dpo, flops=with_ref, measure_memory=True),
        Case("linear_orpo_loss", "fwd+bwd", shape,
             _make_reference_free(ops.linear_orpo_loss, "LigerFusedLinearORPOLoss"), flops=policy,
             measure_memory=True),
        Case("linear_simpo_loss", "fwd+bwd", shape,
             _make_reference_free(ops.linear_simpo_loss, "LigerFusedLinearSimPOLoss"), flops=policy,
             measure_memory=True),
        Case("linear_cpo_loss", "fwd+bwd", shape,
             _make_reference_free(ops.linear_cpo_loss, "LigerFusedLinearCPOLoss"), flops=policy,
             measure_memory=True),
        Case("linear_kto_loss", "fwd+bwd", shape, _make_kto, flops=with_ref, measure_memory=True),
        Case("linear_grpo_loss", "fwd+bwd", shape, _make_grpo, flops=with_ref, measure_memory=True),
    ]
