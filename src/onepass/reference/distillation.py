from __future__ import annotations

import torch
import torch.nn.functional as F

from onepass.reference._dtype import compute_dtype


def generalized_jsd(student_logits, teacher_logits, beta=0.5, temperature=1.0):
    """Per-row generalized Jensen-Shannon divergence of GKD (TRL's ``generalized_jsd_loss``, unreduced).

    p = softmax(student / T), q = softmax(teacher / T), m = (1 - beta) p + beta q:
    beta KL(q || m) + (1 - beta) KL(p || m) for 0 < beta < 1; beta = 0 is the forward KL(q || p),
    beta = 1 the reverse KL(p || q) (the limits TRL and Liger define, not the mixture's own, which are 0).
    """
    log_p = F.log_softmax(student_logits / temperature, dim=-1)  # read and write [rows, V] a step
    log_q = F.log_softmax(teacher_logits / temperature, dim=-1)
    if beta == 0:
        return F.kl_div(log_p, log_q, reduction="none", log_target=True).sum(-1)
    if beta == 1:
        return F.kl_div(log_q, log_p, reduction="none", log_target=True).sum(-1)
    log_m = torch.logsumexp(torch.stack([log_p + torch.log1p(torch.tensor(-beta, dtype=log_p.dtype)),
                                         log_q + torch.log(torch.tensor(beta, dtype=log_p.dtype))]), dim=0)
    kl_q = F.kl_div(log_m, log_q, reduction="none", log_target=True).sum(-1)
    kl_p = F.kl_div(log_m, log_p, reduction="none", log_target=True).sum(-1)
    return beta * kl_q + (1 - beta) * kl_p


def linear_jsd_loss(student_hidden, student_weight, teacher_hidden, teacher_weight, target=None,
                    student_bias=None, teacher_bias=None, weight_hard_loss=0.5, weight_soft_loss=0.5, beta=0.5,
                    ignore_index=-100, temperature=1.0):
    """Distillation through both LM heads with the full [tokens, V] logits (the unfused definition).

    weight_hard_loss * CE(student logits, target) + weight_soft_loss * generalized_jsd(at ``temperature``),
    each a mean over the tokens whose target is not ``ignore_index`` (every token without a target;
    no hard loss then), the count clamped to 1 (a batch of ignored tokens gives 0). The teacher gets no
    gradient. Float32 loss (float64 for float64 inputs).
    """
    z = F.linear(student_hidden, student_weight, student_bias)  # write [tokens, V]
    with torch.no_grad():
        y = F.linear(teacher_hidden, teacher_weight, teacher_bias)  # write [tokens, V]
    dtype = compute_dtype(z)
    z = z.reshape(-1, z.shape[-1]).to(dtype)  # upcast copies of both
    y = y.reshape(-1, y.shape[-1]).to(dtype)
    if target is None:
        valid = torch.ones(z.shape[0], dtype=torch.bool, device=z.device)
    else:
        valid = target.reshape(-1) != ignore_index
    count = valid.sum().clamp_min(1)
    loss = torch.zeros((), dtype=dtype, device=z.device)
    if weight_soft_loss:
        jsd = generalized_jsd(z, y, beta, temperature)
        loss = loss + weight_soft_loss * torch.where(valid, jsd, 0.0).sum() / count
    if weight_hard_loss and target is not None:
        ce = F.cross_entropy(z, target.reshape(-1).long(), ignore_index=ignore_index, reduction="sum")
        loss = loss + weight_hard_loss * ce / count
    return loss
