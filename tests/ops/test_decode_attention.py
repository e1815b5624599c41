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
    (lambda q, k, v, s: ops.decode_attention(q[:, :0], k, v, s), ValueError, "positive multiple"),
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


def _rotary_tables(rows, n_tokens, head_dim, device, form):
    """Random rotary tables (each entry its own angle, so a kernel using the wrong partner fails) in the
    forms decode_attention takes: per sequence [B, Tq, D], shared [1, Tq, D] or 2-D [Tq, D]."""
    angles = torch.randn(rows if form == "per sequence" else 1, n_tokens, head_dim, device=device)
    cos, sin = angles.cos(), angles.sin()
    return (cos[0], sin[0]) if form == "2-D" else (cos, sin)


def _append_case(batch, kv_heads, n_tokens, lens, layout, tables, device, dtype=torch.float32, cache_len=40,
                 head_dim=16):
    q, k, v = _inputs(batch, 2 * kv_heads, kv_heads, n_tokens, cache_len, head_dim, dtype, device, layout)
    k_new, v_new, _ = _inputs(batch, kv_heads, kv_heads, n_tokens, n_tokens, head_dim, dtype, device, layout)
    cos, sin = _rotary_tables(batch, n_tokens, head_dim, device, tables) if tables else (None, None)
    return q, k, v, k_new, v_new, cos, sin, torch.tensor(lens, dtype=torch.int32, device=device)


def _append_and_attend_reference(q, k, v, seqlens, k_new, v_new, cos, sin, layout, **kw):
    """The append in float64 (reference.decode_append), then reference.decode_attention: (out, caches, count)."""
    k_ref, v_ref, count = k.double(), v.double(), torch.zeros(1, dtype=torch.int64)
    q_ref = reference.decode_append(q.double(), k_ref, v_ref, seqlens.cpu(), k_new.double(), v_new.double(),
                                    *((cos.double(), sin.double()) if cos is not None else (None, None)), count,
                                    layout)
    return reference.decode_attention(q_ref, k_ref, v_ref, seqlens, layout=layout, **kw), k_ref, v_ref, count


# lengths: a long one, one whose new tokens are its only keys, one at the cache's end
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("tables", [None, "per sequence", "shared", "2-D"])
@pytest.mark.parametrize("n_tokens, num_splits", [(1, 1), (1, 3), (2, 3)])
def test_append_then_attend(layout, tables, n_tokens, num_splits, chunks, device):
    """The new keys and values stored (rotated by the tables) at each sequence's last positions, the
    rest of the caches untouched, q rotated, the count advanced, and the output the reference's."""
    q, k, v, k_new, v_new, cos, sin, seqlens = _append_case(3, 2, n_tokens, [33, n_tokens, 40], layout, tables,
                                                            device)
    want, k_want, v_want, count_want = _append_and_attend_reference(q, k, v, seqlens, k_new, v_new, cos, sin, layout,
                                                                    scale=0.3)
    count = torch.full((1,), 5, dtype=torch.int64, device=device)
    out = ops.decode_attention(q, k, v, seqlens, 0.3, layout=layout, num_splits=num_splits, k_new=k_new,
                               v_new=v_new, cos=cos, sin=sin, cache_length=count)
    assert_close(out, want, torch.float32)
    assert_close(k, k_want, torch.float32, "k_cache")
    assert torch.equal(v.double(), v_want)  # (copied, not computed)
    assert count.item() == 5 + n_tokens and count_want.item() == n_tokens


@pytest.mark.parametrize("window", [None, 6])
def test_append_ragged_window_softcap_float16(window, chunks, device):
    """A ragged batch past a window, with softcap, in float16 at a head dim of 80 (padded tiles)."""
    q, k, v, k_new, v_new, cos, sin, seqlens = _append_case(4, 1, 1, [40, 1, 17, 7], "bhsd", "per sequence",
                                                            device, torch.float16, head_dim=80)
    want, k_want, v_want, _ = _append_and_attend_reference(q, k, v, seqlens, k_new, v_new, cos, sin, "bhsd",
                                                           window=window, softcap=2.0)
    out = ops.decode_attention(q, k, v, seqlens, softcap=2.0, window=window, num_splits=3, k_new=k_new,
                               v_new=v_new, cos=cos, sin=sin)
    assert_close(out, want, torch.float16)
    assert_close(k, k_want, torch.float16, "k_cache")
    assert torch.equal(v.double(), v_want)


def test_append_outside_the_cache_writes_nothing(device):
    """A length past the cache or shorter than the new tokens: the tokens with no position inside the
    cache are not written (2 new tokens and a length of 42 in a 40-position cache: nothing; of 1: only the
    second, at position 0)."""
    q, k, v, k_new, v_new, _, _, seqlens = _append_case(2, 2, 2, [42, 1], "bhsd", None, device)
    k_before, v_before = k.clone(), v.clone()
    ops.decode_attention(q, k, v, seqlens, num_splits=2, k_new=k_new, v_new=v_new)
    assert torch.equal(k[0], k_before[0]) and torch.equal(v[0], v_before[0])
    assert torch.equal(k[1, :, 0], k_new[1, :, 1]) and torch.equal(k[1, :, 1:], k_before[1, :, 1:])
    assert torch.equal(v[1, :, 0], v_new[1, :, 1])


def test_append_tables_of_different_strides(device):
    """cos expanded from one row to the batch (stride 0), sin a contiguous [B, Tq, D] of the same rows: each
    read at its own strides (the kernel reads both at one set: the launcher makes them agree)."""
    q, k, v, k_new, v_new, cos, sin, seqlens = _append_case(2, 2, 1, [33, 9], "bhsd", "shared", device)
    cos, sin = cos.expand(2, -1, -1), sin.expand(2, -1, -1).contiguous()
    want, k_want, _, _ = _append_and_attend_reference(q, k, v, seqlens, k_new, v_new, cos, sin, "bhsd")
    out = ops.decode_attention(q, k, v, seqlens, num_splits=2, k_new=k_new, v_new=v_new, cos=cos, sin=sin)
    assert_close(out, want, torch.float32)
    assert_close(k, k_want, torch.float32, "k_cache")


def test_append_with_no_sequence_advances_the_count(device):
    """An empty batch stores nothing and attends nothing; the count still advances by Tq (the reference's)."""
    q, k, v, k_new, v_new, _, _, _ = _append_case(1, 2, 2, [9], "bhsd", None, device)
    count = torch.zeros(1, dtype=torch.int64, device=device)
    out = ops.decode_attention(q[:0], k[:0], v[:0], torch.zeros(0, dtype=torch.int32, device=device),
                               k_new=k_new[:0], v_new=v_new[:0], cache_length=count)
    assert out.shape == q[:0].shape and count.item() == 2


def test_append_reference_path_matches_the_kernels(device):
    """Without the kernels (reference mode), the append and the output are the same."""
    from onepass.ops.dispatch import reference_mode

    case = _append_case(2, 2, 1, [33, 9], "bshd", "shared", device)
    q, k, v, k_new, v_new, cos, sin, seqlens = case
    k2, v2 = k.clone(), v.clone()
    count, count2 = torch.zeros(1, dtype=torch.int64, device=device), torch.zeros(1, dtype=torch.int64, device=device)
    out = ops.decode_attention(q, k, v, seqlens, layout="bshd", k_new=k_new, v_new=v_new, cos=cos, sin=sin,
                               cache_length=count)
    with reference_mode():
        out2 = ops.decode_attention(q, k2, v2, seqlens, layout="bshd", k_new=k_new, v_new=v_new, cos=cos, sin=sin,
                                    cache_length=count2)
    assert_close(out, out2, torch.float32)
    assert_close(k, k2, torch.float32, "k_cache")
    assert torch.equal(v, v2) and count.item() == count2.item() == 1


def test_append_torch_compile_and_opcheck(device):
    from onepass.ops.decode_attention import _decode_attention_append

    q, k, v, k_new, v_new, cos, sin, seqlens = _append_case(2, 2, 1, [24, 9], "bhsd", "per sequence", device)
    count = torch.zeros(1, dtype=torch.int64, device=device)
    k2, v2, count2 = k.clone(), v.clone(), count.clone()
    fn = torch.compile(lambda q, k, v: ops.decode_attention(q, k, v, seqlens, num_splits=2, k_new=k_new, v_new=v_new,
                                                            cos=cos, sin=sin, cache_length=count) * 2,
                       fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    out = fn(q, k, v)
    want = 2 * ops.decode_attention(q, k2, v2, seqlens, num_splits=2, k_new=k_new, v_new=v_new, cos=cos, sin=sin,
                                    cache_length=count2)
    assert_close(out, want, torch.float32)
    assert torch.equal(k, k2) and torch.equal(v, v2) and count.item() == count2.item() == 1
    torch.library.opcheck(_decode_attention_append,
                          (q, k, v, seqlens, k_new, v_new, cos, sin, count, 0.25, 0.0, "bhsd", 2, 0))
    torch.library.opcheck(_decode_attention_append,
                          (q, k, v, seqlens, k_new, v_new, None, None, None, 0.25, 0.0, "bhsd", 1, 5))


def _append_call(**kw):
    return lambda q, k, v, s: ops.decode_attention(q, k, v, s, **{"k_new": k[:, :, :1].clone(),
                                                                  "v_new": v[:, :, :1].clone(), **kw})


@pytest.mark.parametrize("call, error, words", [
    (lambda q, k, v, s: ops.decode_attention(q, k, v, s, k_new=k[:, :, :1]), ValueError, "come together"),
    (lambda q, k, v, s: ops.decode_attention(q, k, v, s, cos=q[0]), ValueError, "need them"),
    (_append_call(k_new=torch.zeros(2, 2, 2, 16)), ValueError, "k_new must be q's shape"),
    (_append_call(v_new=torch.zeros(2, 2, 1, 16, dtype=torch.float16)), TypeError, "v_new must have the caches' dtype"),
    (_append_call(cos=torch.zeros(1, 16)), ValueError, "cos and sin come together"),
    (_append_call(cos=torch.zeros(1, 8), sin=torch.zeros(1, 8)), ValueError, "the whole head"),
    (_append_call(cos=torch.zeros(3, 1, 16), sin=torch.zeros(3, 1, 16)), ValueError, "batch or 1"),
    (_append_call(cos=torch.zeros(1, 16), sin=torch.zeros(2, 1, 16)), ValueError, "one shape"),
    (_append_call(cache_length=torch.zeros(2, dtype=torch.int64)), TypeError, "one-element"),
    (_append_call(cache_length=torch.zeros(1)), TypeError, "int32 or int64"),
    (lambda q, k, v, s: _append_call(cache_length=s[:1])(q, k, v, s), ValueError, "share memory"),
    (lambda q, k, v, s: _append_call()(q, k.transpose(2, 3).contiguous().transpose(2, 3), v, s), ValueError,
     "unit last stride"),
])
def test_append_bad_input_raises(call, error, words, device):
    q, k, v = _inputs(2, 4, 2, 1, 32, 16, torch.float32, "cpu")
    with pytest.raises(error, match=words):
        call(q, k, v, torch.tensor([32, 5], dtype=torch.int32))


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


@pytest.mark.gpu
@pytest.mark.parametrize("n_tokens", [1, 2])
def test_gpu_bf16_append_real_sizes(n_tokens, chunks):
    """A Llama-3-8B-like decode step's append with RoPE (8 sequences, 32/8 heads, dim 128, 8k cache, ragged)."""
    lens = [8192, 1 + n_tokens, 5000, 4097, 300, 8000, 2, 6000]
    q, k, v, k_new, v_new, cos, sin, seqlens = _append_case(8, 8, n_tokens, lens, "bhsd", "per sequence", "cuda",
                                                            torch.bfloat16, cache_len=8192, head_dim=128)
    q = q.repeat_interleave(2, 1)  # 32 q heads
    want, k_want, _, _ = _append_and_attend_reference(q, k, v, seqlens, k_new, v_new, cos, sin, "bhsd")
    out = ops.decode_attention(q, k, v, seqlens, k_new=k_new, v_new=v_new, cos=cos, sin=sin)
    assert_close(out, want, torch.bfloat16)
    assert_close(k, k_want, torch.bfloat16, "k_cache")
