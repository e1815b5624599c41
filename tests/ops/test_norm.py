import itertools

import numpy as np
import pytest
import torch

from onepass import ops, reference
from onepass.ops import norm
from onepass.ops.dispatch import interpreting
from onepass.testing import assert_close

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# irregular, a hidden size of 1, a power of two, a row longer than one block (16384), narrow rows two a
# program (plain forms; the last program's second row past the rows)
SHAPES = [(3, 5, 123), (4, 1), (2, 64), (2, 20000), (151, 40)]
KINDS = ["rms", "layer", "add_rms", "add_layer"]


def _call(kind, x, res, w, b, **kw):
    """(outputs, reference function) for one norm kind; outputs is a tuple."""
    if kind == "rms":
        return (ops.rms_norm(x, w, **kw),), lambda x, r, w, b: (reference.rms_norm(x, w),)
    if kind == "layer":
        return (ops.layer_norm(x, w, b, **kw),), lambda x, r, w, b: (reference.layer_norm(x, w, b),)
    if kind == "add_rms":
        return ops.add_rms_norm(x, res, w, **kw), lambda x, r, w, b: reference.add_rms_norm(x, r, w)
    return ops.add_layer_norm(x, res, w, b, **kw), lambda x, r, w, b: reference.add_layer_norm(x, r, w, b)


def _check_against_reference(kind, x, res, w, b, dtype, scale=1.0, **kw):
    leaves = [t for t in (x, res, w, b) if t is not None]
    for t in leaves:
        t.requires_grad_(True)
    outs, ref_fn = _call(kind, x, res, w, b, **kw)
    # a gradient into every output (h too), drawn at random
    grads_out = [torch.randn_like(o) for o in outs]
    torch.autograd.backward(outs, grads_out)
    doubles = [t.detach().double().requires_grad_(True) if t is not None else None for t in (x, res, w, b)]
    ref_outs = ref_fn(*doubles)
    torch.autograd.backward(ref_outs, [g.double() for g in grads_out])
    for i, (o, r) in enumerate(zip(outs, ref_outs)):
        assert_close(o, r, dtype, f"output {i}", scale)
    # With one feature dx cancels to ~0, RMSNorm's dw is a sum of +-dy that may cancel, and
    # LayerNorm's dw is exactly 0: measure gradients against their natural scale. For dx,
    # where the rounding of g = dy * w lands once multiplied by rstd = 1 / sqrt(var + eps)
    # (up to 1000 for a constant row); for dw and db, the size of the terms they sum.
    h = doubles[0].detach() + (doubles[1].detach() if res is not None else 0)
    mean = h.mean(-1, keepdim=True) if kind.endswith("layer") else 0.0
    var = (h - mean).pow(2).mean(-1, keepdim=True)
    rstd = (var + (1e-5 if kind.endswith("layer") else 1e-6)).rsqrt()
    dy = grads_out[0].double()
    g = dy * (w.detach().double() if w is not None else 1.0)
    floors = {"x": max(dy.norm().item(), (g * rstd).norm().item())}
    floors["residual"] = floors["x"]
    floors["weight"] = max(dy.norm().item() * 1e-3, (dy * (h - mean) * rstd).norm().item())
    floors["bias"] = dy.norm().item()
    for name, t, d in zip(("x", "residual", "weight", "bias"), (x, res, w, b), doubles):
        if t is not None:
            assert t.grad is not None and t.grad.dtype == t.dtype, name
            assert_close(t.grad, d.grad, dtype, f"d{name}", scale, floors[name])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_matches_reference(kind, dtype, shape, device):
    x = torch.randn(shape, dtype=dtype, device=device)
    res = torch.randn(shape, dtype=dtype, device=device) if kind.startswith("add") else None
    w = torch.randn(shape[-1], dtype=dtype, device=device)
    b = torch.randn(shape[-1], dtype=dtype, device=device) if kind.endswith("layer") else None
    _check_against_reference(kind, x, res, w, b, dtype)


@pytest.mark.parametrize("kind", ["rms", "add_rms", "layer"])
def test_wide_row_backward(kind, device):
    """8192 < n <= 16384: the backward holds the row as one block, read twice
    (norm.bwd_one_wide_block); past 16384 it splits the row by columns (SHAPES' 20000)."""
    assert norm.bwd_one_wide_block(9000) and not norm.bwd_one_wide_block(8192)
    assert not norm.bwd_one_wide_block(16385)
    x = torch.randn(3, 9000, device=device)
    res = torch.randn(3, 9000, device=device) if kind.startswith("add") else None
    b = torch.randn(9000, device=device) if kind.endswith("layer") else None
    _check_against_reference(kind, x, res, torch.randn(9000, device=device), b, torch.float32)


def test_dropout_p_as_a_numpy_or_tensor_scalar(device):
    x, res = torch.randn(4, 64, device=device), torch.randn(4, 64, device=device)
    expected = ops.add_rms_norm(x, res, dropout_p=0.25, seed=3)
    for p in (np.float32(0.25), torch.tensor(0.25)):
        assert all(torch.equal(a, b) for a, b in zip(ops.add_rms_norm(x, res, dropout_p=p, seed=3), expected))


def test_every_form_reads_rows_past_the_wide_width_in_blocks():
    """Past WIDE_ROW the forward loops over blocks (WIDE_NORM_FWD), RMSNorm too: one block padded to a
    power of two (a row of 12288 in 16384) ran 10% slower on the H200 (results/h200/tune_norm_wide_fwd.log)."""
    for is_rms, has_residual in itertools.product((True, False), repeat=2):
        warps = norm.WIDE_LAYER_NORM_WARPS if not (is_rms or has_residual) else norm.WIDE_NORM_FWD[1]
        assert norm.fwd_settings(12288, 4096, is_rms, has_residual, 132) == (norm.WIDE_NORM_FWD[0], warps, 1)
        assert norm.fwd_settings(8192, 4096, is_rms, has_residual, 132)[0] == 8192  # one block up to WIDE_ROW


@pytest.mark.parametrize("features", [64, 12288])
def test_traced_forward_guards_no_row_count(features):
    """Under torch.compile's dynamic shapes the row count is symbolic: the forward's plan (cached for plain
    ints) must not compare it with anything, or a compiled model recompiles where the rows cross that value
    (its PDL test once compared it with the SM count before asking whether PDL applies). Guards by design,
    not checked here: a plain norm's narrow rows go two a program by the row count (fwd_settings), and the
    backward's grid is min(rows, programs that fill the GPU)."""
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    shape_env = ShapeEnv()
    mode = FakeTensorMode(shape_env=shape_env)
    dynamic_rows = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC])
    x, res = (mode.from_tensor(torch.randn(8, features), symbolic_context=dynamic_rows, source=ConstantSource(name))
              for name in ("x", "residual"))
    w = mode.from_tensor(torch.randn(features))
    assert isinstance(x.shape[0], torch.SymInt)
    with mode:
        norm._norm_fwd_launch(x, res, w, None, 1e-6, 0.0, 0.0, 0, True, x.dtype)
    assert not shape_env.guards


@pytest.mark.parametrize("kind", ["layer", "add_layer"])
def test_wide_layer_norm_statistics_of_a_row_far_from_zero(kind, device):
    """Rows wider than one forward block take LayerNorm's statistics over several blocks; a mean 100x
    the spread must not cancel the variance away (E[h^2] - mean^2 would lose ~1e-3 of it to rounding
    in float32), nor must one feature far out (a "massive activation"), in the first block or first in the
    row (the shift of the one-pass sums: that row takes its statistics again), even where the shifted sums
    overflow float32 (a first value of 1e18)."""
    x = 100.0 + torch.randn(4, 9000, device=device)
    x[:, 7] += 3000.0
    x[1:, 0] -= 3000.0
    x[3, 0] = 1e18
    res = torch.randn(4, 9000, device=device) if kind.startswith("add") else None
    _check_against_reference(kind, x, res, torch.randn(9000, device=device), torch.randn(9000, device=device),
                             torch.float32)


@pytest.mark.parametrize("kind", KINDS)
def test_without_weight_and_bias(kind, device):
    x = torch.randn(6, 37, device=device)
    res = torch.randn(6, 37, device=device) if kind.startswith("add") else None
    _check_against_reference(kind, x, res, None, None, torch.float32)


# x and the residual as views the launchers read in place or copy: a transposed 2-D x with every other column of
# a wider residual; 3-D, a slice of wider rows (rows evenly spaced, read in place) with leading dims swapped (copied)
VIEWS = {
    "2-d": (lambda device: torch.randn(40, 6, device=device).t(),
            lambda device: torch.randn(6, 80, device=device)[:, ::2]),
    "3-d": (lambda device: torch.randn(2, 3, 50, device=device)[..., :40],
            lambda device: torch.randn(3, 2, 40, device=device).transpose(0, 1)),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("view", VIEWS)
def test_non_contiguous_input(kind, view, device):
    make_x, make_res = VIEWS[view]
    x = make_x(device)
    res = make_res(device) if kind.startswith("add") else None
    w = torch.randn(80, device=device)[::2]
    b = torch.randn(40, device=device) if kind.endswith("layer") else None
    _check_against_reference(kind, x, res, w, b, torch.float32)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows, features", [(0, 16), (4, 0)])
def test_empty_input(kind, rows, features, device):
    """No rows, or rows of no features: empty results and zero / empty gradients, as PyTorch."""
    x = torch.randn(rows, features, device=device, requires_grad=True)
    res = torch.randn(rows, features, device=device, requires_grad=True)
    w = torch.randn(features, device=device, requires_grad=True)
    outs, _ = _call(kind, x, res if kind.startswith("add") else None, w, None)
    assert all(o.shape == (rows, features) for o in outs)
    sum(o.sum() for o in outs).backward()
    assert x.grad.shape == (rows, features) and torch.equal(w.grad, torch.zeros_like(w))


@pytest.mark.parametrize("leaves", [True, False])
def test_residual_gradients_of_leaves_and_of_intermediates(leaves, device):
    """Leaf x and residual get two gradient tensors from the kernel (no clone by autograd);
    intermediates share one. Either way both gradients are d(loss)/dh."""
    x0 = torch.randn(6, 50, device=device, requires_grad=True)
    r0 = torch.randn(6, 50, device=device, requires_grad=True)
    w = torch.randn(50, device=device)
    x, res = (x0, r0) if leaves else (x0 * 1.0, r0 * 1.0)
    y, h = ops.add_rms_norm(x, res, w)
    gy, gh = torch.randn_like(y), torch.randn_like(h)
    torch.autograd.backward((y, h), (gy, gh))
    hd = (r0 + x0).detach().double().requires_grad_(True)
    torch.autograd.backward((reference.rms_norm(hd, w.double()), hd), (gy.double(), gh.double()))
    assert x0.grad.data_ptr() != r0.grad.data_ptr()
    assert_close(x0.grad, hd.grad, torch.float32, "dx")
    assert_close(r0.grad, hd.grad, torch.float32, "dres")


def test_mixed_dtypes_fuse_the_casts(device):
    """fp32 residual stream, bf16 branch, bf16 normed output: h stays fp32."""
    x = torch.randn(5, 96, dtype=torch.bfloat16, device=device)
    res = torch.randn(5, 96, dtype=torch.float32, device=device)
    w = torch.randn(96, dtype=torch.float32, device=device)
    y, h = ops.add_rms_norm(x, res, w, out_dtype=torch.bfloat16)
    assert y.dtype == torch.bfloat16 and h.dtype == torch.float32
    _check_against_reference("add_rms", x, res, w, None, torch.bfloat16, out_dtype=torch.bfloat16)
    y = ops.rms_norm(x, w, out_dtype=torch.float32)
    assert y.dtype == torch.float32
    assert_close(y, reference.rms_norm(x.double(), w.double()), torch.bfloat16)


@pytest.mark.parametrize("has_weight", [True, False])
def test_weight_and_bias_gradients_in_their_own_dtypes(has_weight, device):
    """dw and db are summed in one launch, each straight into its parameter's dtype."""
    x = torch.randn(6, 80, dtype=torch.bfloat16, device=device)
    w = torch.randn(80, dtype=torch.float32, device=device) if has_weight else None
    b = torch.randn(80, dtype=torch.float16, device=device)
    _check_against_reference("layer", x, None, w, b, torch.bfloat16)


# ------------------------------------------------------------------------------ dropout


@pytest.mark.parametrize("kind, first", [("add_rms", None), ("add_layer", None), ("add_layer", 1e4)])
@pytest.mark.parametrize("shape", [(8, 200), (2, 20000)])  # 20000: the forward's first block and the rest apart
def test_dropout_matches_reference_with_the_same_mask(kind, first, shape, device):
    """(first: x's first feature far out, so a wide row's shift, x[0] + residual[0] before dropout, is no value
    of the row: its one-pass LayerNorm statistics cancel and take the fallback's passes.)"""
    p = 0.3
    x = torch.randn(shape, device=device)
    if first is not None:
        x[:, 0] = first
    x.requires_grad_(True)
    res = torch.randn(shape, device=device, requires_grad=True)
    w = torch.randn(shape[-1], device=device, requires_grad=True)
    fn = ops.add_rms_norm if kind == "add_rms" else ops.add_layer_norm
    y, h = fn(x, res, w, dropout_p=p, seed=1234)
    keep = (h - res).detach() != 0  # x is never 0, so a dropped element is exactly where h == residual
    gy, gh = torch.randn_like(y), torch.randn_like(h)
    torch.autograd.backward((y, h), (gy, gh))
    xd, rd, wd = (t.detach().double().requires_grad_(True) for t in (x, res, w))
    ref_fn = reference.add_rms_norm if kind == "add_rms" else reference.add_layer_norm
    yr, hr = ref_fn(xd, rd, wd, dropout_p=p, keep_mask=keep)
    torch.autograd.backward((yr, hr), (gy.double(), gh.double()))
    assert_close(y, yr, torch.float32, "y")
    assert_close(h, hr, torch.float32, "h")
    for t, d, name in ((x, xd, "dx"), (res, rd, "dres"), (w, wd, "dw")):
        assert_close(t.grad, d.grad, torch.float32, name)


def test_dropout_rate_and_seed(device):
    p = 0.25
    x = torch.randn(64, 512, device=device) + 3.0  # never 0
    res = torch.randn(64, 512, device=device)
    _, h1 = ops.add_rms_norm(x, res, dropout_p=p, seed=7)
    _, h2 = ops.add_rms_norm(x, res, dropout_p=p, seed=7)
    _, h3 = ops.add_rms_norm(x, res, dropout_p=p, seed=8)
    dropped = (h1 == res).float().mean().item()
    # 32768 Bernoulli(0.25) draws: sd 0.0024, so +-0.015 is over 6 sd
    assert abs(dropped - p) < 0.015
    assert torch.equal(h1, h2)
    assert not torch.equal(h1, h3)
    kept = h1 != res
    assert_close(h1[kept], (res + x / (1 - p))[kept], torch.float32)


def test_seed_none_follows_torch_manual_seed(device):
    x, res = torch.randn(4, 64, device=device), torch.randn(4, 64, device=device)
    torch.manual_seed(3)
    _, h1 = ops.add_rms_norm(x, res, dropout_p=0.5)
    torch.manual_seed(3)
    _, h2 = ops.add_rms_norm(x, res, dropout_p=0.5)
    assert torch.equal(h1, h2)


# ------------------------------------------------------------- compile and opcheck


def test_torch_compile_fullgraph(device):
    x = torch.randn(4, 48, device=device, requires_grad=True)
    res = torch.randn(4, 48, device=device, requires_grad=True)
    w = torch.randn(48, device=device, requires_grad=True)

    def block(x, res, w):
        y, h = ops.add_rms_norm(x, res, w)
        return ops.layer_norm(y, w) + h

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    out = compiled(x, res, w)
    out.sum().backward()
    grads = [t.grad.clone() for t in (x, res, w)]
    for t in (x, res, w):
        t.grad = None
    eager = block(x, res, w)
    eager.sum().backward()
    assert_close(out, eager, torch.float32)
    for g, t in zip(grads, (x, res, w)):
        assert_close(g, t.grad, torch.float32)


def test_opcheck(device):
    from onepass.ops.norm import _norm_fwd

    x = torch.randn(3, 40, device=device, requires_grad=True)
    res = torch.randn(3, 40, device=device, requires_grad=True)
    w = torch.randn(40, device=device, requires_grad=True)
    b = torch.randn(40, device=device, requires_grad=True)
    for args in [(x, res, w, b, 1e-5, 0.0, 0.0, 0, False, torch.float32),
                 (x, None, w, None, 1e-6, 1.0, 0.0, 0, True, torch.float32),
                 (x, res, w, None, 1e-6, 0.0, 0.2, 11, True, torch.float32)]:
        torch.library.opcheck(_norm_fwd, args)


# ------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("call, error, words", [
    (lambda x, w: ops.rms_norm(x, w[:-1]), ValueError, "weight"),
    (lambda x, w: ops.rms_norm(x, w.view(8, 8)), ValueError, "weight"),
    (lambda x, w: ops.rms_norm(x.long(), w), TypeError, "x"),
    (lambda x, w: ops.layer_norm(x, w, torch.randn(3, device=x.device)), ValueError, "bias"),
    (lambda x, w: ops.add_rms_norm(x, x[:, :5], w), ValueError, "residual"),
    (lambda x, w: ops.add_rms_norm(x, x, w, dropout_p=1.0), ValueError, "dropout_p"),
    (lambda x, w: ops.add_layer_norm(x, x, w, dropout_p=-0.1), ValueError, "dropout_p"),
    (lambda x, w: ops.add_rms_norm(x, x, w, dropout_p="0.1"), TypeError, "dropout_p must be a number"),
    (lambda x, w: ops.add_rms_norm(x, None, w, dropout_p=0.1), ValueError, "needs a residual"),
    (lambda x, w: ops.rms_norm(x, w.to("meta")), ValueError, "device"),
    (lambda x, w: ops.rms_norm(x, "weight"), TypeError, "weight"),
    (lambda x, w: ops.rms_norm(x, w, eps=-1.0), ValueError, "eps"),
    (lambda x, w: ops.add_rms_norm(x, x, w, eps=float("nan")), ValueError, "eps"),
    (lambda x, w: ops.layer_norm(x, w, out_dtype=torch.int32), TypeError, "out_dtype"),
])
def test_bad_input_raises_before_any_kernel(call, error, words, device):
    x = torch.randn(4, 64, device=device)
    w = torch.randn(64, device=device)
    with pytest.raises(error, match=words):
        call(x, w)


# ---------------------------------------------------------------- GPU, real sizes


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [768, 4096, 8192, 12288, 65536])
def test_gpu_bf16_real_sizes(kind, n):
    rows = 16384 if n <= 8192 else 512
    x = torch.randn(rows, n, dtype=torch.bfloat16, device="cuda")
    res = torch.randn(rows, n, dtype=torch.bfloat16, device="cuda") if kind.startswith("add") else None
    w = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, dtype=torch.bfloat16, device="cuda") if kind.endswith("layer") else None
    _check_against_reference(kind, x, res, w, b, torch.bfloat16)


@pytest.mark.gpu
def test_gpu_more_than_2_31_elements():
    x = torch.randn(2**31 // 4096 + 8, 4096, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(4096, dtype=torch.bfloat16, device="cuda")
    y = ops.rms_norm(x, w)
    tail = slice(-16, None)
    assert_close(y[tail], reference.rms_norm(x[tail].double(), w.double()), torch.bfloat16)


def test_gradient_through_h_alone(device):
    """Only the residual stream is used downstream: y gets no gradient."""
    x = torch.randn(3, 24, device=device, requires_grad=True)
    res = torch.randn(3, 24, device=device, requires_grad=True)
    _, h = ops.add_rms_norm(x, res)
    (h * 2).sum().backward()
    assert torch.allclose(x.grad, torch.full_like(x, 2.0)) and torch.allclose(res.grad, torch.full_like(res, 2.0))


@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("shape", [(3, 5, 24), (4, 20000)])  # one block; a row longer than one block
def test_norm_passing_input(kind, shape, device):
    """(norm(x), x): the gradient of the passed-on x is added by the norm's backward."""
    from onepass.ops.norm import _NormPassingInput, norm_passing_input

    is_rms = kind == "rms"
    n = shape[-1]
    x = torch.randn(shape, device=device, requires_grad=True)
    w = torch.randn(n, device=device, requires_grad=True)
    b = None if is_rms else torch.randn(n, device=device, requires_grad=True)
    y, passed = norm_passing_input(x, w, b, 1e-6, is_rms)
    assert passed.grad_fn is y.grad_fn and isinstance(y.grad_fn, _NormPassingInput._backward_cls)
    assert torch.equal(passed, x)
    gy, gp = torch.randn_like(y), torch.randn_like(x)
    torch.autograd.backward([y, passed * 3], [gy, gp])
    leaves = [x, w] + ([] if is_rms else [b])
    doubles = [t.detach().double().requires_grad_(True) for t in leaves]
    if is_rms:
        ref = reference.rms_norm(doubles[0], doubles[1], 1e-6)
    else:
        ref = reference.layer_norm(doubles[0], doubles[1], doubles[2], 1e-6)
    torch.autograd.backward([ref, doubles[0] * 3], [gy.double(), gp.double()])
    assert_close(y, ref, torch.float32)
    for name, t, d in zip(("x", "weight", "bias"), leaves, doubles):
        assert_close(t.grad, d.grad, torch.float32, f"d{name}", scale=4.0)
    # only the passed-on x used: its gradient alone
    x.grad = None
    _, passed = norm_passing_input(x, w, b, 1e-6, is_rms)
    (passed * 2).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 2.0))


@pytest.mark.parametrize("call", ["rms", "add_rms", "passing"])
def test_offset_scales_by_one_plus_weight(call, device):
    """offset=1 (Gemma's norm, whose weight stores scale - 1): the output and every gradient as with
    1 + weight for the weight, the offset added inside the kernels (rows of one block and longer)."""
    for n in (40, 20000):
        x, res = (torch.randn(3, n, device=device, requires_grad=True) for _ in range(2))
        w = (0.1 * torch.randn(n, device=device)).requires_grad_(True)
        if call == "rms":
            outs = (ops.rms_norm(x, w, offset=1.0),)
        elif call == "add_rms":
            outs = ops.add_rms_norm(x, res, w, offset=1.0)
        else:
            outs = norm.norm_passing_input(x, w, None, 1e-6, True, 1.0)
        grads = [torch.randn_like(o) for o in outs]
        torch.autograd.backward(outs, grads)
        d = [t.detach().double().requires_grad_(True) for t in (x, res, w)]
        if call == "add_rms":
            refs = reference.add_rms_norm(d[0], d[1], d[2] + 1.0)
        else:
            refs = (reference.rms_norm(d[0], d[2] + 1.0),) + ((d[0],) if call == "passing" else ())
        torch.autograd.backward(refs, [g.double() for g in grads])
        for out, ref in zip(outs, refs):
            assert_close(out, ref, torch.float32)
        for name, t, ref in zip(("x", "residual", "weight"), (x, res, w), d):
            assert (t.grad is None) == (ref.grad is None), name
            if t.grad is not None:
                assert_close(t.grad, ref.grad, torch.float32, f"d{name}", scale=4.0)
    with pytest.raises(ValueError, match="offset"):
        ops.rms_norm(x, w, offset=float("nan"))
    with pytest.raises(ValueError, match="needs one"):  # no weight to add it to: not a silent no-op
        ops.rms_norm(x, None, offset=1.0)


def test_norm_passing_input_compiled_adds_the_gradient_in_the_kernel(device):
    """Under torch.compile too the passed-on x's gradient reaches the norm's backward op
    (dh_out) instead of a separate add in the compiled backward graph; values as eager."""
    from torch._functorch.aot_autograd import aot_module_simplified

    from onepass.ops.norm import norm_passing_input

    backward_graphs = []

    def backend(gm, inputs):
        def keep_backward(g, _):
            backward_graphs.append(g)
            return g.forward

        return aot_module_simplified(gm, inputs, fw_compiler=lambda g, _: g.forward, bw_compiler=keep_backward)

    def step(x, w):
        y, passed = norm_passing_input(x, w, None, 1e-6, True)
        return (y * 2).sum() + (passed * 3).sum()

    x = torch.randn(4, 40, device=device, requires_grad=True)
    w = torch.randn(40, device=device, requires_grad=True)
    torch.compile(step, fullgraph=True, backend=backend)(x, w).backward()
    grads = [x.grad, w.grad]
    x.grad = w.grad = None
    step(x, w).backward()
    assert_close(grads[0], x.grad, torch.float32, "dx")
    assert_close(grads[1], w.grad, torch.float32, "dw")
    (graph,) = backward_graphs
    calls = [n for n in graph.graph.nodes if n.op == "call_function"]
    if interpreting():  # the registered op stays opaque there (dispatch.triton_op): it takes dh_out
        norm_bwd = [n for n in calls if n.target is torch.ops.onepass.norm_bwd.default]
        assert len(norm_bwd) == 1 and norm_bwd[0].args[1] is not None  # dh_out: the passed-on gradient
    else:  # traced into: the backward kernel's launch reads dh_out
        launches = [n.kwargs["kwargs"] for n in calls
                    if n.target is torch.ops.higher_order.triton_kernel_wrapper_functional]
        assert [k["HAS_DH_OUT"] for k in launches if "HAS_DH_OUT" in k] == [True]
    assert not [n for n in calls if n.target is torch.ops.aten.add.Tensor]
