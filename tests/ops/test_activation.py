import pytest
import torch

from onepass import ops, reference
from onepass.testing import assert_close

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# irregular, a last dim of 1, a power of two, more columns than one tile (256)
SHAPES = [(3, 5, 123), (7, 1), (4, 64), (2, 1000)]
OPS = ["swiglu", "geglu_tanh", "geglu_none", "bias_gelu_tanh", "bias_gelu_none"]


def _inputs(op, shape, dtype, device):
    x = torch.randn(shape, dtype=dtype, device=device) * 2
    second = (torch.randn(shape, dtype=dtype, device=device) if not op.startswith("bias")
              else torch.randn(shape[-1], dtype=dtype, device=device))
    return x, second


def _apply(op, lib, a, b):
    if op == "swiglu":
        return lib.swiglu(a, b)
    if op.startswith("geglu"):
        return lib.geglu(a, b, approximate=op.split("_")[1])
    return lib.bias_gelu(a, b, approximate=op.split("_")[2])


def _check(op, a, b, dtype):
    a.requires_grad_(True)
    b.requires_grad_(True)
    y = _apply(op, ops, a, b)
    gy = torch.randn_like(y)
    y.backward(gy)
    ad, bd = (t.detach().double().requires_grad_(True) for t in (a, b))
    yr = _apply(op, reference, ad, bd)
    yr.backward(gy.double())
    assert y.dtype == a.dtype and y.shape == a.shape
    assert_close(y, yr, dtype, "y")
    assert_close(a.grad, ad.grad, dtype, "d_first")
    # the bias gradient sums over rows: its error grows with their count (scale 2)
    assert_close(b.grad, bd.grad, dtype, "d_second", scale=2.0 if op.startswith("bias") else 1.0)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_matches_reference(op, dtype, shape, device):
    _check(op, *_inputs(op, shape, dtype, device), dtype)


@pytest.mark.parametrize("op", ["bias_gelu_tanh", "bias_gelu_none"])
def test_bias_backward_row_runs(op, device):
    """Enough rows that each backward program walks several row tiles, the last run short."""
    _check(op, *_inputs(op, (595, 24), torch.float32, device), torch.float32)


@pytest.mark.parametrize("op", ["swiglu", "bias_gelu_tanh"])
def test_non_contiguous(op, device):
    a = torch.randn(50, 6, device=device).t()
    b = torch.randn(6, 100, device=device)[:, ::2] if op == "swiglu" else torch.randn(100, device=device)[::2]
    _check(op, a, b, torch.float32)


@pytest.mark.parametrize("op", OPS)
def test_empty(op, device):
    a, b = _inputs(op, (0, 8), torch.float32, device)
    a.requires_grad_(True)
    b.requires_grad_(True)
    y = _apply(op, ops, a, b)
    assert y.shape == (0, 8)
    y.sum().backward()
    assert torch.equal(b.grad, torch.zeros_like(b))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("shape", [(4, 0), (3, 2, 0), (0,)])
def test_no_columns(op, shape, device):
    """A last dim of 0: empty results and gradients, as PyTorch."""
    a, b = _inputs(op, shape, torch.float32, device)
    a.requires_grad_(True)
    b.requires_grad_(True)
    y = _apply(op, ops, a, b)
    assert y.shape == shape
    y.sum().backward()
    assert a.grad.shape == shape and b.grad.shape == b.shape


def test_bias_in_another_dtype(device):
    x = torch.randn(9, 70, dtype=torch.bfloat16, device=device)
    b = torch.randn(70, dtype=torch.float32, device=device)
    _check("bias_gelu_tanh", x, b, torch.bfloat16)
    assert b.grad.dtype == torch.float32


def test_torch_compile_fullgraph(device):
    g = torch.randn(4, 40, device=device, requires_grad=True)
    u = torch.randn(4, 40, device=device, requires_grad=True)
    b = torch.randn(40, device=device, requires_grad=True)

    def mlp(g, u, b):
        return ops.bias_gelu(ops.swiglu(g, u), b) + ops.geglu(g, u, approximate="none")

    compiled = torch.compile(mlp, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    out = compiled(g, u, b)
    out.sum().backward()
    grads = [t.grad.clone() for t in (g, u, b)]
    for t in (g, u, b):
        t.grad = None
    mlp(g, u, b).sum().backward()
    for got, t in zip(grads, (g, u, b)):
        assert_close(got, t.grad, torch.float32)


def test_opcheck(device):
    from onepass.ops.activation import GELU_ERF, GELU_TANH, SILU, _act_fwd

    x = torch.randn(5, 33, device=device, requires_grad=True)
    u = torch.randn(5, 33, device=device, requires_grad=True)
    b = torch.randn(33, device=device, requires_grad=True)
    for args in [(x, u, None, SILU), (x, u, None, GELU_ERF), (x, None, b, GELU_TANH)]:
        torch.library.opcheck(_act_fwd, args)


@pytest.mark.parametrize("call, error, words", [
    (lambda x: ops.swiglu(x, x[:, :3]), ValueError, "up"),
    (lambda x: ops.swiglu(x, x.double()), TypeError, "up"),
    (lambda x: ops.swiglu(x.int(), x.int()), TypeError, "gate"),
    (lambda x: ops.geglu(x, x, approximate="fast"), ValueError, "approximate"),
    (lambda x: ops.bias_gelu(x, x[0, :5]), ValueError, "bias"),
    (lambda x: ops.bias_gelu(x, x), ValueError, "bias"),
    (lambda x: ops.bias_gelu(x, x[0].to("meta")), ValueError, "device"),
])
def test_bad_input(call, error, words, device):
    with pytest.raises(error, match=words):
        call(torch.randn(4, 16, device=device))


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
def test_gpu_bf16_real_sizes(op):
    _check(op, *_inputs(op, (16384, 8192), torch.bfloat16, "cuda"), torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["swiglu", "geglu_tanh", "geglu_none"])
def test_gated_grads_rebuild_the_product(op, dtype, device):
    """``gated_grads``: the backward of the gated op and its forward's product, in one pass."""
    from onepass.ops import activation

    act = {"swiglu": activation.SILU, "geglu_tanh": activation.GELU_TANH, "geglu_none": activation.GELU_ERF}[op]
    gate, up = _inputs(op, (3, 5, 123), dtype, device)
    dy = torch.randn_like(gate)
    d_gate, d_up, product = activation.gated_grads(dy, gate, up, act)
    gd, ud = (t.double().requires_grad_(True) for t in (gate, up))
    ref = _apply(op, reference, gd, ud)
    ref.backward(dy.double())
    assert product.dtype == d_gate.dtype == d_up.dtype == dtype
    assert_close(product, ref, dtype, "product")
    assert_close(d_gate, gd.grad, dtype, "d_gate")
    assert_close(d_up, ud.grad, dtype, "d_up")
