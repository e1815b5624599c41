"""Second derivatives through an op whose backward runs Triton kernels: not available, so a
backward with ``create_graph=True`` raises, where it silently left the op's share out of the
second derivative (its gradients carried no graph back to its inputs). The reference path
has second derivatives."""

import pytest
import torch
import torch.nn.functional as F

from onepass import ops, reference_mode

torch.manual_seed(0)
_W = torch.randn(8)
_TARGET = torch.tensor([1, 3, 0, 7])


def _rope(x):
    cos, sin = torch.randn(4, 8).cos(), torch.randn(4, 8).sin()
    q, k = ops.rope(x.view(1, 1, 4, 8), x.view(1, 1, 4, 8) * 2, cos.to(x.device), sin.to(x.device))
    return q.sum() + k.sum() * 3


# each: an op used on x ([4, 8] float32) and reduced to a scalar
OPS = {
    "rms_norm": lambda x: (ops.rms_norm(x, _W.to(x.device)) ** 2).sum(),
    "layer_norm": lambda x: (ops.layer_norm(x, _W.to(x.device)) ** 2).sum(),
    "add_rms_norm": lambda x: sum((t ** 2).sum() for t in ops.add_rms_norm(x, x * 0.5, _W.to(x.device))),
    "swiglu": lambda x: (ops.swiglu(x, x * 0.5) ** 2).sum(),
    "bias_gelu": lambda x: (ops.bias_gelu(x, _W.to(x.device)) ** 2).sum(),
    "softmax": lambda x: (ops.softmax(x) ** 2).sum(),
    "cross_entropy": lambda x: ops.cross_entropy(x, _TARGET.to(x.device)),
    "linear_cross_entropy": lambda x: ops.linear_cross_entropy(x, x.flip(0), _TARGET.remainder(4).to(x.device)),
    "attention": lambda x: (ops.attention(x.view(1, 1, 4, 8), x.view(1, 1, 4, 8) * 0.5,
                                          x.view(1, 1, 4, 8).flip(2), causal=True) ** 2).sum(),
    "rope": _rope,
    # its backward is matmuls, but on products kept from the forward without a graph: the
    # second derivative came out about half the true one
    "lora_linear": lambda x: (ops.lora_linear(x, _W.to(x.device).expand(8, 8).contiguous(), x[:2].contiguous(),
                                              x.t()[:, :2].contiguous(), 2.0) ** 2).sum(),
}


def _grads(op, x0, create_graph):
    x = x0.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(op(x) + (x ** 3).sum(), x, create_graph=create_graph)
    return x, g


@pytest.mark.parametrize("name", list(OPS))
def test_second_derivative_raises(name, device):
    op = OPS[name]
    x0 = torch.randn(4, 8, device=device)
    _grads(op, x0, create_graph=False)  # first derivatives as usual
    with pytest.raises(RuntimeError, match="onepass .*no second derivative"):
        _grads(op, x0, create_graph=True)


def test_reference_path_has_second_derivatives(device):
    x0 = torch.randn(4, 8, device=device)
    w = _W.to(x0.device)
    with reference_mode():
        x, g = _grads(lambda t: (ops.rms_norm(t, w) ** 2).sum(), x0, create_graph=True)
        (hv,) = torch.autograd.grad((g * g).sum(), x)
    xt = x0.clone().requires_grad_(True)
    (gt,) = torch.autograd.grad((F.rms_norm(xt, (8,), w, 1e-6) ** 2).sum() + (xt ** 3).sum(), xt, create_graph=True)
    (hv_torch,) = torch.autograd.grad((gt * gt).sum(), xt)
    torch.testing.assert_close(hv, hv_torch)


def test_refused_backward_changes_nothing(device):
    """The refusal comes before the backward's work: cross_entropy's gradient, computed in the
    forward and scaled in place by its backward, is still there for a plain backward after it
    (it was consumed and scaled first, so the retry failed as 'already used')."""
    x = torch.randn(4, 8, device=device, requires_grad=True)
    loss = ops.cross_entropy(x, _TARGET.to(device))
    with pytest.raises(RuntimeError, match="no second derivative"):
        torch.autograd.grad(loss * 2, x, create_graph=True)
    loss.backward()
    torch.testing.assert_close(x.grad, torch.autograd.grad(F.cross_entropy(x, _TARGET.to(device)), x)[0])
