"""``onepass.optim.AdamW``: torch.optim.AdamW's update through ``onepass.ops.adamw_step``.

A drop-in for ``torch.optim.AdamW(params, lr, betas, eps, weight_decay)`` (its other keywords
taken at their defaults, a tensor or numpy learning rate as a number): the same update
(computed in fp32 and rounded once to each tensor's dtype, so 16-bit tensors may differ from
torch's by an ulp a step), state (``step``, ``exp_avg``, ``exp_avg_sq``, in each parameter's
dtype) and state_dict, so a checkpoint of either loads into the other. Complex parameters are
updated as torch updates them: their real and imaginary parts as two real values each. A step
that is refused (a bad option or hyperparameter in any group, a parameter or state it cannot
update) updates nothing. On a GPU each step is a few launches (one per parameter size) at close
to the copy bandwidth; see ``onepass.ops.adamw``. AMSGrad, ``maximize`` and sparse gradients
are not supported.
"""

from __future__ import annotations

import math

import torch

from onepass.ops.adamw import DTYPES, adamw_step, check_hyperparameters, columns_by

# torch.optim.AdamW's keywords this optimizer takes at their defaults only (their other values
# ask for variants it does not implement, or for torch's own implementations)
_TORCH_DEFAULTS = {"amsgrad": False, "maximize": False, "foreach": None, "fused": None, "capturable": False,
                   "differentiable": False}


def _scalar(value):
    """A one-element tensor or a numpy scalar as the float torch's AdamW takes it as; else as given."""
    if (isinstance(value, torch.Tensor) and value.numel() == 1) or type(value).__module__ == "numpy":
        return float(value)
    return value


class AdamW(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, **torch_options):
        for name, value in torch_options.items():
            if name not in _TORCH_DEFAULTS:
                raise TypeError(f"AdamW() got an unexpected keyword argument {name!r}")
            if value != _TORCH_DEFAULTS[name]:
                raise ValueError(f"onepass.optim.AdamW does not implement {name}={value!r} (only "
                                 f"{_TORCH_DEFAULTS[name]!r}, torch.optim.AdamW's default)")
        _check_group({"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for g, group in enumerate(self.param_groups):  # every group and parameter checked before any is updated
            _check_group(group)
            for i, p in enumerate(group["params"]):
                if p.grad is not None:
                    _check_param(f"param_groups[{g}]['params'][{i}]", p, self.state.get(p))
        for group in self.param_groups:
            # parameters at one step count share a launch; a parameter whose gradient was
            # None at some step (so skipped, as torch does) has a count of its own
            quads = []
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                elif not torch.is_tensor(state["step"]):  # an older checkpoint's plain number, as torch loads it
                    state["step"] = torch.tensor(float(state["step"]))
                elif state["step"].device.type != "cpu":  # fused/capturable torch AdamW's: read once, not each step
                    state["step"] = state["step"].cpu()
                quads.append((p, p.grad, state["exp_avg"], state["exp_avg_sq"]))
            beta1, beta2 = group["betas"]
            for step, columns in columns_by(lambda quad: int(self.state[quad[0]]["step"]) + 1, quads).items():
                adamw_step(*([_real(t) for t in column] for column in columns), lr=group["lr"], beta1=beta1,
                           beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"], step=step)
                for p in columns[0]:  # counted once its update ran (a refused step leaves the counts)
                    self.state[p]["step"] += 1
        return loss


def _real(t: torch.Tensor) -> torch.Tensor:
    """A complex tensor as the real tensor of its parts (torch's AdamW updates it so); a real one as it is."""
    return torch.view_as_real(t) if t.is_complex() else t


def _check_param(where: str, p: torch.Tensor, state: dict | None) -> None:
    """What adamw_step would refuse of one parameter with a gradient and its state, named by its
    group and index: adamw_step runs group by group, so its own refusal would come after the
    earlier groups were updated, and names the parameter by its place in one launch."""
    if p.layout != torch.strided or p.grad.layout != torch.strided:
        raise TypeError(f"onepass.optim.AdamW does not support sparse parameters or gradients, got {where} "
                        f"{p.layout} with a {p.grad.layout} gradient")
    if _real(p).dtype not in DTYPES:
        raise TypeError(f"onepass.optim.AdamW updates float32, float16, bfloat16 and float64 parameters (and "
                        f"complex ones of these), got {where} of {p.dtype}")
    if not state:  # made at its first update
        return
    for key in ("exp_avg", "exp_avg_sq"):
        t = state[key]
        if (t.shape, t.dtype, t.device) != (p.shape, p.dtype, p.device):
            raise ValueError(f"the state {key!r} of {where} must match it ({tuple(p.shape)} {p.dtype} on "
                             f"{p.device}), got {tuple(t.shape)} {t.dtype} on {t.device} (a state_dict of "
                             "other parameters was loaded?)")
    step = float(state["step"])
    if not (0 <= step < math.inf and step == int(step)):
        raise ValueError(f"the state 'step' of {where} must be a whole number >= 0, got {step}")


def _check_group(group: dict) -> None:
    """A param group's options and hyperparameters (from the constructor, add_param_group or a
    loaded state_dict) as the update takes them."""
    for option in ("amsgrad", "maximize"):
        if group.get(option):
            raise ValueError(f"onepass.optim.AdamW does not implement {option}=True (a state_dict of "
                             "torch.optim.AdamW with it was loaded?)")
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    check_hyperparameters(*(_scalar(v) for v in (group["lr"], *betas, group["eps"], group["weight_decay"])))
