import pytest
import torch

from onepass import ops, reference
from onepass.ops.linear_cross_entropy import chunk_tokens
from onepass.testing import assert_close

pytestmark = [pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")]

REDUCTIONS = ["mean", "sum", "none"]
EXTRAS = [(0.0, 0.0, None), (0.1, 1e-3, 4.0)]  # (label_smoothing, z_loss, softcap)


def _inputs(tokens, hidden, vocab, dtype, device, bias=False, ignored=(1,)):
    h = torch.randn(tokens, hidden, device=device).to(dtype)
    w = (torch.randn(vocab, hidden, device=device) / hidden**0.5).to(dtype)
    b = torch.randn(vocab, device=device).to(dtype) if bias else None
    t = torch.randint(0, vocab, (tokens,), device=device)
    t[list(ignored)] = -100
    return h, w, b, t


def _check(h, w, b, t, dtype, scale=1.0, **options):
    """Loss and every gradient (for a random upstream gradient) against the float64 reference."""
    leaves = [x.detach().clone().requires_grad_(True) if x is not None else None for x in (h, w, b)]
    loss = ops.linear_cross_entropy(leaves[0], leaves[1], t, leaves[2], **options)
    dloss = torch.randn_like(loss)
    loss.backward(dloss)
    ref_options = {k: v for k, v in options.items() if k not in ("chunk_size", "accum_dtype", "memory")}
    doubles = [x.detach().double().requires_grad_(True) if x is not None else None for x in (h, w, b)]
    ref = reference.linear_cross_entropy(doubles[0], doubles[1], t, doubles[2], **ref_options)
    ref.backward(dloss.double())
    assert loss.dtype == h.dtype and loss.shape == ref.shape
    assert_close(loss, ref, dtype, "loss", scale)
    for name, x, d in zip(("hidden", "weight", "bias"), leaves, doubles):
        if x is not None:
            assert x.grad.dtype == x.dtype, name
            assert_close(x.grad, d.grad, dtype, f"d{name}", scale)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("label_smoothing, z_loss, softcap", EXTRAS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_matches_reference_over_chunks(reduction, label_smoothing, z_loss, softcap, bias, device):
    # 10 tokens in chunks of 4: the last chunk is short; V = 300 is not a multiple of a block
    h, w, b, t = _inputs(10, 16, 300, torch.float32, device, bias, ignored=(1, 6))
    _check(h, w, b, t, torch.float32, reduction=reduction, label_smoothing=label_smoothing, z_loss=z_loss,
           softcap=softcap, chunk_size=4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("accum_dtype", ["float32", "weight"])
def test_half_precision_and_accumulator(dtype, accum_dtype, device):
    h, w, b, t = _inputs(12, 32, 257, dtype, device, bias=True)
    acc = torch.float32 if accum_dtype == "float32" else dtype
    _check(h.view(3, 4, 32), w, b, t.view(3, 4), dtype, chunk_size=5, accum_dtype=acc, label_smoothing=0.1)


def test_frozen_head_and_no_bias(device):
    h, w, _, t = _inputs(9, 16, 100, torch.float32, device)
    hx = h.clone().requires_grad_(True)
    loss = ops.linear_cross_entropy(hx, w, t, chunk_size=4)
    loss.backward()
    assert w.grad is None
    hd = h.double().requires_grad_(True)
    reference.linear_cross_entropy(hd, w.double(), t).backward()
    assert_close(hx.grad, hd.grad, torch.float32, "dhidden")


def test_lse_and_pred(device):
    h, w, b, t = _inputs(7, 16, 150, torch.float32, device, bias=True)
    loss, lse, pred = ops.linear_cross_entropy(h, w, t, b, softcap=3.0, return_lse=True, return_pred=True,
                                               chunk_size=3)
    ref_lse, ref_pred = reference.logsumexp_argmax(torch.nn.functional.linear(h, w, b).double(), 3.0)
    assert_close(lse, ref_lse, torch.float32, "lse")
    assert torch.equal(pred, ref_pred)


def test_all_targets_ignored(device):
    h, w, _, t = _inputs(5, 8, 60, torch.float32, device)
    t.fill_(-100)
    hx, wx = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    loss = ops.linear_cross_entropy(hx, wx, t)
    loss.backward()
    assert loss.isnan()  # 0 / 0, as F.cross_entropy
    assert not hx.grad.any() and not wx.grad.any()


def test_empty_batch(device):
    w = torch.randn(30, 8, device=device, requires_grad=True)
    h = torch.randn(0, 8, device=device, requires_grad=True)
    loss = ops.linear_cross_entropy(h, w, torch.zeros(0, dtype=torch.long, device=device), reduction="sum")
    loss.backward()
    assert loss.item() == 0 and h.grad.shape == (0, 8) and not w.grad.any()


def test_no_hidden_features(device):
    """Hidden size 0: every logit is 0 (the loss is log V) and the gradients are empty, as PyTorch."""
    h = torch.randn(3, 0, device=device, requires_grad=True)
    w = torch.randn(5, 0, device=device, requires_grad=True)
    loss = ops.linear_cross_entropy(h, w, torch.tensor([0, 1, 4], device=device))
    loss.backward()
    assert_close(loss, torch.tensor(5.0).log(), torch.float32)
    assert h.grad.shape == (3, 0) and w.grad.shape == (5, 0)


@pytest.fixture
def small_blocks(monkeypatch):
    """memory="low" in several token groups and vocabulary blocks, the last of each short."""
    from onepass.ops import linear_cross_entropy_low as low

    monkeypatch.setattr(low, "GROUP_TOKENS", 4)
    monkeypatch.setattr(low, "VOCAB_BLOCK", 128)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("label_smoothing, z_loss, softcap", EXTRAS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_low_memory_matches_reference(reduction, label_smoothing, z_loss, softcap, bias, device, small_blocks):
    h, w, b, t = _inputs(10, 16, 300, torch.float32, device, bias, ignored=(1, 6))
    _check(h, w, b, t, torch.float32, reduction=reduction, label_smoothing=label_smoothing, z_loss=z_loss,
           softcap=softcap, memory="low")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_memory_half_precision_lse_and_pred(dtype, device, small_blocks):
    h, w, b, t = _inputs(12, 32, 257, dtype, device, bias=True)
    _check(h.view(3, 4, 32), w, b, t.view(3, 4), dtype, label_smoothing=0.1, memory="low")
    h, w, b = h.float(), w.float(), b.float()
    loss, lse, pred = ops.linear_cross_entropy(h, w, t, b, softcap=3.0, return_lse=True, return_pred=True,
                                               memory="low")
    ref_lse, ref_pred = reference.logsumexp_argmax(torch.nn.functional.linear(h, w, b).double(), 3.0)
    assert_close(lse, ref_lse, torch.float32, "lse")
    assert torch.equal(pred, ref_pred)


def test_chunk_size_from_the_accumulator():
    # 2048 tokens, evened out over the chunks, multiples of 64
    assert chunk_tokens(8192, torch.float32, 4096) == 2048
    assert chunk_tokens(8192, torch.bfloat16, 4096) == 2048
    assert chunk_tokens(3000, torch.float32, 4096) == 1536  # 2 chunks of 1500, rounded up to 64
    assert chunk_tokens(100, torch.float32, 4096) == 100  # one chunk
    assert chunk_tokens(100, torch.float32, 4096, chunk_size=7) == 7
    # a 16-bit accumulator: the logits buffer at most the weight's size (H tokens), not under 512 tokens
    assert chunk_tokens(8192, torch.bfloat16, 2304) == 2048
    assert chunk_tokens(8192, torch.bfloat16, 1536) == 1408  # 6 chunks of 1365.3, rounded up to 64
    assert chunk_tokens(8192, torch.bfloat16, 768) == 768
    assert chunk_tokens(8192, torch.bfloat16, 384) == 512
    assert chunk_tokens(8192, torch.float32, 768) == 2048


def test_default_accumulates_in_the_weight_dtype(device):
    """accum_dtype=None (the default) is the weight's dtype: the same gradients as asking for it."""
    h, w, _, t = _inputs(12, 32, 40, torch.bfloat16, device)
    grads = []
    for accum in (None, torch.bfloat16):
        hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        ops.linear_cross_entropy(hh, ww, t, chunk_size=5, accum_dtype=accum).backward()
        grads.append((hh.grad, ww.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def test_second_backward_raises(device):
    h, w, _, t = _inputs(4, 8, 40, torch.float32, device)
    h.requires_grad_(True)
    loss = ops.linear_cross_entropy(h, w, t)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph"):
        loss.backward()


# ------------------------------------------------------------- compile and opcheck


def test_torch_compile_fullgraph(device):
    h, w, b, t = _inputs(6, 16, 90, torch.float32, device, bias=True)
    leaves = [x.requires_grad_(True) for x in (h, w, b)]

    def step(h, w, b, t):
        return ops.linear_cross_entropy(h * 2.0, w, t, b, label_smoothing=0.1, chunk_size=4) * 3.0

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    out = compiled(h, w, b, t)
    out.backward()
    grads = [x.grad.clone() for x in leaves]
    for x in leaves:
        x.grad = None
    eager = step(h, w, b, t)
    eager.backward()
    assert_close(out, eager, torch.float32)
    for g, x in zip(grads, leaves):
        assert_close(g, x.grad, torch.float32)


def test_loss_dtype(device):
    """loss_dtype=float32: the loss of float32 logits (HF's causal-LM loss) from 16-bit inputs; a
    summed loss past float16's range stays finite. The gradients do not change."""
    h, w, _, t = _inputs(64, 16, 70, torch.float16, device)
    h = (h * 1000).requires_grad_(True)  # large logits: a summed loss past float16's 65504
    loss = ops.linear_cross_entropy(h, w, t, reduction="sum", loss_dtype=torch.float32)
    assert loss.dtype == torch.float32
    expected = torch.nn.functional.cross_entropy(torch.nn.functional.linear(h, w).float(), t, reduction="sum")
    assert expected > 65504 and torch.isfinite(loss)
    assert_close(loss, expected, torch.float16)
    loss.backward()
    grad, h.grad = h.grad, None
    ops.linear_cross_entropy(h, w, t).backward()  # mean, in float16: the same gradient up to the scale
    assert_close(grad / (t != -100).sum(), h.grad, torch.float16)


def test_opcheck(device):
    from onepass.ops.linear_cross_entropy import _lce_bwd, _lce_fwd

    h, w, b, t = _inputs(6, 8, 70, torch.float32, device, bias=True)
    leaves = [x.requires_grad_(True) for x in (h, w, b)]
    for reduction in ("sum", "none"):
        torch.library.opcheck(_lce_fwd, (*leaves[:2], t, leaves[2], -100, reduction, 0.1, 1e-3, 2.0, True, True,
                                         True, True, True, 4, torch.float32, torch.float32))
    torch.library.opcheck(_lce_bwd, (torch.randn(6, device=device), h.detach(), w.detach(), t, None, -100, 0.0, 0.0,
                                     None, True, True, False, 4, torch.float32))


# ------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("call, error, words", [
    (lambda h, w, t: ops.linear_cross_entropy(h, w[:, :5], t), ValueError, "weight"),
    (lambda h, w, t: ops.linear_cross_entropy(h, w.double(), t), TypeError, "weight"),
    (lambda h, w, t: ops.linear_cross_entropy(h, w, t, torch.randn(3, device=h.device)), ValueError, "bias"),
    (lambda h, w, t: ops.linear_cross_entropy(h, w, t[:2]), ValueError, "target"),
    (lambda h, w, t: ops.linear_cross_entropy(h, w, t, accum_dtype=torch.float16), TypeError, "accum_dtype"),
    (lambda h, w, t: ops.linear_cross_entropy(h, w, t, loss_dtype=torch.int32), TypeError, "loss_dtype"),
    (lambda h, w, t: ops.linear_cross_entropy(h, w, t, chunk_size=0), ValueError, "chunk_size"),
    (lambda h, w, t: ops.linear_cross_entropy(h, w, t, chunk_size=2.5), ValueError, "chunk_size"),
    (lambda h, w, t: ops.linear_cross_entropy(h, w, t, reduction="avg"), ValueError, "reduction"),
    (lambda h, w, t: ops.linear_cross_entropy(h, w, t, memory="lowest"), ValueError, "memory"),
])
def test_bad_input_raises(call, error, words, device):
    h, w, _, t = _inputs(4, 8, 40, torch.float32, device)
    with pytest.raises(error, match=words):
        call(h, w, t)


def test_out_of_range_target_raises(device):
    if device == "cuda":
        pytest.skip("a device-side assert on CUDA (tested in a child process in test_cross_entropy.py)")
    h, w, _, t = _inputs(4, 8, 40, torch.float32, device)
    t[2] = 40
    with pytest.raises(ValueError, match="outside"):
        ops.linear_cross_entropy(h, w, t)


# ---------------------------------------------------------------- GPU, real sizes


@pytest.mark.gpu
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("memory", ["default", "low"])
def test_gpu_bf16_llama3_head(reduction, memory):
    h, w, b, t = _inputs(4096, 1024, 128256, torch.bfloat16, "cuda", ignored=range(0, 4096, 5))
    _check(h, w, b, t, torch.bfloat16, reduction=reduction, label_smoothing=0.1, z_loss=1e-4, memory=memory)


def _gpu_peak_above_inputs(tokens, hidden, vocab, **options):
    """(bytes at the peak above the inputs, loss, dh, dw, the inputs) of one bf16 fwd+bwd."""
    h, w, _, t = _inputs(tokens, hidden, vocab, torch.bfloat16, "cuda")
    h.requires_grad_(True)
    w.requires_grad_(True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = ops.linear_cross_entropy(h, w, t, **options)
    dh, dw = torch.autograd.grad(loss, (h, w))
    return torch.cuda.max_memory_allocated() - base, loss, dh, dw, (h, w, t)


@pytest.mark.gpu
@pytest.mark.parametrize("accum_dtype", [torch.float32, torch.bfloat16])
def test_gpu_peak_memory(accum_dtype):
    """8192 tokens, hidden 2048, vocab 128256 (the benchmark's shape): the full logits
    (2 GiB in bf16) never exist; peak above the inputs is what the module docstring says."""
    tokens, hidden, vocab = 8192, 2048, 128256
    extra, loss, dh, dw, _ = _gpu_peak_above_inputs(tokens, hidden, vocab, accum_dtype=accum_dtype)
    acc_bytes = torch.finfo(accum_dtype).bits // 8
    chunk = chunk_tokens(tokens, accum_dtype, hidden)
    grads = 2 * tokens * hidden + 2 * vocab * hidden  # dh, dw (bf16)
    budget = grads + chunk * vocab * 2 + (acc_bytes * vocab * hidden if accum_dtype == torch.float32 else 0)
    budget = int(budget * 1.02) + 2**26  # per-token vectors, cuBLAS workspace
    assert extra <= budget, f"{extra / 2**30:.3f} GiB above the inputs, budget {budget / 2**30:.3f} GiB"
    assert torch.isfinite(loss) and dh.isfinite().all() and dw.isfinite().all()


@pytest.mark.gpu
def test_gpu_low_memory_peak():
    """memory="low" at the benchmark's shape: above the inputs, the gradients and a few MiB of
    buffer and accumulator (module docstring), where the default holds a float32 dW."""
    from onepass.ops.linear_cross_entropy_low import GROUP_TOKENS, VOCAB_BLOCK

    tokens, hidden, vocab = 8192, 2048, 128256
    extra, _, dh, dw, (h, w, t) = _gpu_peak_above_inputs(tokens, hidden, vocab, memory="low")
    grads = 2 * tokens * hidden + 2 * vocab * hidden
    budget = grads + GROUP_TOKENS * VOCAB_BLOCK * 2 + GROUP_TOKENS * hidden * 4 + 2**26
    assert extra <= budget, f"{extra / 2**30:.3f} GiB above the inputs, budget {budget / 2**30:.3f} GiB"
    hd, wd = h.detach().float().requires_grad_(True), w.detach().float().requires_grad_(True)
    ref_dh, ref_dw = torch.autograd.grad(reference.linear_cross_entropy(hd, wd, t), (hd, wd))
    for name, ours, ref in (("dhidden", dh, ref_dh), ("dweight", dw, ref_dw)):
        err = ((ours.float() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, f"{name}: relative error {err:.2e} against float32"
