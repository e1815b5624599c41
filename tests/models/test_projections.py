"""onepass.models.projections: linears sharing an input (gradient sums inside the matmuls)
and the gated MLP node (product rebuilt in backward).

Against the same modules called as Hugging Face calls them, in float64 (the node runs in
fp32; bf16 under autocast): outputs and every gradient; frozen weights; biases; autocast with an fp32
residual stream; what the MLP node keeps for backward; and where it must not apply.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from onepass.models import projections
from onepass.ops import activation
from onepass.ops import projections as projection_ops
from onepass.ops.dispatch import interpreting
from onepass.testing import assert_close

ACTS = {activation.SILU: F.silu, activation.GELU_TANH: lambda z: F.gelu(z, approximate="tanh"),
        activation.GELU_ERF: F.gelu}


class MLP(nn.Module):
    def __init__(self, hidden, intermediate, dtype):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False, dtype=dtype)

    def forward(self, x, act):
        return self.down_proj(ACTS[act](self.gate_proj(x)) * self.up_proj(x))


def _grads(out, tensors, seed=0):
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    g = g.to(out.device, out.dtype)
    return torch.autograd.grad(out, tensors, g, allow_unused=True)


def _leaf(*shape, device, dtype=torch.float32):
    return torch.randn(*shape, device=device, dtype=dtype, requires_grad=True)


def _double(module, *tensors):
    """A float64 copy of ``module`` and of ``tensors`` (leaves), for the reference."""
    return copy.deepcopy(module).double(), [t.detach().double().requires_grad_() for t in tensors]


@pytest.mark.parametrize("bias", [False, True])
def test_linears_match_the_modules(bias, device):
    mods = nn.ModuleList(nn.Linear(12, n, bias=bias, device=device) for n in (16, 8, 8))
    assert projections.fusable(torch.empty(1, device=device), tuple(mods))
    x = _leaf(2, 5, 12, device=device)
    ref_mods, (ref_x,) = _double(mods, x)
    outs = projections.linears(x, tuple(mods))
    refs = tuple(m(ref_x) for m in ref_mods)
    for o, r in zip(outs, refs):
        assert o.shape == r.shape
        assert_close(o, r, torch.float32)
    got = _grads(torch.cat(outs, -1), [x, *mods.parameters()])
    want = _grads(torch.cat(refs, -1), [ref_x, *ref_mods.parameters()])
    for i, (g, w) in enumerate(zip(got, want)):
        assert_close(g, w, torch.float32, f"gradient {i}")
    assert outs[0].grad_fn.next_functions[0][0].name().endswith("_SharedInputBackward")  # the path under test ran


@pytest.mark.parametrize("act", list(ACTS))
def test_gated_mlp_matches_the_module(act, device):
    mlp = MLP(12, 24, torch.float32).to(device)
    x = _leaf(3, 4, 12, device=device)
    ref_mlp, (ref_x,) = _double(mlp, x)
    out = projections.gated_mlp(mlp, x, act)
    ref = ref_mlp(ref_x, act)
    assert_close(out, ref, torch.float32)
    got = _grads(out, [x, *mlp.parameters()])
    want = _grads(ref, [ref_x, *ref_mlp.parameters()])
    for i, (g, w) in enumerate(zip(got, want)):
        assert_close(g, w, torch.float32, f"gradient {i}")


@pytest.mark.parametrize("residual_dtype", [torch.float32, torch.float64])
def test_gated_mlp_adds_a_residual_in_a_decode_step(residual_dtype, device):
    """Few rows without autograd (decode_linear's route): the residual inside down_proj's
    launch, or, in another dtype than x (an fp32 stream under autocast), added after it."""
    mlp = MLP(12, 24, torch.float32).to(device)
    x = torch.randn(1, 3, 12, device=device)
    residual = torch.randn(1, 3, 12, device=device, dtype=residual_dtype)
    with torch.no_grad():
        out = projections.gated_mlp(mlp, x, activation.SILU, residual)
    ref_mlp, (ref_x,) = _double(mlp, x)
    assert out.dtype == residual_dtype
    assert_close(out, residual.double() + ref_mlp(ref_x, activation.SILU).detach(), torch.float32)


def test_gated_mlp_keeps_no_product(device):
    mlp = MLP(12, 24, torch.float32).to(device)
    x = _leaf(5, 12, device=device)
    out = projections.gated_mlp(mlp, x, activation.SILU)
    kept = out.grad_fn.saved_tensors
    # x, gate, up and the three weights: the [5, 24] product (down_proj's input) is not among them
    assert [tuple(t.shape) for t in kept] == [(5, 12), (5, 24), (5, 24), (24, 12), (24, 12), (12, 24)]


def test_frozen_weights(device):
    """Only the input's gradient is asked for (LoRA trains adapters beside frozen projections)."""
    mlp = MLP(8, 16, torch.float32).to(device)
    mlp.requires_grad_(False)
    qkv = tuple(nn.Linear(8, 8, device=device).requires_grad_(False) for _ in range(3))
    x = _leaf(4, 8, device=device)
    out = projections.gated_mlp(mlp, x, activation.SILU) + sum(projections.linears(x, qkv))
    ref = mlp(x, activation.SILU) + sum(m(x) for m in qkv)
    (got,), (want,) = _grads(out, [x], seed=1), _grads(ref, [x], seed=1)
    assert_close(got, want, torch.float32)


def test_autocast(device):
    """Under autocast the nodes compute in its dtype; the weight gradients come back in the
    parameters' fp32, as F.linear gives them."""
    mlp = MLP(16, 32, torch.float32).to(device)
    qkv = tuple(nn.Linear(16, 16, dtype=torch.float32, device=device) for _ in range(2))
    x = _leaf(6, 16, device=device)
    params = [x, *mlp.parameters(), *(p for m in qkv for p in m.parameters())]
    results = []
    for run in (lambda: (projections.gated_mlp(mlp, x, activation.SILU), projections.linears(x, qkv)),
                lambda: (mlp(x, activation.SILU), tuple(m(x) for m in qkv))):
        with torch.autocast(device, dtype=torch.bfloat16):
            out, (a, b) = run()
        assert out.dtype == a.dtype == torch.bfloat16
        total = out + a + b
        results.append((total, _grads(total, params)))
    (got, got_grads), (want, want_grads) = results
    assert_close(got, want, torch.bfloat16)
    for i, (g, w) in enumerate(zip(got_grads, want_grads)):
        assert g.dtype == w.dtype == torch.float32
        assert_close(g, w, torch.bfloat16, f"gradient {i}")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.filterwarnings("ignore:Your compiler for AOTAutograd")  # the recording backend
def test_torch_compile_keeps_the_nodes(bias, device):
    """Under torch.compile(fullgraph=True) both nodes run as onepass's registered ops, traced into
    (no graph break, the gradient sums inside their matmuls as in eager) and match eager; a
    linear without a bias beside ones with (Qwen2-style q/k/v gets one each)."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    mlp = MLP(12, 24, torch.float32).to(device)
    qkv = nn.ModuleList(nn.Linear(12, n, bias=bias and n != 4, device=device) for n in (16, 4, 4))
    x = _leaf(2, 3, 12, device=device)
    params = [x, *mlp.parameters(), *qkv.parameters()]

    def step(x):
        return projections.gated_mlp(mlp, x, activation.SILU).sum(-1) + torch.cat(projections.linears(x, tuple(qkv)),
                                                                                     -1).sum(-1)

    backend = AotEagerAndRecordGraphs()
    got = torch.compile(step, fullgraph=True, backend=backend)(x)
    got_grads = _grads(got, params)
    want = step(x)
    assert_close(got, want, torch.float32)
    for i, (g, w) in enumerate(zip(got_grads, _grads(want, params))):
        assert_close(g, w, torch.float32, f"gradient {i}")
    forward, backward = (str(g[0].graph) for g in (backend.fw_graphs, backend.bw_graphs))
    if interpreting():  # the registered ops stay opaque there (dispatch.triton_op)
        assert "onepass.gated_mlp.default" in forward and "onepass.linears.default" in forward
        assert "onepass.gated_mlp_bwd.default" in backward and "onepass.linears_bwd.default" in backward
    else:  # traced into: the activation kernels launched from the graph, the input gradients summed by addmm
        assert "onepass" not in forward + backward
        assert "triton_kernel_wrapper" in forward and "triton_kernel_wrapper" in backward
        assert backward.count("aten.addmm") >= 3  # q/k/v: 2, gate/up: 1


def test_opcheck(device):
    x = _leaf(5, 12, device=device)
    w_gate, w_up, w_down = _leaf(24, 12, device=device), _leaf(24, 12, device=device), _leaf(12, 24, device=device)
    torch.library.opcheck(projection_ops._gated_mlp, (x, w_gate, w_up, w_down, activation.GELU_TANH))
    weights, bias = [_leaf(8, 12, device=device), _leaf(4, 12, device=device)], _leaf(4, device=device)
    torch.library.opcheck(projection_ops._linears, (x, weights, [bias], [False, True]))
    grads = [torch.randn(5, 8, device=device), torch.randn(5, 4, device=device)]
    torch.library.opcheck(projection_ops._linears_bwd, (grads, x.detach(), [w.detach() for w in weights], True,
                                                     [True, False], [False, True]))
    gate, up = torch.randn(5, 24, device=device), torch.randn(5, 24, device=device)
    torch.library.opcheck(projection_ops._gated_mlp_bwd, (torch.randn(5, 12, device=device), x.detach(), gate, up,
                                                      w_gate.detach(), w_up.detach(), w_down.detach(),
                                                      activation.SILU, True, False, True, True))


def test_not_fusable(device, monkeypatch):
    x = torch.empty(1, device=device)
    plain = nn.Linear(4, 4, device=device)

    class Adapted(nn.Linear):  # a subclass (what PEFT and quantisers wrap or replace) may do anything
        pass

    hooked = nn.Linear(4, 4, device=device)
    hooked.register_forward_hook(lambda *a: None)
    replaced = nn.Linear(4, 4, device=device)
    replaced.forward = lambda t: t
    assert projections.fusable(x, (plain,))
    for other in (Adapted(4, 4, device=device), hooked, replaced):
        assert not projections.fusable(x, (plain, other))
    monkeypatch.setenv("ONEPASS_REFERENCE", "1")
    assert not projections.fusable(x, (plain,))
