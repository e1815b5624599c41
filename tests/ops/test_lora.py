import pytest
import torch

from onepass import ops, reference
from onepass.testing import assert_close

NAMES = ("x", "weight", "lora_a", "lora_b", "bias")


def _inputs(shape, k, n, rank, dtype, device, adapter_dtype=None, bias=True):
    adapter_dtype = adapter_dtype or dtype
    x = torch.randn(*shape, k, device=device).to(dtype)
    w = (torch.randn(n, k, device=device) / k**0.5).to(dtype)
    a = (torch.randn(rank, k, device=device) / k**0.5).to(adapter_dtype)
    b = torch.randn(n, rank, device=device).to(adapter_dtype)
    bias_t = torch.randn(n, device=device).to(dtype) if bias else None
    return x, w, a, b, bias_t


def _leaves(tensors, cast=None, frozen=()):
    out = []
    for name, t in zip(NAMES, tensors):
        if t is None:
            out.append(None)
            continue
        t = t.detach().clone() if cast is None else t.detach().to(cast)
        out.append(t.requires_grad_(name not in frozen))
    return out


def _check(tensors, dtype, scaling=2.0, frozen=(), seed=None, ref_dtype=torch.float64, **options):
    """Output and every gradient (random upstream gradient) against the float64 reference
    (``ref_dtype``: CUDA's dropout draws another mask for another dtype from one seed)."""
    leaves = _leaves(tensors, frozen=frozen)
    if seed is not None:
        torch.manual_seed(seed)
    y = ops.lora_linear(leaves[0], leaves[1], leaves[2], leaves[3], scaling, leaves[4], **options)
    dy = torch.randn_like(y)
    y.backward(dy)
    doubles = _leaves(tensors, ref_dtype, frozen)
    if seed is not None:
        torch.manual_seed(seed)
    ref = reference.lora_linear(doubles[0], doubles[1], doubles[2], doubles[3], scaling, doubles[4], **options)
    ref.backward(dy.to(ref_dtype))
    assert y.dtype == tensors[0].dtype and y.shape == ref.shape
    assert_close(y, ref, dtype, "y")
    for name, t, d in zip(NAMES, leaves, doubles):
        if t is None:
            continue
        if name in frozen:
            assert t.grad is None, name
        else:
            assert t.grad.dtype == t.dtype, name
            assert_close(t.grad, d.grad, dtype, f"d{name}")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_matches_reference(dtype, bias, device):
    _check(_inputs((3, 5), 24, 40, 4, dtype, device, bias=bias), dtype)


def test_float32_adapters_on_a_half_base(device):
    """PEFT's default: bf16 base, fp32 adapters; their gradients come out in fp32."""
    _check(_inputs((7,), 32, 16, 8, torch.bfloat16, device, adapter_dtype=torch.float32), torch.bfloat16)


def test_frozen_base_and_rank_one(device):
    _check(_inputs((2, 3), 16, 12, 1, torch.float32, device), torch.float32, frozen=("weight", "bias"))


def test_frozen_input(device):
    _check(_inputs((6,), 16, 12, 2, torch.float32, device), torch.float32, frozen=("x",))


@pytest.mark.parametrize("training", [True, False])
def test_dropout_on_the_adapter_input(training, device):
    """F.dropout's mask (same seed, same mask as the reference draws): only the adapter sees it."""
    tensors = _inputs((4, 6), 16, 24, 4, torch.float32, device)
    f32 = torch.float32
    _check(tensors, f32, seed=5, ref_dtype=f32, dropout_p=0.4, training=training)
    _check(tensors, f32, seed=5, ref_dtype=f32, dropout_p=0.4, training=training, frozen=("weight",))  # x not kept
    x, w, a, b, bias = tensors
    y = ops.lora_linear(x, w, a, b, 2.0, bias, dropout_p=0.4, training=training)
    plain = ops.lora_linear(x, w, a, b, 2.0, bias)
    assert torch.equal(y, plain) != training  # the mask changed the output only in training


def test_non_contiguous_input(device):
    _, w, a, b, bias = _inputs((5,), 16, 12, 4, torch.float32, device)
    xt = torch.randn(16, 5, device=device).t()  # [5, 16], its features 5 elements apart
    _check((xt, w, a, b, bias), torch.float32)


def test_empty_tokens(device):
    x, w, a, b, bias = _leaves(_inputs((0,), 16, 12, 4, torch.float32, device))
    y = ops.lora_linear(x, w, a, b, 2.0, bias)
    assert y.shape == (0, 12)
    y.sum().backward()
    for t in (w, a, b, bias):
        assert torch.equal(t.grad, torch.zeros_like(t))


def test_autocast(device):
    """fp32 x and base under bf16 autocast: bf16 out, as F.linear; gradients in each leaf's dtype."""
    tensors = _inputs((6,), 32, 16, 4, torch.float32, device)
    leaves = _leaves(tensors)
    with torch.autocast(device, dtype=torch.bfloat16):
        y = ops.lora_linear(leaves[0], leaves[1], leaves[2], leaves[3], 2.0, leaves[4])
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    doubles = _leaves(tensors, torch.float64)
    reference.lora_linear(*doubles[:4], 2.0, doubles[4]).sum().backward()
    assert_close(y, reference.lora_linear(*doubles[:4], 2.0, doubles[4]), torch.bfloat16, "y")
    for name, t, d in zip(NAMES, leaves, doubles):
        assert t.grad.dtype == torch.float32
        assert_close(t.grad, d.grad, torch.bfloat16, f"d{name}")


# ------------------------------------------------------------- compile and opcheck


def test_torch_compile_fullgraph(device):
    """Also with a scaling that changes between calls, which the recompile traces as a
    symbolic float (a graph break in the checks before)."""
    leaves = _leaves(_inputs((2, 3), 16, 12, 4, torch.float32, device))

    def step(x, w, a, b, bias, scaling):
        return ops.lora_linear(x * 2.0, w, a, b, scaling, bias).square().sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    for scaling in (0.5, 0.25):
        out = compiled(*leaves, scaling)
        out.backward()
        grads = [t.grad.clone() for t in leaves]
        for t in leaves:
            t.grad = None
        eager = step(*leaves, scaling)
        eager.backward()
        assert_close(out, eager, torch.float32)
        for g, t in zip(grads, leaves):
            assert_close(g, t.grad, torch.float32)
            t.grad = None


def test_opcheck(device):
    from onepass.ops.lora import _lora_bwd, _lora_fwd

    x, w, a, b, bias = _leaves(_inputs((6,), 8, 12, 2, torch.float32, device))
    x_a = torch.randn_like(x).requires_grad_(True)
    torch.library.opcheck(_lora_fwd, (x, w, bias, a, b, 1.5, None))
    torch.library.opcheck(_lora_fwd, (x, w, None, a, b, 1.5, x_a))
    dy = torch.randn(6, 12, device=device)
    t = torch.randn(6, 2, device=device)
    f32 = torch.float32
    for x_arg in (None, x_a.detach()):
        torch.library.opcheck(_lora_bwd, (dy, x.detach(), w.detach(), a.detach(), b.detach(), t, x_arg, 1.5, f32, f32,
                                          True, True, True, True, True, x_arg is not None))
    # with a separate adapter input and a frozen base, x is not kept
    torch.library.opcheck(_lora_bwd, (dy, None, w.detach(), a.detach(), b.detach(), t, x_a.detach(), 1.5, f32, f32,
                                      True, False, False, True, True, True))


# ------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("call, error, words", [
    (lambda x, w, a, b: ops.lora_linear(x, w[:, :5], a, b), ValueError, "weight"),
    (lambda x, w, a, b: ops.lora_linear(x, w.half(), a, b), TypeError, "weight"),
    (lambda x, w, a, b: ops.lora_linear(x, w, a[:, :5], b), ValueError, "lora_a"),
    (lambda x, w, a, b: ops.lora_linear(x, w, a, b[:, :1]), ValueError, "lora_b"),
    (lambda x, w, a, b: ops.lora_linear(x, w, a, b, 1.0, torch.randn(3, device=x.device)), ValueError, "bias"),
    (lambda x, w, a, b: ops.lora_linear(x, w, a, b, float("nan")), ValueError, "scaling"),
    (lambda x, w, a, b: ops.lora_linear(x, w, a, b, "2"), TypeError, "scaling"),
    (lambda x, w, a, b: ops.lora_linear(x, w, a, b, dropout_p=1.0), ValueError, "dropout_p"),
    (lambda x, w, a, b: ops.lora_linear(x.long(), w, a, b), TypeError, "x"),
])
def test_bad_input_raises(call, error, words, device):
    x, w, a, b, _ = _inputs((4,), 8, 6, 2, torch.float32, device)
    with pytest.raises(error, match=words):
        call(x, w, a, b)


# ---------------------------------------------------------------- GPU, real sizes


@pytest.mark.gpu
@pytest.mark.parametrize("k, n", [(2048, 2048), (2048, 8192), (8192, 2048)])
def test_gpu_bf16_llama_projections(k, n):
    """Llama-3.2-1B's projection shapes, 4096 tokens, rank 16, PEFT's fp32 adapters on a bf16 base."""
    tensors = _inputs((2, 2048), k, n, 16, torch.bfloat16, "cuda", adapter_dtype=torch.float32, bias=False)
    _check(tensors, torch.bfloat16, frozen=("weight",))
