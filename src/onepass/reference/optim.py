"""AdamW's update, as torch.optim.AdamW computes it (decoupled weight decay, bias correction)."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def bias_corrections(lr: float, beta1: float, beta2: float, step: int) -> tuple[float, float]:
    """(lr / (1 - beta1^step), sqrt(1 - beta2^step)): the update's step size and its divisor of sqrt(v)."""
    return lr / (1 - beta1 ** step), math.sqrt(1 - beta2 ** step)


@torch.no_grad()
def adamw_step(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
               lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int) -> None:
    """One AdamW step at step count ``step`` (1 for the first), in place, each tensor's math in
    float32 (float64 kept) and the results cast back to its dtype."""
    step_size, bc2_sqrt = bias_corrections(lr, beta1, beta2, step)
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        wide = torch.float64 if p.dtype == torch.float64 else torch.float32
        p32, g32, m32, v32 = (t.to(wide) for t in (p, g, m, v))
        p32 = p32 * (1 - lr * weight_decay)
        m32 = m32 + (1 - beta1) * (g32 - m32)
        v32 = beta2 * v32 + (1 - beta2) * g32 * g32
        p32 = p32 - step_size * m32 / (v32.sqrt() / bc2_sqrt + eps)
        p.copy_(p32), m.copy_(m32), v.copy_(v32)
