import importlib

import pytest
import torch

from onepass import ops, reference
from onepass.testing import assert_close


def _inputs(batch, heads, kv_heads, n_tokens, cache_len, head_dim, dtype, device, layout="bhsd"):
    def shape(h, s):
        return (batch, h, s, head_dim) if layout == "bhsd" else (batch, s, h, head_dim)

    return (torch.randn(shape(heads, n_tokens), dtype=dtype, device=device),
            torch.randn(shape(kv_heads, cache_len), dtype=dtype, device=device),
            torch.randn(shape(kv_heads, cache_len), dtype=dtype, device=device))


def _check(q, k, v, lens, dtype, **kw):
    seqlens = torch.tensor(lens, dtype=torch.int32, device=q.device)
    out = ops.decode_attention(q, k, v, seqlens, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    kw.pop("num_splits", None)
    ref = reference.decode_attention(q.double(), k.double(), v.double(), seqlens, **kw)
    assert_close(out, ref, dtype)
    return out


@pytest.fixture(params=["per sequence", "shared"])
def chunks(request, monkeypatch):
    """A sequence's keys in `splits` chunks, or the batch's chunks shared by positions (a ragged batch's long
    sequences take more: the kernel's plan where SHARED_MIN_CACHE positions are visible, here from any)."""
    if request.param == "shared":
        monkeypatch.setattr(importlib.import_module("onepass.ops.decode_attention"), "SHARED_MIN_CACHE", 0)
    return request.param


# The interpreter's key tile is 16: lengths 1, 16 + 1, one short of the cache, the full cache.
@pytest.mark.parametrize("num_splits", [None, 1, 3, 7])
def test_different_lengths_per_sequence(num_splits, chunks, device):
    q, k, v = _inputs(4, 8, 2, 1, 70, 32, torch.float32, device)
    _check(q, k, v, [70, 1, 17, 69], torch.float32, num_splits=num_splits)


@pytest.mark.parametrize("window", [None, 100])
def test_ragged_batch(window, chunks, device):
    """A ragged batch: one long sequence (past a window), short ones, an empty one, several
    splits and new tokens."""
    q, k, v = _inputs(8, 4, 2, 2, 320, 16, torch.float32, device)
    _check(q, k, v, [300, 1, 0, 2, 5, 1, 1, 17], torch.float32, num_splits=2, window=window)


@pytest.mark.parametrize("kv_heads", [1, 4])
def test_several_new_tokens_are_causal_among_themselves(kv_heads, chunks, device):
    q, k, v = _inputs(2, 4, kv_heads, 3, 50, 16, torch.float32, device)
    _check(q, k, v, [50, 20], torch.float32, num_splits=3)


def test_bshd_softcap_scale(device):
    q, k, v = _inputs(2, 8, 2, 2, 40, 16, torch.float32, device, layout="bshd")
    _check(q, k, v, [33, 40], torch.float32, layout="bshd", softcap=3.0, scale=0.5, num_splits=2)


def test_float16_padded_head_dim(device):
    q, k, v = _inputs(2, 4, 2, 1, 48, 80, torch.float16, device)
    _check(q, k, v, [48, 30], torch.float16, num_splits=2)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_empty_sequence_and_length_past_the_cache(num_splits, chunks, device):
    """Length 0: zero output; a length past the cache is clamped to it (no read out of bounds);
    with one split (the output written by the split kernel, no merge) and with two."""
    q, k, v = _inputs(2, 2, 1, 1, 20, 16, torch.float32, device)
    out = _check(q, k, v, [0, 20], torch.float32, num_splits=num_splits)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    past = ops.decode_attention(q, k, v, torch.tensor([0, 25], dtype=torch.int32, device=device),
                                num_splits=num_splits)
    assert torch.equal(past, out)
    # a negative length is taken as 0, by the kernel and by the reference alike (the reference
    # sliced [:-1] and attended to all but the last position)
    negative = torch.tensor([-1, 20], dtype=torch.int32, device=device)
    assert torch.equal(ops.decode_attention(q, k, v, negative, num_splits=num_splits), out)
    assert torch.equal(reference.decode_attention(q, k, v, negative)[0], torch.zeros_like(out[0]))


def _windowed_reference(q, k, v, lens, window, layout="bhsd", **kw):
    """Ground truth of a windowed decode: causal attention with the window over each sequence's
    valid cache, its new tokens last (reference.attention's bottom-right alignment)."""
    seq = 1 if layout == "bshd" else 2
    return torch.cat([reference.attention(q[b:b + 1].double(), k[b:b + 1].narrow(seq, 0, n).double(),
                                          v[b:b + 1].narrow(seq, 0, n).double(), causal=True, window=window,
                                          layout=layout, **kw)
                      for b, n in enumerate(lens)], 0)


# Lengths below, at and far past the window; num_splits 7 leaves some splits of the visible
# range empty, and None takes the default split of the visible range.
@pytest.mark.parametrize("window", [1, 6, 23, 200])
@pytest.mark.parametrize("num_splits", [None, 1, 3, 7])
def test_sliding_window(window, num_splits, chunks, device):
    q, k, v = _inputs(4, 8, 2, 1, 70, 32, torch.float32, device)
    lens = [70, 1, 17, 6]
    out = ops.decode_attention(q, k, v, torch.tensor(lens, dtype=torch.int32, device=device), window=window,
                               num_splits=num_splits)
    assert_close(out, _windowed_reference(q, k, v, lens, window), torch.float32)


@pytest.mark.parametrize("n_tokens", [1, 3])
def test_sliding_window_several_tokens_bshd_softcap(n_tokens, chunks, device):
    """Each new token has its own window (the first sees keys the last does not); softcap and a
    scale; the window ends inside a key tile and spans tiles."""
    q, k, v = _inputs(3, 4, 2, n_tokens, 64, 16, torch.float32, device, layout="bshd")
    lens, kw = [64, 40, 2], {"softcap": 3.0, "scale": 0.4}
    out = ops.decode_attention(q, k, v, torch.tensor(lens, dtype=torch.int32, device=device), layout="bshd",
                               window=19, num_splits=2, **kw)
    assert_close(out, _windowed_reference(q, k, v, lens, 19, layout="bshd", **kw), torch.float32)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_sliding_window_reference_path(layout):
    """Without the kernels (reference mode: reference.decode_attention), the window is applied the same way."""
    from onepass.ops.dispatch import reference_mode

    q, k, v = _inputs(2, 4, 2, 2, 30, 16, torch.float32, "cpu", layout=layout)
    lens = [30, 9]
    with reference_mode():
        out = ops.decode_attention(q, k, v, torch.tensor(lens, dtype=torch.int32), window=5, softcap=2.0,
                                   layout=layout)
    assert_close(out, _windowed_reference(q, k, v, lens, 5, layout=layout, softcap=2.0), torch.float32)


def test_matches_attention_on_the_cache(device):
    """One sequence, full cache: decode equals causal attention of the last Tq queries."""
    q, k, v = _inputs(1, 4, 2, 2, 37, 16, torch.float32, device)
    out = ops.decode_attention(q, k, v, torch.tensor([37], dtype=torch.int32, device=device), num_splits=3)
    assert_close(out, ops.attention(q, k, v, causal=True), torch.float32)


def test_default_splits_fill_at_most_two_programs_an_sm(monkeypatch):
    """On a 132-SM GPU: batch 1 of 8 kv heads gets 33 splits (16 for a 4k cache: 256 positions a
    split at least), of 2 kv heads splits of 64 positions (9 for 576 cached); batch 8 gets 4 (5
    would start a third, mostly idle wave), large batches 1. A split's fewest positions fall as
    the head dim grows (the values a split reads)."""
    import importlib

    decode = importlib.import_module("onepass.ops.decode_attention")
    monkeypatch.setattr(decode, "num_programs_for", lambda device: 132)
    cuda = torch.device("cuda")
    assert [decode.default_num_splits(cuda, 1, 8, n, 64) for n in (4096, 32768, 131072)] == [16, 33, 33]
    assert [decode.default_num_splits(cuda, 8, 8, n, 128) for n in (4096, 131072)] == [4, 4]
    assert decode.default_num_splits(cuda, 64, 8, 131072, 128) == 1
    assert decode.default_num_splits(cuda, 1, 8, 100, 128) == 1
    assert [decode.default_num_splits(cuda, 1, 2, n, 128) for n in (576, 4096)] == [9, 64]
    assert decode.default_num_splits(cuda, 1, 4, 576, 128) == 5  # 128 positions a split
    assert decode.default_num_splits(cuda, 1, 4, 576, 256) == 9  # 64 at head dim 256 (Gemma 2)


def test_torch_compile_fullgraph_and_opcheck(device):
    from onepass.ops.decode_attention import _decode_attention

    q, k, v = _inputs(2, 4, 2, 1, 24, 16, torch.float32, device)
    seqlens = torch.tensor([24, 9], dtype=torch.int32, device=device)
    fn = torch.compile(lambda q, k, v: ops.decode_attention(q, k, v, seqlens, num_splits=2) * 2, fullgraph=True,
                       backend="aot_eager" if device == "cpu" else "inductor")
    assert_close(fn(q, k, v), 2 * ops.decode_attention(q, k, v, seqlens, num_splits=2), torch.float32)
    torch.library.opcheck(_decode_attention, (q, k, v, seqlens, 0.25, 0.0, "bhsd", 2, 0))
    torch.library.opcheck(_decode_attention, (q, k, v, seqlens, 0.25, 0.0, "bhsd", 2, 5))


def test_strided_cache_seqlens(device):
    q, k, v = _inputs(2, 4, 2, 1, 24, 16, torch.float32, device)
    seqlens = torch.tensor([24, 0, 9, 0], dtype=torch.int32, device=device)[::2]  # [24, 9], stride 2
    assert torch.equal(ops.decode_attention(q, k, v, seqlens, num_splits=2),
                       ops.decode_attention(q, k, v, seqlens.contiguous(), num_splits=2))


@pytest.mark.parametrize("call, error, words", [
    (lambda q, k, v, s: ops.decode_attention(q, k.half(), v, s), TypeError, "dtype"),
    (lambda q, k, v, s: ops.decode_attention(q, torch.cat([k, k], 1), torch.cat([v, v], 1), s), ValueError,
     "multiple"),
    (lambda q, k, v, s: ops.decode_attention(q, k, v[:, :, :5], s), ValueError, "k_cache and v_cache"),
    (lambda q, k, v, s: ops.decode_attention(q[0], k, v, s), ValueError, "4-D"),
    (lambda q, k, v, s: ops.decode_attention(q, k, v, s.long()), TypeError, "cache_seqlens must be an int32.*int64"),
    (lambda q, k, v, s: ops.decode_attention(q, k, v, s.tolist()), TypeError,
     r"cache_seqlens must be an int32 torch.Tensor \[batch\].*got list"),
    (lambda q, k, v, s: ops.decode_attention(q, k, v, s[:1]), ValueError, r"cache_seqlens must have shape \(2,\)"),
    (lambda q, k, v, s: ops.decode_attention(q, k[..., :8], v[..., :8], s), ValueError, "head dim"),
    (lambda q, k, v, s: ops.decode_attention(q.expand(2, 6, 64, 16), k[:, :1], v[:, :1], s), ValueError,
     "at most"),
    (lambda q, k, v, s: ops.decode_attention(q, k, v, s, layout="bsd"), ValueError, "layout"),
    (lambda q, k, v, s: ops.decode_attention(q, k, v, s, softcap=0.0), ValueError, "softcap"),
    (lambda q, k, v, s: ops.decode_attention(q, k, v, s, num_splits=0), ValueError, "num_splits"),
    (lambda q, k, v, s: ops.decode_attention(q, k, v, s, num_splits=2.5), ValueError, "num_splits"),
    (lambda q, k, v, s: ops.decode_attention(q, k, v, s, scale=float("nan")), ValueError, "scale"),
    (lambda q, k, v, s: ops.decode_attention(q, k, v, s, window=0), ValueError, "window must be an int >= 1"),
    (lambda q, k, v, s: ops.decode_attention(q, k, v, s, window=4.0), ValueError, "window"),
    (lambda q, k, v, s: ops.decode_attention(q, k, v, s, window=(4, 0)), ValueError, "window"),
    (lambda q, k, v, s: ops.decode_attention(q, k, v, s, window=True), ValueError, "window"),
    (lambda q, k, v, s: ops.decode_attention(q, k, v, s, softcap=float("inf")), ValueError, "softcap"),
    (lambda q, k, v, s: ops.decode_attention(q.requires_grad_(), k, v, s), ValueError, "no autograd"),
])
def test_bad_input_raises(call, error, words, device):
    q, k, v = _inputs(2, 6, 2, 1, 32, 16, torch.float32, device)
    with pytest.raises(error, match=words):
        call(q, k, v, torch.tensor([32, 5], dtype=torch.int32, device=device))


# ---------------------------------------------------------------- GPU, real sizes


@pytest.mark.gpu
@pytest.mark.parametrize("batch, cache_len", [(1, 131072), (8, 32768)])
@pytest.mark.parametrize("n_tokens", [1, 4])
def test_gpu_bf16_real_sizes(batch, cache_len, n_tokens):
    q, k, v = _inputs(batch, 32, 8, n_tokens, cache_len, 128, torch.bfloat16, "cuda")
    lens = torch.randint(1, cache_len + 1, (batch,)).tolist()
    lens[0] = cache_len
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out = ops.decode_attention(q, k, v, seqlens)
    # the float64 reference one sequence at a time (its repeat_kv copies of a 128k cache are large)
    for b, n in enumerate(lens):
        ref = reference.attention(q[b:b + 1].double(), k[b:b + 1, :, :n].double(), v[b:b + 1, :, :n].double(),
                                  causal=True)
        assert_close(out[b:b + 1], ref, torch.bfloat16, f"sequence {b} (length {n})")


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 96, 256])
def test_gpu_bf16_head_dims(head_dim, chunks):
    q, k, v = _inputs(4, 16, 4, 1, 5000, head_dim, torch.bfloat16, "cuda", layout="bshd")
    _check(q, k, v, [5000, 1, 4097, 300], torch.bfloat16, layout="bshd")


@pytest.mark.gpu
def test_gpu_bf16_sliding_window_long_cache():
    """Gemma-2-like: a 4096 window in a 32k cache, lengths below and far past it; the default
    split covers the window only."""
    q, k, v = _inputs(4, 16, 8, 1, 32768, 128, torch.bfloat16, "cuda")
    lens = [32768, 4000, 4097, 20000]
    out = ops.decode_attention(q, k, v, torch.tensor(lens, dtype=torch.int32, device="cuda"), window=4096,
                               softcap=50.0)
    assert_close(out, _windowed_reference(q, k, v, lens, 4096, softcap=50.0), torch.bfloat16)
