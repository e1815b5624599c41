import pytest
import torch
import torch.nn.functional as F

from onepass import ops, reference
from onepass.ops.dispatch import reference_mode
from onepass.testing import assert_close

pytestmark = [pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")]


def trl_generalized_jsd(student_logits, teacher_logits, labels, beta, temperature):
    """TRL's GKD generalized_jsd_loss (reduction "batchmean" over the non-ignored tokens), in float64."""
    log_p = F.log_softmax(student_logits / temperature, dim=-1)
    log_q = F.log_softmax(teacher_logits / temperature, dim=-1)
    if beta == 0:
        jsd = F.kl_div(log_p, log_q, reduction="none", log_target=True)
    elif beta == 1:
        jsd = F.kl_div(log_q, log_p, reduction="none", log_target=True)
    else:
        b = torch.tensor(beta, dtype=log_p.dtype)
        log_m = torch.logsumexp(torch.stack([log_p + torch.log(1 - b), log_q + torch.log(b)]), dim=0)
        jsd = (b * F.kl_div(log_m, log_q, reduction="none", log_target=True)
               + (1 - b) * F.kl_div(log_m, log_p, reduction="none", log_target=True))
    jsd = jsd.sum(-1)
    if labels is None:
        return jsd.sum() / jsd.shape[0]
    mask = labels != -100
    return jsd[mask].sum() / mask.sum().clamp_min(1)


def definition(hs, ws, ht, wt, target, bs, bt, weight_hard, weight_soft, beta, temperature):
    """The loss spelled out in float64: TRL's JSD plus the hard CE on the untempered student logits."""
    z = F.linear(hs, ws, bs).reshape(-1, ws.shape[0])
    y = F.linear(ht, wt, bt).reshape(-1, wt.shape[0]).detach()
    labels = target.reshape(-1) if target is not None else None
    loss = weight_soft * trl_generalized_jsd(z, y, labels, beta, temperature)
    if target is not None and weight_hard:
        valid = (labels != -100).sum().clamp_min(1)
        loss = loss + weight_hard * F.cross_entropy(z, labels, ignore_index=-100, reduction="sum") / valid
    return loss


def _inputs(tokens, hs, ht, vocab, dtype, device, bias=False, ignored=(1,), spread=2.0):
    def head(hidden):
        h = torch.randn(tokens, hidden, device=device).to(dtype)
        w = (spread * torch.randn(vocab, hidden, device=device) / hidden**0.5).to(dtype)
        b = torch.randn(vocab, device=device).to(dtype) if bias else None
        return h, w, b

    (h_s, w_s, b_s), (h_t, w_t, b_t) = head(hs), head(ht)
    t = torch.randint(0, vocab, (tokens,), device=device)
    t[list(ignored)] = -100
    return h_s, w_s, h_t, w_t, t, b_s, b_t


def _check(inputs, dtype=torch.float32, scale=1.0, dloss=None, weight_hard_loss=0.5, weight_soft_loss=0.5, beta=0.5,
           temperature=1.0, **options):
    """Loss and the student's gradients (for an upstream gradient) against the float64 definition."""
    h_s, w_s, h_t, w_t, t, b_s, b_t = inputs
    leaves = [x.detach().clone().requires_grad_(True) if x is not None else None for x in (h_s, w_s, b_s)]
    teacher = [x.detach().clone().requires_grad_(True) if x is not None else None for x in (h_t, w_t, b_t)]
    loss = ops.linear_jsd_loss(leaves[0], leaves[1], teacher[0], teacher[1], t, leaves[2], teacher[2],
                               weight_hard_loss=weight_hard_loss, weight_soft_loss=weight_soft_loss, beta=beta,
                               temperature=temperature, **options)
    dloss = torch.tensor(1.7) if dloss is None else dloss
    loss.backward(dloss)
    doubles = [x.detach().double().requires_grad_(True) if x is not None else None for x in (h_s, w_s, b_s)]
    t_doubles = [x.detach().double() if x is not None else None for x in (h_t, w_t, b_t)]
    ref = definition(doubles[0], doubles[1], t_doubles[0], t_doubles[1], t, doubles[2], t_doubles[2],
                     weight_hard_loss, weight_soft_loss, beta, temperature)
    ref.backward(dloss.double())
    assert loss.dtype == torch.float32 and loss.shape == ()
    assert_close(loss, ref, dtype, "loss", scale)
    for name, x, d in zip(("hidden", "weight", "bias"), leaves, doubles):
        if x is not None:
            assert x.grad.dtype == x.dtype, name
            assert_close(x.grad, d.grad, dtype, f"d{name}", scale)
    assert all(x is None or x.grad is None for x in teacher)  # the teacher gets no gradient


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 2.5])
def test_matches_definition_over_chunks(beta, temperature, device):
    # 10 tokens in chunks of 4 (the last short), V = 300 not a multiple of a block, hidden sizes differ
    inputs = _inputs(10, 16, 24, 300, torch.float32, device, bias=True, ignored=(1, 6))
    _check(inputs, beta=beta, temperature=temperature, chunk_size=4)


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_soft_only_without_target(beta, device):
    h_s, w_s, h_t, w_t, _, _, _ = _inputs(7, 16, 8, 130, torch.float32, device)
    h_t = torch.cat([h_t, h_t], dim=1)[:, ::2]  # non-contiguous
    _check((h_s.view(7, 1, 16), w_s, h_t.view(7, 1, 8), w_t, None, None, None), beta=beta, temperature=0.7,
           weight_hard_loss=0.9, weight_soft_loss=1.3, chunk_size=3)


@pytest.mark.parametrize("temperature", [1.0, 3.0])
def test_hard_only(temperature, device):
    # no soft loss: the CE of the untempered logits alone, as linear_cross_entropy's mean
    inputs = _inputs(9, 16, 8, 200, torch.float32, device, bias=True, ignored=(0, 4))
    _check(inputs, weight_hard_loss=1.0, weight_soft_loss=0.0, temperature=temperature, chunk_size=4)
    h_s, w_s, h_t, w_t, t, b_s, b_t = inputs
    loss = ops.linear_jsd_loss(h_s, w_s, h_t, w_t, t, b_s, b_t, weight_hard_loss=1.0, weight_soft_loss=0.0)
    assert_close(loss, ops.linear_cross_entropy(h_s, w_s, t, b_s), torch.float32)


def test_long_rows_and_half_precision(device):
    # V past one block (4096 columns a step), bfloat16 student, float16 teacher, bf16 accumulator
    h_s, w_s, h_t, w_t, t, b_s, b_t = _inputs(5, 16, 8, 5000, torch.bfloat16, device, bias=True, ignored=(2,))
    h_t, w_t, b_t = h_t.half(), w_t.half(), b_t.half()
    _check((h_s, w_s, h_t, w_t, t, b_s, b_t), torch.bfloat16, beta=0.25, temperature=1.5, chunk_size=2,
           accum_dtype=torch.bfloat16)


def test_identical_distributions_and_extreme_logits(device):
    # p == q: JSD 0 and no soft gradient; logits far apart: underflowing p or q (the mixture stays finite)
    h_s, w_s, _, _, t, _, _ = _inputs(6, 16, 16, 90, torch.float32, device, ignored=())
    for beta in (0.0, 0.5, 1.0):
        h = h_s.clone().requires_grad_(True)
        loss = ops.linear_jsd_loss(h, w_s, h_s, w_s, t, beta=beta, weight_hard_loss=0.0, weight_soft_loss=1.0)
        loss.backward()
        assert loss.abs() < 1e-6 and h.grad.abs().max() < 1e-6
    inputs = _inputs(6, 16, 16, 90, torch.float32, device, ignored=(), spread=60.0)
    for beta in (0.0, 0.5, 1.0):
        # logits of order 100: their float32 rounding (1e-5) alone moves the gradient by ~1e-4
        _check(inputs, beta=beta, scale=50)


def test_all_ignored_and_empty(device):
    h_s, w_s, h_t, w_t, t, _, _ = _inputs(5, 8, 8, 60, torch.float32, device)
    t.fill_(-100)
    hx = h_s.clone().requires_grad_(True)
    loss = ops.linear_jsd_loss(hx, w_s, h_t, w_t, t)
    loss.backward()
    assert loss.item() == 0 and not hx.grad.any()  # the count clamped to 1, as Liger and TRL's newer trainers
    w = w_s.clone().requires_grad_(True)
    h = torch.randn(0, 8, device=device, requires_grad=True)
    loss = ops.linear_jsd_loss(h, w, h.detach(), w_t, torch.zeros(0, dtype=torch.long, device=device))
    loss.backward()
    assert loss.item() == 0 and h.grad.shape == (0, 8) and not w.grad.any()


def test_no_grad_and_second_backward(device):
    h_s, w_s, h_t, w_t, t, _, _ = _inputs(6, 8, 8, 50, torch.float32, device)
    with torch.no_grad():
        loss = ops.linear_jsd_loss(h_s, w_s, h_t, w_t, t, beta=0.2)
    ref = definition(h_s.double(), w_s.double(), h_t.double(), w_t.double(), t, None, None, 0.5, 0.5, 0.2, 1.0)
    assert_close(loss, ref, torch.float32)
    h = h_s.clone().requires_grad_(True)
    loss = ops.linear_jsd_loss(h, w_s, h_t, w_t, t)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph"):
        loss.backward()


def test_reference_matches_definition():
    inputs = _inputs(8, 16, 12, 70, torch.float32, "cpu", bias=True, ignored=(3,))
    doubles = [x.double() if x is not None and x.is_floating_point() else x for x in inputs]
    for beta in (0.0, 0.4, 1.0):
        with reference_mode():
            loss = ops.linear_jsd_loss(*inputs, beta=beta, temperature=2.0)
        ref = definition(*doubles, 0.5, 0.5, beta, 2.0)
        assert_close(loss, ref, torch.float32)
        z, y = torch.randn(3, 9).double(), torch.randn(3, 9).double()
        labels = torch.zeros(3, dtype=torch.long)
        assert_close(reference.generalized_jsd(z, y, beta, 2.0).mean(), trl_generalized_jsd(z, y, labels, beta, 2.0),
                     torch.float64)


def test_torch_compile_fullgraph(device):
    h_s, w_s, h_t, w_t, t, b_s, b_t = _inputs(6, 16, 8, 90, torch.float32, device, bias=True)
    leaves = [x.requires_grad_(True) for x in (h_s, w_s, b_s)]

    def step(h, w, b):
        return ops.linear_jsd_loss(h * 2.0, w, h_t, w_t, t, b, b_t, beta=0.3, chunk_size=4) * 3.0

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    out = compiled(*leaves)
    out.backward()
    grads = [x.grad.clone() for x in leaves]
    for x in leaves:
        x.grad = None
    eager = step(*leaves)
    eager.backward()
    assert_close(out, eager, torch.float32)
    for g, x in zip(grads, leaves):
        assert_close(g, x.grad, torch.float32)


def test_opcheck(device):
    from onepass.ops.distillation import _jsd_fwd

    h_s, w_s, h_t, w_t, t, b_s, b_t = _inputs(6, 8, 8, 70, torch.float32, device, bias=True)
    leaves = [x.requires_grad_(True) for x in (h_s, w_s, b_s)]
    torch.library.opcheck(_jsd_fwd, (leaves[0], leaves[1], h_t, w_t, t, leaves[2], b_t, 0.5, 0.5, 0.5, -100, 2.0,
                                     True, True, True, 4, torch.float32))


# ------------------------------------------------------------------------ bad input


def _call(**changes):
    def call(h_s, w_s, h_t, w_t, t):
        args = {"student_hidden": h_s, "student_weight": w_s, "teacher_hidden": h_t, "teacher_weight": w_t,
                "target": t}
        args.update({k: v(args) if callable(v) else v for k, v in changes.items()})
        return ops.linear_jsd_loss(**args)

    return call


@pytest.mark.parametrize("call, error, words", [
    (_call(student_weight=lambda a: a["student_weight"][:, :5]), ValueError, "student_weight"),
    (_call(teacher_weight=lambda a: a["teacher_weight"][:30]), ValueError, "vocabulary"),
    (_call(teacher_weight=lambda a: a["teacher_weight"].double()), TypeError, "teacher_weight"),
    (_call(teacher_hidden=lambda a: a["teacher_hidden"][:3]), ValueError, "teacher_hidden"),
    (_call(student_bias=lambda a: torch.randn(3, device=a["student_hidden"].device)), ValueError, "student_bias"),
    (_call(target=lambda a: a["target"][:2]), ValueError, "target"),
    (_call(target=lambda a: a["target"].float()), TypeError, "target"),
    (_call(teacher_hidden=lambda a: a["teacher_hidden"].to("meta")), ValueError, "device"),
    (_call(beta=1.5), ValueError, "beta"),
    (_call(beta=-0.1), ValueError, "beta"),
    (_call(temperature=0.0), ValueError, "temperature"),
    (_call(temperature=float("inf")), ValueError, "temperature"),
    (_call(weight_soft_loss=float("nan")), ValueError, "weight_soft_loss"),
    (_call(ignore_index=1.5), TypeError, "ignore_index"),
    (_call(chunk_size=0), ValueError, "chunk_size"),
    (_call(accum_dtype=torch.float16), TypeError, "accum_dtype"),
])
def test_bad_input_raises(call, error, words, device):
    h_s, w_s, h_t, w_t, t, _, _ = _inputs(4, 8, 6, 40, torch.float32, device)
    with pytest.raises(error, match=words):
        call(h_s, w_s, h_t, w_t, t)


def test_out_of_range_target_raises(device):
    if device == "cuda":
        pytest.skip("a device-side assert on CUDA (tested in a child process in test_cross_entropy.py)")
    h_s, w_s, h_t, w_t, t, _, _ = _inputs(4, 8, 6, 40, torch.float32, device)
    t[2] = 40
    with pytest.raises(ValueError, match="outside"):
        ops.linear_jsd_loss(h_s, w_s, h_t, w_t, t)


# ---------------------------------------------------------------- GPU, real sizes


@pytest.mark.gpu
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_gpu_bf16_llama_head(beta):
    """4096 tokens, hidden 2048 (teacher 3072), vocab 32000, bf16, against the float32 definition."""
    inputs = _inputs(4096, 2048, 3072, 32000, torch.bfloat16, "cuda", ignored=range(0, 4096, 7))
    h_s, w_s, h_t, w_t, t, _, _ = inputs
    leaves = [h_s.clone().requires_grad_(True), w_s.clone().requires_grad_(True)]
    loss = ops.linear_jsd_loss(leaves[0], leaves[1], h_t, w_t, t, beta=beta, temperature=2.0)
    loss.backward()
    floats = [x.float().requires_grad_(True) for x in (h_s, w_s)]
    ref = definition(floats[0], floats[1], h_t.float(), w_t.float(), t, None, None, 0.5, 0.5, beta, 2.0)
    ref.backward()
    assert_close(loss, ref, torch.bfloat16, "loss")
    for name, x, r in zip(("hidden", "weight"), leaves, floats):
        assert_close(x.grad, r.grad, torch.bfloat16, f"d{name}")


@pytest.mark.gpu
def test_gpu_peak_memory():
    """8192 tokens, hidden 2048, vocab 128256: neither head's full logits (2 GiB each in bf16) exist;
    the peak above the inputs is the gradients and the two chunk buffers (dW accumulated in bf16)."""
    from onepass.ops.linear_cross_entropy import chunk_tokens

    tokens, hidden, vocab = 8192, 2048, 128256
    h_s, w_s, h_t, w_t, t, _, _ = _inputs(tokens, hidden, hidden, vocab, torch.bfloat16, "cuda")
    h_s.requires_grad_(True)
    w_s.requires_grad_(True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = ops.linear_jsd_loss(h_s, w_s, h_t, w_t, t, beta=0.5)
    dh, dw = torch.autograd.grad(loss, (h_s, w_s))
    extra = torch.cuda.max_memory_allocated() - base
    grads = 2 * tokens * hidden + 2 * vocab * hidden  # dh, dw (bf16)
    budget = grads + 2 * chunk_tokens(tokens, torch.bfloat16, hidden) * vocab * 2
    budget = int(budget * 1.02) + 2**26  # per-token vectors, cuBLAS workspace
    assert extra <= budget, f"{extra / 2**30:.3f} GiB above the inputs, budget {budget / 2**30:.3f} GiB"
    assert torch.isfinite(loss) and dh.isfinite().all() and dw.isfinite().all()
