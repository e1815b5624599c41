import importlib
import itertools

import pytest
import torch
import torch.nn.functional as F

from onepass import ops, reference
from onepass.ops.cross_entropy import CE_MAX_BLOCK
from onepass.testing import assert_close

ce = importlib.import_module("onepass.ops.cross_entropy")

# The interpreter runs inf arithmetic on the rows it skips (ignored targets): numpy warns.
pytestmark = [pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
REDUCTIONS = ["mean", "sum", "none"]
# (label_smoothing, z_loss, softcap): every combination of the three extras
EXTRAS = list(itertools.product([0.0, 0.1], [0.0, 1e-3], [None, 4.0]))


def _targets(shape, n_classes, device, ignored=(1,)):
    t = torch.randint(0, n_classes, shape, device=device)
    t.view(-1)[list(ignored)] = -100
    return t


def _check(logits, target, dtype, scale=1.0, **options):
    """Loss and d logits (for a random upstream gradient) against the float64 reference."""
    x = logits.detach().clone().requires_grad_(True)
    loss = ops.cross_entropy(x, target, **options)
    dloss = torch.randn_like(loss)
    loss.backward(dloss)
    xd = logits.detach().double().requires_grad_(True)
    ref = reference.cross_entropy(xd, target, **options)
    ref.backward(dloss.double())
    assert loss.dtype == logits.dtype and loss.shape == ref.shape
    assert_close(loss, ref, dtype, "loss", scale)
    assert_close(x.grad, xd.grad, dtype, "dlogits", scale)
    return x.grad


@pytest.mark.parametrize("label_smoothing, z_loss, softcap", EXTRAS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_every_option_matches_reference(reduction, label_smoothing, z_loss, softcap, device):
    logits = torch.randn(6, 300, device=device) * 3  # V = 300: not a multiple of any block
    target = _targets((6,), 300, device, ignored=(1, 4))
    _check(logits, target, torch.float32, reduction=reduction, label_smoothing=label_smoothing, z_loss=z_loss,
           softcap=softcap)


@pytest.mark.parametrize("rows, n_classes", [(16, 300), (16, 123), (6, 300)])
def test_scalar_upstream_gradient_on_regrouped_rows(rows, n_classes, device):
    """A scalar upstream gradient scales the saved gradient as one flat run of rows regrouped
    to a multiple of 16 elements where the row count allows (16 x 300 -> 4 x 1200, 16 x 123
    -> 1 x 1968), row by row where it does not (6 x 300)."""
    logits = torch.randn(rows, n_classes, device=device) * 3
    _check(logits, _targets((rows,), n_classes, device), torch.float32, reduction="sum")


@pytest.mark.parametrize("dtype", DTYPES)
def test_dtypes_and_class_dim_last(dtype, device):
    logits = (torch.randn(3, 5, 123, device=device) * 2).to(dtype)
    target = _targets((3, 5), 123, device, ignored=(0, 7))
    for reduction in REDUCTIONS:
        _check(logits, target, dtype, reduction=reduction, label_smoothing=0.05, z_loss=1e-3)


def test_rows_longer_than_one_block(device):
    v = CE_MAX_BLOCK + 77
    logits = torch.randn(3, v, device=device) * 4
    target = torch.tensor([5, v - 1, CE_MAX_BLOCK + 3], device=device)  # targets in both blocks
    _check(logits, target, torch.float32, reduction="sum", label_smoothing=0.1, z_loss=1e-3, softcap=10.0)


def test_reference_is_pytorchs_loss(device):
    x = torch.randn(6, 40, dtype=torch.float64)
    t = _targets((6,), 40, "cpu", ignored=(2,))
    for reduction in REDUCTIONS:
        expected = F.cross_entropy(x, t, reduction=reduction, label_smoothing=0.2)
        assert torch.allclose(reference.cross_entropy(x, t, reduction=reduction, label_smoothing=0.2), expected)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_all_targets_ignored_gives_what_pytorch_gives(reduction, device):
    logits = torch.randn(4, 50, device=device)
    target = torch.full((4,), -100, device=device)
    x = logits.clone().requires_grad_(True)
    loss = ops.cross_entropy(x, target, reduction=reduction, label_smoothing=0.1)
    loss.sum().backward()
    xt = logits.clone().requires_grad_(True)
    expected = F.cross_entropy(xt, target, reduction=reduction, label_smoothing=0.1)
    expected.sum().backward()
    assert torch.equal(loss.isnan(), expected.isnan())  # mean: 0 / 0
    assert torch.equal(torch.nan_to_num(loss), torch.nan_to_num(expected))
    assert torch.equal(x.grad, xt.grad)  # zeros


def test_custom_ignore_index_and_int32_targets(device):
    logits = torch.randn(5, 64, device=device)
    target = torch.randint(0, 64, (5,), device=device, dtype=torch.int32)
    target[3] = 7
    _check(logits, target, torch.float32, ignore_index=7, label_smoothing=0.1)


def test_lse_and_pred(device):
    logits = torch.randn(2, 3, 200, device=device) * 3
    target = _targets((2, 3), 200, device, ignored=(2,))  # ignored rows get lse and pred too
    for softcap in (None, 2.0):
        loss, lse, pred = ops.cross_entropy(logits, target, softcap=softcap, return_lse=True, return_pred=True)
        ref_lse, ref_pred = reference.logsumexp_argmax(logits.double(), softcap)
        assert lse.dtype == torch.float32 and pred.dtype == torch.int64 and pred.shape == (2, 3)
        assert_close(lse, ref_lse, torch.float32, "lse")
        assert torch.equal(pred, ref_pred)
    loss, lse, pred = ops.cross_entropy(logits, target, return_lse=True)
    assert pred is None and lse.shape == (2, 3)


def test_argmax_ties_pick_the_first_index(device):
    logits = torch.zeros(2, 100, device=device)
    logits[0, [17, 60, 99]] = 5.0
    logits[1, [3, 98]] = 2.0
    _, _, pred = ops.cross_entropy(logits, torch.tensor([0, 1], device=device), return_pred=True)
    assert pred.tolist() == [17, 3]


def test_argmax_and_lse_across_blocks(monkeypatch, device):
    monkeypatch.setattr(ce, "CE_MAX_BLOCK", 32)  # rows of 300: ten blocks
    logits = torch.randn(3, 300, device=device)
    logits[0, [17, 60, 299]] = 5.0  # ties in three blocks
    logits[1, [250, 251]] = 5.0  # in a late block only
    logits[2, 5] = 5.0  # in the first block only
    _, lse, pred = ops.cross_entropy(logits, torch.tensor([0, 1, 2], device=device), return_lse=True,
                                     return_pred=True)
    assert pred.tolist() == [17, 250, 5]
    assert_close(lse, reference.logsumexp_argmax(logits.double(), None)[0], torch.float32, "lse")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "row view", "row view, inplace_grad"])
def test_rows_not_aligned_to_16_bytes(dtype, layout, monkeypatch, device):
    """Rows of 301 logits start at every offset from a 16-byte boundary: each row's head,
    whole groups (in several blocks) and tail; a row view (stride 305) gives x and its
    gradient different strides, unless the gradient is written in place."""
    monkeypatch.setattr(ce, "CE_MAX_BLOCK", 64)
    monkeypatch.setattr(ce, "CE_MAX_BLOCK_NO_GRAD", 64)
    base = torch.randn(6, 305, device=device) * 3
    base[0, [150, 300]] = 40.0  # ties: the first one wins, in the groups or the tail
    base[1, [0, 300]] = 40.0
    base[2, 300] = 40.0
    base[3, [1, 2]] = 40.0
    logits = base.to(dtype)[:, :301]
    if layout == "contiguous":
        logits = logits.contiguous()
    target = torch.tensor([3, 300, 0, -100, 150, 7], device=device)
    _, lse, pred = ops.cross_entropy(logits, target, return_lse=True, return_pred=True)
    assert pred.tolist()[:4] == [150, 0, 300, 1]
    assert_close(lse, reference.logsumexp_argmax(logits.double(), None)[0], dtype, "lse")
    if "inplace" not in layout:
        _check(logits, target, dtype, reduction="sum", label_smoothing=0.1, softcap=30.0)
        return
    ref_in = logits.double().requires_grad_(True)
    reference.cross_entropy(ref_in, target, reduction="sum").backward()
    logits.requires_grad_(True)
    ops.cross_entropy(logits, target, reduction="sum", inplace_grad=True).backward()
    assert_close(logits.grad, ref_in.grad, dtype, "dlogits")


def test_non_contiguous_logits(device):
    logits = torch.randn(90, 7, device=device).t()  # [7, 90], stride (1, 7)
    _check(logits, _targets((7,), 90, device), torch.float32, label_smoothing=0.1)


def test_empty_batch(device):
    x = torch.randn(0, 10, device=device, requires_grad=True)
    t = torch.zeros(0, dtype=torch.long, device=device)
    assert ops.cross_entropy(x, t).isnan()  # the mean of nothing, as PyTorch
    assert ops.cross_entropy(x, t, reduction="none").shape == (0,)
    loss = ops.cross_entropy(x, t, reduction="sum")
    loss.backward()
    assert loss.item() == 0 and x.grad.shape == (0, 10)


def test_pred_of_all_minus_inf_rows_is_column_0(device):
    """As torch.argmax: a row whose every logit is -inf predicts 0, rows starting off the
    16-byte alignment included (41 columns: each row starts elsewhere in the group)."""
    x = torch.randn(3, 41, device=device)
    x[1:] = float("-inf")
    pred = ops.cross_entropy(x, torch.zeros(3, dtype=torch.long, device=device), reduction="none",
                             return_pred=True)[2]
    assert pred.tolist() == x.argmax(-1).tolist()


def test_pred_of_a_row_with_nan_is_its_first_nan(device):
    """As torch.argmax (NaN counts as the largest): the first NaN, before or after the
    maximum, in a later block of the row, or beside +inf; other rows unaffected."""
    x = torch.randn(5, 300, device=device)
    x[0, 7] = x[0, 200] = float("nan")
    x[1, 250] = float("nan")
    x[1, 3] = 50.0
    x[2, 9] = float("inf")
    x[2, 120] = float("nan")
    pred = ops.cross_entropy(x, torch.zeros(5, dtype=torch.long, device=device), reduction="none",
                             return_pred=True)[2]
    assert pred.tolist() == x.argmax(-1).tolist() == [7, 250, 120, *x[3:].argmax(-1).tolist()]


# --------------------------------------------------------------- gradient buffer


def test_logits_untouched_without_inplace_grad(device):
    logits = torch.randn(4, 77, device=device, requires_grad=True)
    before = logits.detach().clone()
    ops.cross_entropy(logits, _targets((4,), 77, device), z_loss=1e-3).backward()
    assert torch.equal(logits.detach(), before)


def test_inplace_grad_writes_the_gradient_over_the_logits(device):
    h = torch.randn(6, 120, device=device, requires_grad=True)
    target = _targets((6,), 120, device)
    logits = h * 2.0  # a non-leaf, as an LM head's output
    loss = ops.cross_entropy(logits, target, label_smoothing=0.1, softcap=5.0, inplace_grad=True)
    dloss = torch.tensor(0.7, device=device)
    loss.backward(dloss)
    hd = h.detach().double().requires_grad_(True)
    reference.cross_entropy(hd * 2.0, target, label_smoothing=0.1, softcap=5.0).backward(dloss.double())
    assert_close(h.grad, hd.grad, torch.float32, "dh")
    # the logits' storage now holds d loss / d logits = dh / 2: no [rows, V] buffer was allocated
    assert_close(logits.detach(), hd.grad / 2.0, torch.float32, "logits after backward")


def test_inplace_grad_needs_a_row_view(device):
    logits = torch.randn(90, 7, device=device, requires_grad=True)
    with pytest.raises(ValueError, match="inplace_grad"):
        ops.cross_entropy(logits.t(), _targets((7,), 90, device), inplace_grad=True)


def test_inplace_grad_refuses_rows_sharing_memory(device):
    """An expanded logits tensor views as [rows, V], but its rows are one row's memory: a row's
    gradient written over it would change what the next rows read."""
    row = torch.randn(1, 37, device=device, requires_grad=True)
    with pytest.raises(ValueError, match="share memory"):
        ops.cross_entropy((row * 1.0).expand(6, 37), _targets((6,), 37, device), inplace_grad=True)


def test_no_gradient_written_without_autograd(device):
    logits = torch.randn(4, 64, device=device, requires_grad=True)
    before = logits.detach().clone()
    with torch.no_grad():
        loss = ops.cross_entropy(logits, _targets((4,), 64, device), inplace_grad=True)
    assert torch.equal(logits.detach(), before) and loss.grad_fn is None


def test_second_backward_raises(device):
    logits = torch.randn(3, 40, device=device, requires_grad=True)
    loss = ops.cross_entropy(logits * 1.0, _targets((3,), 40, device))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph"):
        loss.backward()


# ------------------------------------------------------------- compile and opcheck


@pytest.mark.parametrize("inplace_grad", [False, True])
def test_torch_compile_fullgraph(inplace_grad, device):
    h = torch.randn(5, 96, device=device, requires_grad=True)
    target = _targets((5,), 96, device)

    def step(h, target):
        return ops.cross_entropy(h * 2.0, target, label_smoothing=0.1, z_loss=1e-3, inplace_grad=inplace_grad) * 3.0

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    out = compiled(h, target)
    out.backward()
    grad = h.grad.clone()
    h.grad = None
    eager = step(h, target)
    eager.backward()
    assert_close(out, eager, torch.float32)
    assert_close(grad, h.grad, torch.float32)


def test_opcheck(device):
    from onepass.ops.cross_entropy import _cross_entropy_fwd, _cross_entropy_fwd_inplace

    x = torch.randn(5, 70, device=device, requires_grad=True)
    t = _targets((5,), 70, device)
    for reduction in ("mean", "none"):
        torch.library.opcheck(_cross_entropy_fwd, (x, t, -100, reduction, 0.1, 1e-3, 4.0, True, True, True))
        torch.library.opcheck(_cross_entropy_fwd_inplace,
                              (x.detach().clone(), t, -100, reduction, 0.0, 0.0, None, False, False))


# ------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("bad", [-1, 64, -101])
def test_out_of_range_target_raises_and_writes_nothing(bad, device):
    if device == "cuda":
        pytest.skip("on CUDA the check is a device-side assert, which ends the process's CUDA context: "
                    "see test_gpu_out_of_range_target_fails_on_the_device")
    logits = torch.randn(4, 64, device=device, requires_grad=True)
    before = logits.detach().clone()
    target = torch.tensor([0, 5, bad, -100], device=device)
    y = logits * 1.0
    with pytest.raises(ValueError, match="outside"):
        ops.cross_entropy(y, target, inplace_grad=True)
    assert torch.equal(y.detach(), before)


@pytest.mark.parametrize("call, error, words", [
    (lambda x, t: ops.cross_entropy(x, t[:3]), ValueError, "target"),
    (lambda x, t: ops.cross_entropy(x, t.float()), TypeError, "target"),
    (lambda x, t: ops.cross_entropy(x.long(), t), TypeError, "logits"),
    (lambda x, t: ops.cross_entropy(x, t, reduction="avg"), ValueError, "reduction"),
    (lambda x, t: ops.cross_entropy(x, t, label_smoothing=1.5), ValueError, "label_smoothing"),
    (lambda x, t: ops.cross_entropy(x, t, z_loss=-1.0), ValueError, "z_loss"),
    (lambda x, t: ops.cross_entropy(x, t, softcap=0.0), ValueError, "softcap"),
    (lambda x, t: ops.cross_entropy(x, t, softcap=float("inf")), ValueError, "softcap"),
    (lambda x, t: ops.cross_entropy(x, t, z_loss=float("nan")), ValueError, "z_loss"),
    (lambda x, t: ops.cross_entropy(x[:, :0], t), ValueError, "class"),
    (lambda x, t: ops.cross_entropy(x, t.to("meta")), ValueError, "device"),
    (lambda x, t: ops.cross_entropy(x, t, ignore_index=True), TypeError, "ignore_index"),
])
def test_bad_input_raises(call, error, words, device):
    with pytest.raises(error, match=words):
        call(torch.randn(4, 64, device=device), torch.randint(0, 64, (4,), device=device))


# ---------------------------------------------------------------- GPU, real sizes


@pytest.mark.gpu
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_gpu_bf16_llama3_vocab(reduction):
    logits = (torch.randn(1024, 128256, device="cuda") * 4).to(torch.bfloat16)
    target = _targets((1024,), 128256, "cuda", ignored=range(0, 1024, 7))
    _check(logits, target, torch.bfloat16, reduction=reduction, label_smoothing=0.1, z_loss=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("inplace_grad", [False, True])
def test_gpu_memory_at_most_one_gradient(inplace_grad):
    rows, vocab = 4096, 128256
    h = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, vocab, (rows,), device="cuda")
    grad_bytes = rows * vocab * 2
    logits = h * 1.0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = ops.cross_entropy(logits, target, inplace_grad=inplace_grad)
    (dlogits,) = torch.autograd.grad(loss, logits)
    extra = torch.cuda.max_memory_allocated() - base
    # the gradient buffer (none in place) + per-row float32 vectors and slack
    budget = (0 if inplace_grad else grad_bytes) + 64 * rows + 2**20
    assert extra <= budget, f"{extra / 2**20:.1f} MiB above the inputs, budget {budget / 2**20:.1f} MiB"
    assert (dlogits.data_ptr() == logits.data_ptr()) == inplace_grad


@pytest.mark.gpu
def test_gpu_out_of_range_target_fails_on_the_device():
    """No host sync: the error surfaces at the next synchronisation (in a child process,
    since a device-side assert ends the CUDA context)."""
    import subprocess
    import sys

    code = ("import torch; from onepass import ops\n"
            "x = torch.randn(8, 1000, device='cuda')\n"
            "t = torch.full((8,), 3, device='cuda'); t[5] = 1000\n"
            "loss = ops.cross_entropy(x, t)\n"
            "torch.cuda.synchronize()\n"
            "print('NO ERROR', loss.item())\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "NO ERROR" not in run.stdout, run.stdout + run.stderr
    assert "assert" in run.stderr.lower(), run.stderr[-2000:]
