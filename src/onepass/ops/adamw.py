"""AdamW's step over many parameters in few launches (the optimizer of ``onepass.optim``).

Math, per element, in fp32 (t = the step count, from 1; torch.optim.AdamW's):

    p = p * (1 - lr * weight_decay)
    m = m + (1 - beta1) * (g - m)                 (= beta1 m + (1 - beta1) g)
    v = beta2 * v + (1 - beta2) * g * g
    p = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

Byte budget per element of size s: read p, g, m, v; write p, m, v: 7 s, one pass. A
model's parameters are many tensors at scattered addresses: tensors of one size go in one
launch, a grid of (blocks of a tensor, tensors), and each program finds its four tensors
as element offsets from one base tensor (a table of [tensors, 4] offsets, copied to the
device each step: the gradients are new tensors every step). The offsets carry a
divisibility hint when every address is 16-byte aligned (the caching allocator's are), so
the loads are 16-byte vectors; without it they are scalar, and slower. The step
against torch.optim.AdamW: `onepass bench ops --suite optim`, benchmarks/results/h200/optim.md.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import triton
import triton.language as tl
from torch import Tensor

from onepass import reference
from onepass.ops.dispatch import FLOAT_DTYPES, cdiv, check_tensor_lists, is_number, launch, use_triton
from onepass.reference.optim import bias_corrections

# Values a program, warps: fixed (memory-bound, 16-byte loads); measured on an H200 only by a script not in the
# tree (numbers in CHANGELOG.md); the op's current time: benchmarks/results/h200/optim.md.
BLOCK = 1024
NUM_WARPS = 4
ALIGNMENT = 16  # bytes: the offsets' hint, when every address is a multiple of it
DTYPES = (*FLOAT_DTYPES, torch.float64)  # the tensors adamw_step updates (float64 by the reference)


@triton.jit
def _adamw_kernel(offsets_ptr, base_ptr, numel, lr, beta1, beta2, eps, weight_decay, step_size, bc2_sqrt,
                  BLOCK: tl.constexpr, ALIGN: tl.constexpr):
    row = offsets_ptr + 4 * tl.program_id(1)
    p_ptr = base_ptr + tl.multiple_of(tl.load(row), ALIGN)
    g_ptr = base_ptr + tl.multiple_of(tl.load(row + 1), ALIGN)
    m_ptr = base_ptr + tl.multiple_of(tl.load(row + 2), ALIGN)
    v_ptr = base_ptr + tl.multiple_of(tl.load(row + 3), ALIGN)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    p = tl.load(p_ptr + offs, mask=mask).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask).to(tl.float32)
    p = p * (1.0 - lr * weight_decay)
    m = m + (1.0 - beta1) * (g - m)
    v = beta2 * v + (1.0 - beta2) * g * g
    p = p - step_size * m / (tl.sqrt(v) / bc2_sqrt + eps)
    dtype = base_ptr.dtype.element_ty
    tl.store(p_ptr + offs, p.to(dtype), mask=mask)
    tl.store(m_ptr + offs, m.to(dtype), mask=mask)
    tl.store(v_ptr + offs, v.to(dtype), mask=mask)


def _launch_groups(quads: list[tuple[Tensor, Tensor, Tensor, Tensor]], scalars: tuple) -> None:
    """One launch per (dtype, size, alignment) group of contiguous (p, g, m, v) quadruples."""
    groups = defaultdict(list)
    for quad in quads:
        aligned = all(t.data_ptr() % ALIGNMENT == 0 for t in quad)
        groups[(quad[0].dtype, quad[0].numel(), aligned)].append(quad)
    for (_, numel, aligned), members in groups.items():
        base = members[0][0]
        size = base.element_size()
        start = base.data_ptr()
        offsets = torch.tensor([[(t.data_ptr() - start) // size for t in quad] for quad in members],
                               dtype=torch.int64)
        if base.is_cuda:  # pinned, so the copy does not wait for the device
            offsets = offsets.pin_memory().to(base.device, non_blocking=True)
        launch(_adamw_kernel, (cdiv(numel, BLOCK), len(members)), offsets, base, numel, *scalars,
               BLOCK=BLOCK, ALIGN=ALIGNMENT // size if aligned else 1, num_warps=NUM_WARPS)


def _adamw_launch(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, step):
    scalars = (lr, beta1, beta2, eps, weight_decay, *bias_corrections(lr, beta1, beta2, step))
    quads, rest = [], []
    for quad in zip(params, grads, exp_avgs, exp_avg_sqs):
        if quad[0].numel() == 0:
            continue
        # the kernel takes contiguous 16/32-bit tensors, addressed by whole elements from the first one's address
        launchable = quad[0].dtype != torch.float64 and all(
            t.is_contiguous() and t.data_ptr() % t.element_size() == 0 for t in quad)
        (quads if launchable else rest).append(quad)
    _launch_groups(quads, scalars)
    if rest:  # the others: the plain update, tensor by tensor
        reference.adamw_step(*map(list, zip(*rest)), lr, beta1, beta2, eps, weight_decay, step)


# A custom_op, not a dispatch.triton_op: its launcher addresses the tensors by their data_ptr() (one launch a
# group of tensors, each found at its offset from the first), which no traced (fake) tensor has.
@torch.library.custom_op("onepass::adamw_step_", mutates_args=("params", "exp_avgs", "exp_avg_sqs"))
def _adamw_step(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
                lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int) -> None:
    _adamw_launch(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, step)


@_adamw_step.register_fake
def _(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, step):
    return None


def columns_by(key, quads) -> dict:
    """{key(quad): (params, grads, exp_avgs, exp_avg_sqs)} of the (p, g, m, v) quadruples."""
    columns = defaultdict(lambda: ([], [], [], []))
    for quad in quads:
        for column, t in zip(columns[key(quad)], quad):
            column.append(t)
    return columns


def check_hyperparameters(lr, beta1, beta2, eps, weight_decay) -> None:
    for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
        if not is_number(value):
            raise ValueError(f"{name} must be a finite number, got {value!r}")
    if not 0.0 <= lr:
        raise ValueError(f"lr must be >= 0, got {lr}")
    for name, beta in (("beta1", beta1), ("beta2", beta2)):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {beta}")
    if not 0.0 <= eps:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")


def _check(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay):
    lists = {"params": params, "grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs}
    if len({len(v) for v in lists.values()}) > 1:
        raise ValueError("params, grads, exp_avgs and exp_avg_sqs must be lists of one length, got "
                         + ", ".join(f"{k} {len(v)}" for k, v in lists.items()))
    for i, quad in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        for name, t in zip(lists, quad):
            if not isinstance(t, Tensor):
                raise TypeError(f"{name}[{i}] must be a torch.Tensor, got {type(t).__name__}")
            if t.layout != torch.strided:
                raise TypeError(f"{name}[{i}] must be a dense tensor (sparse gradients are not supported), "
                                f"got {t.layout}")
            if t.dtype not in DTYPES:
                raise TypeError(f"{name}[{i}] must be float32, float16, bfloat16 or float64, got {t.dtype}")
            if (t.shape, t.dtype, t.device) != (quad[0].shape, quad[0].dtype, quad[0].device):
                raise ValueError(f"{name}[{i}] must match params[{i}] ({tuple(quad[0].shape)} {quad[0].dtype} on "
                                 f"{quad[0].device}), got {tuple(t.shape)} {t.dtype} on {t.device}")
    check_hyperparameters(lr, beta1, beta2, eps, weight_decay)


def _step_count(step) -> int:
    """``step`` as the int the update takes, checked before int() (which fails on NaN or inf
    without naming it); a one-element tensor or numpy number as its value."""
    if isinstance(step, Tensor) or type(step).__module__ == "numpy":
        step = step.item()
    if isinstance(step, bool) or not isinstance(step, (int, float, torch.SymInt, torch.SymFloat)):
        raise TypeError(f"step must be a number (the count including this step), got {type(step).__name__}")
    if not (is_number(step) and step >= 1 and step == int(step)):
        raise ValueError(f"step must be a finite whole number >= 1 (the count including this step), got {step}")
    return int(step)


@torch.no_grad()
def adamw_step(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor], *,
               lr: float, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 1e-2,
               step: int) -> None:
    """One AdamW step, in place on ``params``, ``exp_avgs`` and ``exp_avg_sqs``, as
    ``torch.optim.AdamW`` computes it; ``step`` counts this step (1 for the first).

    Each i-th params, grads, exp_avgs, exp_avg_sqs share a shape, dtype and device; the
    math runs in fp32 and each result is rounded once to its tensor's dtype (float64 tensors
    take the plain PyTorch update, in float64).
    """
    check_tensor_lists(params=params, grads=grads, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs)
    step = _step_count(step)
    lr, beta1, beta2, eps, weight_decay = float(lr), float(beta1), float(beta2), float(eps), float(weight_decay)
    _check(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay)
    for columns in columns_by(lambda quad: quad[0].device, zip(params, grads, exp_avgs, exp_avg_sqs)).values():
        if use_triton(columns[0][0]):
            _adamw_step(*columns, lr, beta1, beta2, eps, weight_decay, step)
        else:
            reference.adamw_step(*columns, lr, beta1, beta2, eps, weight_decay, step)
