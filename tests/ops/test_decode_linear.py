import importlib

import pytest
import torch
import torch.nn.functional as F

from onepass import ops, reference
from onepass.testing import assert_close

decode_linear_module = importlib.import_module("onepass.ops.decode_linear")


def _weights(n_in, features, dtype, device, bias=True):
    weights = [torch.randn(n, n_in, dtype=dtype, device=device) / n_in**0.5 for n in features]
    biases = [torch.randn(n, dtype=dtype, device=device) if bias else None for n in features]
    return weights, biases


def _double(ts):
    return [t.double() if t is not None else None for t in ts]


def _check_linear(x, weights, biases, dtype, residual=None):
    with torch.no_grad():
        outs = ops.decode_linear(x, weights, biases, residual)
    refs = reference.decode_linear(x.double(), _double(weights), _double(biases) if biases else None,
                                   residual.double() if residual is not None else None)
    assert len(outs) == len(weights)
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert out.shape == (*x.shape[:-1], weights[i].shape[0]) and out.dtype == x.dtype and out.is_contiguous()
        assert_close(out, ref, dtype, f"output {i}")


# Interpreter tiles: 16 features x 64 inputs. Feature counts below, at and past a tile, inputs
# past one K block, 1 row to MAX_ROWS.
@pytest.mark.parametrize("rows, n_in, features", [
    ((1,), 64, (48, 16, 16)), ((2, 3), 100, (33, 7)), ((64,), 130, (64,)), ((1, 1), 16, (1, 5, 17)),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])  # bf16: the reference in the
def test_matches_f_linear(rows, n_in, features, dtype, device):                     # interpreter (its tl.dot fails)
    x = torch.randn(*rows, n_in, dtype=dtype, device=device)
    weights, biases = _weights(n_in, features, dtype, device)
    _check_linear(x, weights, biases, dtype)


def test_weights_as_any_iterable(device):
    x = torch.randn(2, 64, device=device)
    weights, _ = _weights(64, (16, 8), torch.float32, device)
    outs = ops.decode_linear(x, (w for w in weights))  # a generator was read twice: IndexError
    assert [o.shape[-1] for o in outs] == [16, 8]


def test_without_biases_and_with_some(device):
    x = torch.randn(3, 40, device=device)
    weights, biases = _weights(40, (24, 8, 8), torch.float32, device)
    _check_linear(x, weights, None, torch.float32)
    _check_linear(x, weights, [biases[0], None, biases[2]], torch.float32)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "gelu"])
@pytest.mark.parametrize("bias", [False, True])
def test_gated_matches_reference(activation, bias, device):
    x = torch.randn(5, 70, device=device)
    (gate, up), (gate_bias, up_bias) = _weights(70, (40, 40), torch.float32, device, bias)
    with torch.no_grad():
        out = ops.decode_gated_linear(x, gate, up, activation, gate_bias, up_bias)
    ref = reference.decode_gated_linear(x.double(), gate.double(), up.double(), activation,
                                        *_double([gate_bias, up_bias]))
    assert out.shape == (5, 40)
    assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("bias", [False, True])
def test_residual_added_before_the_store(bias, device):
    """One weight and a residual (down_proj and the add after it), the residual's rows strided."""
    x = torch.randn(3, 70, device=device)
    weights, biases = _weights(70, (40,), torch.float32, device, bias)
    residual = torch.randn(3, 56, device=device)[:, 8:48]
    _check_linear(x, weights, biases, torch.float32, residual)


@pytest.mark.parametrize("split_k", [2, 3])
def test_split_k_adds_the_splits_once(split_k, device, monkeypatch):
    """Split-K: each split's sums, added by the tile's last split (the bias, activation and
    residual once); twice in a row, since the last split zeroes the tile counters for the next."""
    monkeypatch.setattr(decode_linear_module, "_config", lambda *args: (16, 32, 4, 2, split_k))
    x = torch.randn(3, 150, device=device)  # 5 K blocks: the splits' K ranges differ in length
    weights, biases = _weights(150, (40, 8), torch.float32, device)
    residual = torch.randn(3, 40, device=device)
    for _ in range(2):
        _check_linear(x, weights, biases, torch.float32)
        assert all(not counts.any() for counts in decode_linear_module._split_counts.values())
        _check_linear(x, weights[:1], biases[:1], torch.float32, residual)
        with torch.no_grad():
            out = ops.decode_gated_linear(x, weights[0], weights[0], "silu", biases[0], biases[0])
        ref = reference.decode_gated_linear(x.double(), weights[0].double(), weights[0].double(), "silu",
                                            biases[0].double(), biases[0].double())
        assert_close(out, ref, torch.float32)


def test_strided_rows(device):
    """A row stride that is not the row length (a slice of a wider tensor)."""
    x = torch.randn(4, 96, device=device)[:, 16:80]
    weights, biases = _weights(64, (20, 12), torch.float32, device)
    _check_linear(x, weights, biases, torch.float32)


def test_strided_and_expanded_biases(device):
    """Biases that are a strided slice or an expanded scalar (stride 0): the kernel reads a
    bias at unit stride, so the launcher hands it a contiguous one."""
    x = torch.randn(2, 16, device=device)
    weights, _ = _weights(16, (4, 4), torch.float32, device)
    biases = [torch.randn(8, device=device)[::2], torch.randn(1, device=device).expand(4)]
    _check_linear(x, weights, biases, torch.float32)
    with torch.no_grad():
        out = ops.decode_gated_linear(x, *weights, "silu", *biases)
    ref = reference.decode_gated_linear(x.double(), *(w.double() for w in weights), "silu", *_double(biases))
    assert_close(out, ref, torch.float32)


def test_more_rows_than_the_kernel_takes_run_f_linear(device):
    x = torch.randn(decode_linear_module.MAX_ROWS + 1, 32, device=device)
    weights, biases = _weights(32, (16, 8), torch.float32, device)
    _check_linear(x, weights, biases, torch.float32)


def test_empty_inputs(device):
    weights, biases = _weights(16, (8, 4), torch.float32, device)
    with torch.no_grad():
        outs = ops.decode_linear(torch.randn(0, 16, device=device), weights, biases)
        no_inputs = ops.decode_linear(torch.randn(2, 0, device=device), [w[:, :0] for w in weights], biases)
    assert [tuple(o.shape) for o in outs] == [(0, 8), (0, 4)]
    for out, b in zip(no_inputs, biases):
        assert torch.equal(out, b.expand(2, -1))


def test_torch_compile_fullgraph_and_opcheck(device):
    from onepass.ops.decode_linear import _decode_linear

    x = torch.randn(3, 32, device=device)
    weights, biases = _weights(32, (16, 16), torch.float32, device)
    fn = torch.compile(lambda x: ops.decode_gated_linear(x, *weights) * 2, fullgraph=True,
                       backend="aot_eager" if device == "cpu" else "inductor")
    with torch.no_grad():
        assert_close(fn(x), 2 * ops.decode_gated_linear(x, *weights), torch.float32)
    torch.library.opcheck(_decode_linear, (x, weights, biases, -1))
    torch.library.opcheck(_decode_linear, (x, weights, [None, None], 0))
    torch.library.opcheck(_decode_linear, (x, weights[:1], biases[:1], -1, torch.randn(3, 16, device=device)))


@pytest.mark.parametrize("call, error, words", [
    (lambda x, w, b: ops.decode_linear(x, [w[0].half()]), TypeError, "dtype"),
    (lambda x, w, b: ops.decode_linear(x, [w[0][:, :5]]), ValueError, r"weights\[0\] must be"),
    (lambda x, w, b: ops.decode_linear(x, w * 2), ValueError, "1 to 3"),
    (lambda x, w, b: ops.decode_linear(x, w[0]), TypeError, "weights must be a list of tensors"),
    (lambda x, w, b: ops.decode_linear(x, w[:1], b[0]), TypeError, "biases must be a list of tensors"),
    (lambda x, w, b: ops.decode_linear(x, w, b[:1]), ValueError, "one per weight"),
    (lambda x, w, b: ops.decode_linear(x, w, [b[0][:3], None]), ValueError, r"biases\[0\]"),
    (lambda x, w, b: ops.decode_linear(x[0, 0, 0], w), ValueError, "at least one dimension"),
    (lambda x, w, b: ops.decode_linear(x.int(), w), TypeError, "x must be"),
    (lambda x, w, b: ops.decode_linear(x.requires_grad_(), w), ValueError, "inference only"),
    (lambda x, w, b: ops.decode_gated_linear(x, w[0], w[1], "relu"), ValueError, "activation"),
    (lambda x, w, b: ops.decode_gated_linear(x, w[0], w[1][:4]), ValueError, "up_weight"),
    (lambda x, w, b: ops.decode_linear(x, w, residual=x[..., :8]), ValueError, "exactly one weight"),
    (lambda x, w, b: ops.decode_linear(x, w[:1], residual=x), ValueError, "residual must be"),
    (lambda x, w, b: ops.decode_linear(x, w[:1], residual=x[..., :8].half()), ValueError, "residual must be"),
])
def test_bad_input_raises(call, error, words, device):
    x = torch.randn(2, 3, 24, device=device)
    weights, biases = _weights(24, (8, 8), torch.float32, device)
    with pytest.raises(error, match=words):
        call(x, weights, biases)


def test_gradient_mode_with_frozen_inputs_is_fine(device):
    """Grad mode on but nothing requires grad (inference without no_grad): the kernel runs."""
    x = torch.randn(2, 24, device=device)
    weights, biases = _weights(24, (8,), torch.float32, device)
    out, = ops.decode_linear(x, weights, biases)
    assert_close(out, F.linear(x.double(), weights[0].double(), biases[0].double()), torch.float32)


# ---------------------------------------------------------------- GPU, real sizes


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8, 32])
def test_gpu_bf16_llama_projections(rows):
    """Llama-3.1-8B's q/k/v (with Qwen2's biases), gate/up and down at decode sizes."""
    x = torch.randn(rows, 4096, dtype=torch.bfloat16, device="cuda")
    weights, biases = _weights(4096, (4096, 1024, 1024), torch.bfloat16, "cuda")
    _check_linear(x, weights, biases, torch.bfloat16)
    (gate, up), _ = _weights(4096, (14336, 14336), torch.bfloat16, "cuda", bias=False)
    with torch.no_grad():
        product = ops.decode_gated_linear(x, gate, up)
    assert_close(product, reference.decode_gated_linear(x.double(), gate.double(), up.double()), torch.bfloat16,
                 "gate/up")
    down, _ = _weights(14336, (4096,), torch.bfloat16, "cuda", bias=False)
    _check_linear(product, down, None, torch.bfloat16, residual=torch.randn_like(x))
    # Qwen2-1.5B's down_proj: few output tiles over a long input, K split (twice: the counters reset)
    small_down, _ = _weights(8960, (1536,), torch.bfloat16, "cuda", bias=False)
    assert decode_linear_module._config(x, 16, 8960, 1536, False)[-1] > 1
    x_down, residual = torch.randn(rows, 8960, dtype=torch.bfloat16, device="cuda"), torch.randn(rows, 1536).cuda()
    for _ in range(2):
        _check_linear(x_down, small_down, None, torch.bfloat16, residual=residual.bfloat16())
