"""adamw_step and onepass.optim.AdamW: the kernel against the reference update (every dtype),
the optimizer against torch.optim.AdamW (param groups, a skipped gradient, state_dict both
ways), unaligned and non-contiguous tensors, bad inputs."""

from __future__ import annotations

import copy
import re

import numpy as np
import pytest
import torch

from onepass import ops, reference
from onepass.optim import AdamW

SHAPES = [(37, 5), (37, 5), (1,), (1030,), (3, 7, 2)]  # two of one size share a launch; 1030 > one block
OPTIONS = {"lr": 0.01, "beta1": 0.8, "beta2": 0.99, "eps": 1e-6, "weight_decay": 0.1}


def _quads(shapes, dtype, device):
    params = [torch.randn(s, device=device).to(dtype) for s in shapes]
    grads = [torch.randn_like(p) for p in params]
    exp_avgs = [0.1 * torch.randn_like(p) for p in params]
    exp_avg_sqs = [torch.rand_like(p) for p in params]
    return params, grads, exp_avgs, exp_avg_sqs


def _assert_equal_lists(got, want, dtype, what):
    # fp32 math both ways; the kernel may contract multiply-adds: one rounding apart at most
    tol = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.allclose(g.float(), w.float(), rtol=tol, atol=tol), f"{what}[{i}]"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kernel_matches_reference(dtype, device):
    quads = _quads(SHAPES, dtype, device)
    expected = [[t.clone() for t in ts] for ts in quads]
    ops.adamw_step(*quads, **OPTIONS, step=3)
    reference.adamw_step(*expected, *OPTIONS.values(), 3)
    for got, want, name in zip(quads, expected, ("params", "grads", "exp_avgs", "exp_avg_sqs")):
        _assert_equal_lists(got, want, dtype, name)


def test_unaligned_and_non_contiguous_tensors(device):
    """A view 1 element into its storage (not 16-byte aligned: no vector hint) and a transposed one."""
    storage = [torch.randn(1 + 6 * 40, device=device) for _ in range(4)]
    unaligned = [s[1:].view(6, 40) for s in storage]
    transposed = [torch.randn(40, 6, device=device).t() for _ in range(4)]
    quads = [[u, t] for u, t in zip(unaligned, transposed)]
    quads[3] = [t.abs() if t.is_contiguous() else t.abs().t().contiguous().t() for t in quads[3]]  # v >= 0
    expected = [[t.clone() for t in ts] for ts in quads]
    ops.adamw_step(*quads, **OPTIONS, step=1)
    reference.adamw_step(*expected, *OPTIONS.values(), 1)
    for got, want in zip(quads, expected):
        _assert_equal_lists(got, want, torch.float32, "tensors")


def test_tensor_off_its_element_grid():
    """A CPU tensor whose address is not a multiple of its element size (a buffer read at an odd
    offset), in one update with a tensor of its size and dtype: both updated as the reference
    does, the odd one's neighbouring bytes untouched."""
    buffers = [bytearray(4 * 20 + 2) for _ in range(4)]
    odd = [torch.frombuffer(b, dtype=torch.float32, offset=2, count=20) for b in buffers]
    even = [torch.empty(21)[1:] for _ in range(4)]  # 4- but not 16-byte aligned, as the odd ones
    for quad in (even, odd):
        for t, fill in zip(quad, (torch.randn(20), torch.randn(20), torch.randn(20), torch.rand(20))):
            t.copy_(fill)
    quads = [[e, o] for e, o in zip(even, odd)]
    expected = [[t.clone() for t in ts] for ts in quads]
    heads = [bytes(b[:2]) for b in buffers]
    ops.adamw_step(*quads, **OPTIONS, step=2)
    reference.adamw_step(*expected, *OPTIONS.values(), 2)
    for got, want in zip(quads, expected):
        _assert_equal_lists(got, want, torch.float32, "tensors")
    assert [bytes(b[:2]) for b in buffers] == heads


def test_refused_step_is_not_counted_and_plain_step_counts_load(device):
    """A step that raises leaves the step counts (a later step's bias correction stays right); a
    checkpoint whose step counts are plain numbers (older torch) loads and continues."""
    p = torch.randn(5, device=device, requires_grad=True)
    p.grad = torch.randn_like(p)
    opt = AdamW([p], lr=0.01)
    opt.step()
    opt.param_groups[0]["lr"] = float("nan")
    with pytest.raises(ValueError, match="lr"):
        opt.step()
    assert opt.state[p]["step"].item() == 1
    opt.param_groups[0]["lr"] = 0.01
    state = copy.deepcopy(opt.state_dict())
    state["state"][0]["step"] = 1
    twin = p.detach().clone().requires_grad_()
    twin.grad = p.grad.clone()
    twin_opt = AdamW([twin], lr=0.01)
    twin_opt.load_state_dict(state)
    opt.step(), twin_opt.step()
    assert opt.state[p]["step"].item() == twin_opt.state[twin]["step"].item() == 2
    assert torch.equal(p, twin)


def _optimizers(params, device, **kwargs):
    ours = [p.detach().clone().requires_grad_() for p in params]
    theirs = [p.detach().clone().requires_grad_() for p in params]

    def groups(ps):
        return [{"params": ps[:3]}, {"params": ps[3:], "lr": 0.05, "weight_decay": 0.0}]

    return (ours, AdamW(groups(ours), lr=0.01, weight_decay=0.1, **kwargs),
            theirs, torch.optim.AdamW(groups(theirs), lr=0.01, weight_decay=0.1, foreach=False, **kwargs))


def _steps(pairs, n, skip=None):
    """n steps of each (params, optimizer) pair with the same gradients; the parameter at
    index ``skip`` gets no gradient at the second step."""
    for it in range(n):
        grads = [torch.randn_like(p) for p in pairs[0][0]]
        for params, opt in pairs:
            for i, (p, g) in enumerate(zip(params, grads)):
                p.grad = None if (it == 1 and i == skip) else g.clone()
            opt.step()


def test_optimizer_matches_torch_adamw(device):
    ours, opt, theirs, torch_opt = _optimizers([torch.randn(s, device=device) for s in SHAPES], device,
                                               betas=(0.8, 0.99))
    _steps([(ours, opt), (theirs, torch_opt)], 3, skip=2)
    assert opt.state[ours[2]]["step"].item() == 2 and opt.state[ours[0]]["step"].item() == 3
    _assert_equal_lists(ours, theirs, torch.float32, "params")


def test_state_dict_loads_both_ways(device):
    params = [torch.randn(s, device=device) for s in SHAPES]
    ours, opt, theirs, torch_opt = _optimizers(params, device)
    _steps([(theirs, torch_opt)], 2)
    for p, q in zip(ours, theirs):
        p.data.copy_(q)
    # deep copies, as a checkpoint is: a live state_dict shares its tensors with the optimizer
    opt.load_state_dict(copy.deepcopy(torch_opt.state_dict()))  # torch's checkpoint continues in onepass
    _steps([(ours, opt), (theirs, torch_opt)], 2)
    _assert_equal_lists(ours, theirs, torch.float32, "params after torch's state")
    torch_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # and onepass's in torch
    _steps([(ours, opt), (theirs, torch_opt)], 1)
    _assert_equal_lists(ours, theirs, torch.float32, "params after onepass's state")


def _bad(device, **change):
    quads = list(_quads([(4, 3)], torch.float32, device))
    kwargs = dict(OPTIONS, step=1)
    for key in ("params", "grads", "exp_avgs", "exp_avg_sqs"):
        if key in change:
            quads[("params", "grads", "exp_avgs", "exp_avg_sqs").index(key)] = change.pop(key)
    kwargs.update(change)
    return lambda: ops.adamw_step(*quads, **kwargs)


@pytest.mark.parametrize("change, error, words", [
    ({"grads": []}, ValueError, "one length"),
    ({"params": torch.zeros(4, 3)}, TypeError, "params must be a list of tensors"),
    ({"exp_avgs": [torch.zeros(3, 4)]}, ValueError, "exp_avgs[0] must match params[0]"),
    ({"grads": [torch.zeros(4, 3).to_sparse()]}, TypeError, "sparse"),
    ({"exp_avg_sqs": [torch.zeros(4, 3, dtype=torch.int32)]}, TypeError, "exp_avg_sqs[0] must be float32"),
    ({"lr": -1.0}, ValueError, "lr must be >= 0"),
    ({"beta2": 1.0}, ValueError, "beta2 must be in [0, 1)"),
    ({"weight_decay": -0.1}, ValueError, "weight_decay"),
    ({"step": 0}, ValueError, "step must be a finite whole number >= 1"),
    ({"step": 1.5}, ValueError, "step must be a finite whole number >= 1"),
    ({"step": float("nan")}, ValueError, "step must be a finite whole number >= 1"),
    ({"step": float("inf")}, ValueError, "step must be a finite whole number >= 1"),
    ({"step": None}, TypeError, "step must be a number"),
    ({"lr": float("inf")}, ValueError, "lr must be a finite number"),
])
def test_bad_input_raises(change, error, words, device):
    call = _bad(device, **change)
    with pytest.raises(error, match=re.escape(words)):
        call()


def test_optimizer_matches_torch_adamw_in_float64(device):
    """float64 parameters take the plain update in float64, as torch's AdamW computes them."""
    ours, opt, theirs, torch_opt = _optimizers([torch.randn(s, device=device, dtype=torch.float64)
                                                for s in SHAPES], device)
    _steps([(ours, opt), (theirs, torch_opt)], 3)
    for i, (p, q) in enumerate(zip(ours, theirs)):
        assert p.dtype == torch.float64 and torch.allclose(p, q, rtol=1e-12, atol=1e-12), f"params[{i}]"


def test_optimizer_betas_must_be_a_pair():
    with pytest.raises(ValueError, match="betas must be a pair"):
        AdamW([torch.zeros(2, requires_grad=True)], betas=(0.9, 0.99, 0.9))


def test_optimizer_refuses_torch_options_it_does_not_implement(device):
    p = torch.zeros(3, device=device, requires_grad=True)
    opt = AdamW([p])
    state = torch.optim.AdamW([p], amsgrad=True).state_dict()
    opt.load_state_dict(state)
    p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match="amsgrad"):
        opt.step()
    with pytest.raises(ValueError, match="beta2"):
        AdamW([p], betas=(0.9, 1.0))


def test_a_refused_step_updates_no_group(device):
    """Every group is checked before any is updated: a bad later group left the first one
    stepped (and counted), so a retry stepped it twice."""
    a, b = (torch.zeros(3, device=device, requires_grad=True) for _ in range(2))
    opt = AdamW([a], lr=0.1)
    opt.add_param_group({"params": [b], "amsgrad": True})
    a.grad, b.grad = torch.ones_like(a), torch.ones_like(b)
    with pytest.raises(ValueError, match="amsgrad"):
        opt.step()
    assert not a.any() and not opt.state[a]
    opt.param_groups[1]["amsgrad"] = False
    opt.param_groups[0]["lr"] = float("nan")
    with pytest.raises(ValueError, match="lr"):
        opt.step()
    assert not a.any() and not b.any()


def test_complex_parameters_in_a_later_group_match_torch_adamw(device):
    """A complex parameter (real and imaginary parts updated as two reals, as torch does) in the
    second group: it was refused only after the first group had been stepped and counted."""
    params = [torch.randn(5, 3, device=device), torch.randn(7, device=device, dtype=torch.complex64),
              torch.randn(4, device=device, dtype=torch.complex64)]
    ours = [p.clone().requires_grad_() for p in params]
    theirs = [p.clone().requires_grad_() for p in params]
    opt = AdamW([{"params": ours[:1]}, {"params": ours[1:], "lr": 0.05}], lr=0.01)
    torch_opt = torch.optim.AdamW([{"params": theirs[:1]}, {"params": theirs[1:], "lr": 0.05}], lr=0.01,
                                  foreach=False)
    _steps([(ours, opt), (theirs, torch_opt)], 2)
    for i, (p, q) in enumerate(zip(ours, theirs)):
        assert p.dtype == q.dtype and torch.allclose(p, q, rtol=1e-6, atol=1e-6), f"params[{i}]"
        assert opt.state[p]["exp_avg"].dtype == p.dtype and opt.state[p]["step"].item() == 2


def test_a_parameter_it_cannot_update_refuses_the_step_naming_it(device):
    """A float8 parameter (adamw_step takes 16-, 32- and 64-bit floats) as the second of the
    second group: refused by its group and index before the first group is updated."""
    a = torch.randn(3, device=device, requires_grad=True)
    b = torch.randn(2, device=device).to(torch.float8_e4m3fn).requires_grad_()
    opt = AdamW([a], lr=0.1)
    opt.add_param_group({"params": [torch.randn(2, device=device, requires_grad=True), b]})
    for p in (a, *opt.param_groups[1]["params"]):
        p.grad = torch.ones_like(p)
    before = a.detach().clone()
    with pytest.raises(TypeError, match=re.escape("param_groups[1]['params'][1] of torch.float8_e4m3fn")):
        opt.step()
    assert torch.equal(a, before) and not opt.state


@pytest.mark.parametrize("key, value, words", [
    ("exp_avg", torch.zeros(5), "'exp_avg' of param_groups[1]['params'][0] must match it"),
    ("step", torch.tensor(float("nan")), "'step' of param_groups[1]['params'][0] must be a whole number >= 0"),
])
def test_a_bad_state_refuses_the_step_naming_it(key, value, words, device):
    """A loaded state the update cannot take in the second group: refused by name before any update."""
    a, b = torch.randn(3, device=device, requires_grad=True), torch.randn(4, device=device, requires_grad=True)
    opt = AdamW([{"params": [a]}, {"params": [b]}], lr=0.1)
    a.grad, b.grad = torch.ones_like(a), torch.ones_like(b)
    opt.step()
    opt.state[b][key] = value.to(device) if key != "step" else value
    before = a.detach().clone()
    with pytest.raises(ValueError, match=re.escape(words)):
        opt.step()
    assert torch.equal(a, before) and opt.state[a]["step"].item() == 1


def test_constructor_takes_what_torch_adamw_takes(device):
    p = torch.zeros(3, device=device, requires_grad=True)
    for lr in (torch.tensor(1e-3), np.float32(1e-3)):  # a tensor or numpy learning rate
        AdamW([p], lr=lr, amsgrad=False, maximize=False, foreach=None, fused=None, capturable=False,
              differentiable=False).step()
    with pytest.raises(ValueError, match="fused=True"):
        AdamW([p], fused=True)
    with pytest.raises(TypeError, match="momentum"):
        AdamW([p], momentum=0.9)


@pytest.mark.gpu
def test_gpu_bf16_llama_sized_tensors():
    """Tensors of Llama-3.2-1B's sizes (one of each), bf16: against the reference update."""
    shapes = [(2048, 2048), (512, 2048), (8192, 2048), (2048,), (1000, 2048)]
    quads = _quads(shapes, torch.bfloat16, "cuda")
    expected = [[t.clone() for t in ts] for ts in quads]
    ops.adamw_step(*quads, **OPTIONS, step=7)
    reference.adamw_step(*expected, *OPTIONS.values(), 7)
    for got, want, name in zip(quads, expected, ("params", "grads", "exp_avgs", "exp_avg_sqs")):
        _assert_equal_lists(got, want, torch.bfloat16, name)


def test_checkpoint_of_fused_torch_adamw_keeps_its_step_count_on_the_host(device):
    """torch's fused AdamW keeps ``step`` on the device; loaded here it moves to the host once
    (not read back every step) and the update still matches."""
    p = torch.randn(5, device=device, requires_grad=True)
    q = p.detach().clone().requires_grad_()
    theirs = torch.optim.AdamW([q], lr=0.01)
    q.grad = torch.randn_like(q)
    theirs.step()
    state = copy.deepcopy(theirs.state_dict())
    state["state"][0]["step"] = state["state"][0]["step"].to(device)
    ours = AdamW([p], lr=0.01)
    ours.load_state_dict(state)
    p.data.copy_(q)
    p.grad, q.grad = torch.ones_like(p), torch.ones_like(q)
    ours.step(), theirs.step()
    assert ours.state[p]["step"].device.type == "cpu" and ours.state[p]["step"].item() == 2
    _assert_equal_lists([p], [q], torch.float32, "params")
