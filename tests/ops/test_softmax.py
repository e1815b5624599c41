import pytest
import torch

from onepass import ops, reference
from onepass.testing import assert_close

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _check(x, dtype, scale=0.5, mask=None, causal=False, dim=-1, tol_scale=1.0):
    """Output and every gradient (x, and a trainable additive mask) against the float64 reference."""
    x.requires_grad_(True)
    y = ops.softmax(x, dim, scale, mask, causal)
    assert y.shape == x.shape and y.dtype == x.dtype
    dy = torch.randn_like(y)
    y.backward(dy)
    xd = x.detach().double().requires_grad_(True)
    md = None
    if mask is not None:
        md = mask.detach().double() if mask.is_floating_point() else mask
        md.requires_grad_(mask.requires_grad)
    yr = reference.softmax(xd, dim, scale, md, causal)
    yr.backward(dy.double())
    assert_close(y, yr, dtype, "y", tol_scale)
    # dx cancels across a row (sum(dx) = 0): measure it against dy's natural scale
    floor = (dy.double() * yr).norm().item()
    assert_close(x.grad, xd.grad, dtype, "dx", tol_scale, floor * abs(scale))
    if mask is not None and mask.requires_grad:
        assert mask.grad.shape == mask.shape
        assert_close(mask.grad, md.grad, dtype, "dmask", tol_scale, floor)
    return y


# irregular, a single column, a power of two, rows longer than one block (16384)
@pytest.mark.parametrize("shape", [(3, 5, 123), (4, 1), (2, 64), (2, 20000)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference(shape, dtype, device):
    _check(torch.randn(shape, dtype=dtype, device=device) * 3, dtype)


# S_q == S_k, S_q < S_k (a KV cache), S_q > S_k (the first rows see nothing), a long row
@pytest.mark.parametrize("shape", [(2, 3, 9, 9), (1, 2, 5, 37), (2, 1, 7, 3), (1, 1, 3, 17000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal(shape, dtype, device):
    y = _check(torch.randn(shape, dtype=dtype, device=device), dtype, scale=0.3, causal=True)
    s_q, s_k = shape[-2:]
    hidden = torch.ones(s_q, s_k, dtype=torch.bool, device=device).triu(s_k - s_q + 1)
    assert (y[..., hidden] == 0).all()


@pytest.mark.parametrize("mask_shape", [(2, 1, 6, 45), (1, 1, 1, 45), (6, 1), (45,), (2, 3, 6, 45)])
@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_broadcast_masks(mask_shape, kind, device):
    x = torch.randn(2, 3, 6, 45, device=device)
    if kind == "bool":
        mask = torch.rand(mask_shape, device=device) > 0.3
    else:
        mask = torch.randn(mask_shape, device=device).masked_fill(torch.rand(mask_shape, device=device) < 0.2,
                                                                   float("-inf"))
    _check(x, torch.float32, scale=1.3, mask=mask)
    _check(x.detach().clone(), torch.float32, scale=1.3, mask=mask, causal=True)


def test_half_precision_additive_mask_and_bf16_input(device):
    x = torch.randn(3, 4, 70, dtype=torch.bfloat16, device=device)
    mask = torch.randn(4, 70, dtype=torch.float16, device=device)
    _check(x, torch.bfloat16, mask=mask)


def test_trainable_additive_mask_gets_its_gradient(device):
    x = torch.randn(2, 3, 5, 19, device=device)
    bias = torch.randn(3, 1, 19, device=device, requires_grad=True)  # an ALiBi-like learned bias
    _check(x, torch.float32, scale=0.8, mask=bias, causal=True)


def test_fully_masked_rows_give_zeros_not_nan(device):
    x = torch.randn(2, 4, 30, device=device, requires_grad=True)
    mask = torch.rand(2, 4, 30, device=device) > 0.5
    mask[0, 1] = False  # one row fully masked by the bool mask
    add = torch.zeros(4, 30, device=device)
    add[2] = float("-inf")  # and one by the additive mask
    for m in (mask, add):
        y = ops.softmax(x, mask=m)
        y.backward(torch.randn_like(y))
        assert torch.isfinite(y).all() and torch.isfinite(x.grad).all()
        dead = y[0, 1] if m is mask else y[:, 2]
        assert (dead == 0).all()
        grads = x.grad[0, 1] if m is mask else x.grad[:, 2]
        assert (grads == 0).all()
        x.grad = None
    _check(x.detach().clone(), torch.float32, mask=mask)


@pytest.mark.parametrize("dim", [0, 1])
def test_other_dims(dim, device):
    x = torch.randn(7, 5, 33, device=device)
    mask = torch.rand(7, 1, 33, device=device) > 0.2
    _check(x, torch.float32, scale=2.0, dim=dim, mask=mask)


def test_non_contiguous_input(device):
    x = torch.randn(3, 8, 50, device=device)[:, ::2, 5:45]  # [3, 4, 40], rows 100 apart
    assert not x.is_contiguous() and x.stride(-1) == 1
    _check(x, torch.float32)
    _check(torch.randn(40, 6, device=device).t(), torch.float32)  # a strided last dim: copied first


def test_many_batch_dims_and_a_mask_that_cannot_merge(device):
    x = torch.randn(2, 3, 2, 4, 9, device=device)
    mask = torch.rand(2, 1, 2, 1, 9, device=device) > 0.3
    _check(x, torch.float32, mask=mask)


def test_nan_or_inf_in_a_row_gives_nan_as_torch(device):
    """A row holding NaN or +inf comes out all NaN, as torch.softmax gives it (a NaN sum is
    not taken for a fully masked row's 0), in the one-block and the two-pass kernels."""
    for n in (8, 40000):
        x = torch.randn(3, n, device=device)
        x[0, 1], x[1, 2] = float("nan"), float("inf")
        y = ops.softmax(x)
        assert y[:2].isnan().all()
        assert_close(y[2], torch.softmax(x[2], -1), torch.float32)


def test_empty(device):
    for shape in [(0, 16), (3, 0), (2, 0, 5)]:
        x = torch.randn(shape, device=device, requires_grad=True)
        y = ops.softmax(x, causal=len(shape) > 1)
        assert y.shape == x.shape
        y.sum().backward()
        assert x.grad.shape == x.shape


# ------------------------------------------------------------- compile and opcheck


def test_torch_compile_fullgraph(device):
    x = torch.randn(2, 2, 6, 24, device=device, requires_grad=True)
    mask = torch.randn(1, 1, 6, 24, device=device)

    def attention_probs(x, mask):
        return ops.softmax(x, scale=0.25, mask=mask, causal=True) * 2.0

    compiled = torch.compile(attention_probs, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    out = compiled(x, mask)
    out.sum().backward()
    grad = x.grad.clone()
    x.grad = None
    eager = attention_probs(x, mask)
    eager.sum().backward()
    assert_close(out, eager, torch.float32)
    assert_close(grad, x.grad, torch.float32, floor=1.0)


def test_opcheck(device):
    from onepass.ops.softmax import _softmax_fwd

    x = torch.randn(2, 3, 5, 21, device=device, requires_grad=True)
    bool_mask = torch.rand(2, 1, 5, 21, device=device) > 0.4
    add_mask = torch.randn(5, 21, device=device, requires_grad=True)
    for args in [(x, None, 0.5, True), (x, bool_mask, 1.0, False), (x, add_mask, 0.7, True)]:
        torch.library.opcheck(_softmax_fwd, args)


# ------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("call, error, words", [
    (lambda x: ops.softmax(x.long()), TypeError, "x"),
    (lambda x: ops.softmax(x, dim=3), ValueError, "dim"),
    (lambda x: ops.softmax(x, mask=torch.ones(5, 8, dtype=torch.bool, device=x.device)), ValueError, "mask"),
    (lambda x: ops.softmax(x, mask=torch.ones(4, 2, 8, device=x.device)), ValueError, "mask"),
    (lambda x: ops.softmax(x, mask=torch.ones(8, dtype=torch.int32, device=x.device)), TypeError, "mask"),
    (lambda x: ops.softmax(x, mask=[True] * 8), TypeError, "mask"),
    (lambda x: ops.softmax(x, mask=torch.ones(8, device="meta")), ValueError, "device"),
    (lambda x: ops.softmax(x, dim=0, causal=True), ValueError, "causal"),
    (lambda x: ops.softmax(x[0, 0], causal=True), ValueError, "causal"),
    (lambda x: ops.softmax(torch.tensor(1.0, device=x.device)), ValueError, "x"),
    (lambda x: ops.softmax(x, dim=1.0), TypeError, "dim"),
    (lambda x: ops.softmax(x, scale="2"), ValueError, "scale"),
    (lambda x: ops.softmax(x, scale=float("nan")), ValueError, "scale"),
])
def test_bad_input_raises(call, error, words, device):
    x = torch.randn(2, 3, 8, device=device)
    with pytest.raises(error, match=words):
        call(x)


# ---------------------------------------------------------------- GPU, real sizes


@pytest.mark.gpu
@pytest.mark.parametrize("s_q, s_k, causal", [(2048, 2048, True), (1024, 4096, True), (512, 4096, False)])
def test_gpu_bf16_attention_sizes(s_q, s_k, causal):
    x = torch.randn(2, 16, s_q, s_k, dtype=torch.bfloat16, device="cuda") * 4
    mask = None if causal else torch.rand(2, 1, 1, s_k, device="cuda") > 0.1
    _check(x, torch.bfloat16, scale=s_k ** -0.5, mask=mask, causal=causal)


@pytest.mark.gpu
def test_gpu_bf16_long_rows():
    x = torch.randn(64, 100_000, dtype=torch.bfloat16, device="cuda") * 4
    _check(x, torch.bfloat16, scale=1.0)


@pytest.mark.gpu
def test_gpu_more_than_2_31_elements():
    x = torch.randn(2**31 // 4096 + 8, 4096, dtype=torch.bfloat16, device="cuda")
    y = ops.softmax(x.view(1, -1, 4096), causal=True)
    tail = slice(-16, None)
    # the last 16 of N queries over 4096 keys see what 16 queries over 4096 keys see
    assert_close(y[0, tail], reference.softmax(x[tail].double(), causal=True), torch.bfloat16)
