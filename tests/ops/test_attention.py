import sys

import pytest
import torch

from onepass import ops, reference
from onepass.testing import assert_close

# The interpreter's tiles are 32 queries x 16 keys (16 x 32 in the dK/dV kernel), so 33
# is one more than a block on both sides and 17 one more than the small one.


def _qkv(shape_q, shape_kv, dtype, device):
    return (torch.randn(shape_q, dtype=dtype, device=device), torch.randn(shape_kv, dtype=dtype, device=device),
            torch.randn(shape_kv, dtype=dtype, device=device))


def _check(q, k, v, dtype, use_lse=False, scale=1.0, **kw):
    """Output, LSE and every gradient against the float64 reference (same dO, same dLSE)."""
    for t in (q, k, v):
        t.requires_grad_(True)
    o, lse = ops.attention(q, k, v, return_lse=True, **kw)
    assert o.shape == q.shape and o.dtype == q.dtype and lse.dtype == torch.float32
    do = torch.randn_like(o)
    finite = torch.isfinite(lse.detach())
    dlse = torch.randn_like(lse) * finite if use_lse else None  # no gradient into -inf entries
    torch.autograd.backward([o, lse] if use_lse else [o], [do, dlse] if use_lse else [do])
    qd, kd, vd = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    ro, rlse = reference.attention(qd, kd, vd, return_lse=True, **kw)
    torch.autograd.backward([ro, rlse] if use_lse else [ro], [do.double(), dlse.double()] if use_lse else [do.double()])
    assert_close(o, ro, dtype, "output", scale)
    assert torch.equal(finite, torch.isfinite(rlse)), "queries that see no key must get LSE -inf"
    assert_close(lse[finite], rlse[finite], dtype, "lse", scale)
    # a gradient that cancels to zero (one key: dk = 0) is measured against dO's scale
    floor = 0.1 * do.double().norm().item()
    for name, t, d in (("dq", q, qd), ("dk", k, kd), ("dv", v, vd)):
        assert t.grad is not None and t.grad.dtype == t.dtype and t.grad.shape == t.shape, name
        assert_close(t.grad, d.grad, dtype, name, scale, floor)


FEATURES = {
    "full": dict(),
    "causal": dict(causal=True),
    "gqa_causal": dict(kv_heads=2, causal=True),
    "mqa": dict(kv_heads=1),
    "window_causal": dict(causal=True, window=8),
    "window_left_right": dict(window=(5, 20)),
    "softcap_causal": dict(causal=True, softcap=2.0),
    "gqa_window_softcap_causal": dict(kv_heads=1, causal=True, window=(17, None), softcap=5.0),
}


@pytest.mark.parametrize("feature", FEATURES)
def test_features_match_reference(feature, device):
    kw = dict(FEATURES[feature])
    kv_heads = kw.pop("kv_heads", 4)
    q, k, v = _qkv((1, 4, 33, 16), (1, kv_heads, 33, 16), torch.float32, device)
    _check(q, k, v, torch.float32, **kw)


@pytest.mark.parametrize("sq, sk", [(1, 1), (1, 37), (17, 65), (65, 17), (80, 80)])
@pytest.mark.parametrize("causal", [False, True])
def test_sequence_lengths(sq, sk, causal, device):
    """Bottom-right causal: with S_q > S_k the first S_q - S_k queries see nothing (zero output)."""
    q, k, v = _qkv((2, 2, sq, 32), (2, 1, sk, 32), torch.float32, device)
    _check(q, k, v, torch.float32, causal=causal)


# 160 pads to 256: dK and dV in two passes (attention.dkdv_kernels)
@pytest.mark.parametrize("head_dim, kw", [(32, dict(causal=True, window=12)), (80, dict()), (24, dict(softcap=3.0)),
                                          (160, dict(causal=True, window=12, softcap=3.0))])
def test_float16_and_padded_head_dims(head_dim, kw, device):
    q, k, v = _qkv((1, 4, 40, head_dim), (1, 2, 40, head_dim), torch.float16, device)
    _check(q, k, v, torch.float16, **kw)


def test_gradient_through_lse_and_scale(device):
    q, k, v = _qkv((1, 2, 33, 16), (1, 2, 50, 16), torch.float32, device)
    _check(q, k, v, torch.float32, use_lse=True, causal=True, scale=0.3)


def test_bshd_and_non_contiguous(device):
    q = torch.randn(2, 40, 3, 2, 16, device=device)[:, :, :, 0]  # [B, S, H=3, D], strided heads
    k = torch.randn(2, 3, 40, 16, device=device).transpose(1, 2)[:, :, :1]  # [B, S, 1, D] from bhsd storage
    v = torch.randn(2, 40, 1, 32, device=device)[..., ::2]  # head dim stride 2: copied
    assert not q.is_contiguous() and not k.is_contiguous() and v.stride(-1) == 2
    _check(q, k, v, torch.float32, causal=True, layout="bshd")


@pytest.mark.parametrize("kw", [dict(causal=True), dict(window=6, softcap=4.0)])
def test_varlen_packed_sequences(kw, device):
    lens = [5, 33, 1, 20]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    q, k, v = _qkv((59, 4, 16), (59, 2, 16), torch.float32, device)
    _check(q, k, v, torch.float32, use_lse=True, layout="bshd", cu_seqlens=cu, **kw)


def test_varlen_reads_strided_cu_seqlens(device):
    cu = torch.tensor([0, 99, 17, 99, 57, 99], dtype=torch.int32, device=device)[::2]  # [0, 17, 57], stride 2
    q, k, v = _qkv((57, 2, 16), (57, 2, 16), torch.float32, device)
    assert torch.equal(ops.attention(q, k, v, causal=True, layout="bshd", cu_seqlens=cu),
                       ops.attention(q, k, v, causal=True, layout="bshd", cu_seqlens=cu.contiguous()))


def test_varlen_equals_separate_calls(device):
    lens = [17, 40]
    cu = torch.tensor([0, 17, 57], dtype=torch.int32, device=device)
    q, k, v = _qkv((57, 2, 16), (57, 2, 16), torch.float32, device)
    packed = ops.attention(q, k, v, causal=True, layout="bshd", cu_seqlens=cu)
    start = 0
    for n in lens:
        one = ops.attention(*(t[None, start:start + n] for t in (q, k, v)), causal=True, layout="bshd")
        assert_close(packed[start:start + n], one[0], torch.float32)
        start += n


@pytest.mark.parametrize("shape_q, shape_kv", [((0, 2, 8, 16), (0, 2, 8, 16)), ((1, 2, 0, 16), (1, 2, 8, 16)),
                                               ((1, 2, 5, 16), (1, 2, 0, 16))])
def test_empty(shape_q, shape_kv, device):
    q, k, v = (t.requires_grad_(True) for t in _qkv(shape_q, shape_kv, torch.float32, device))
    o = ops.attention(q, k, v)
    assert o.shape == q.shape
    assert torch.equal(o, torch.zeros_like(o))  # no key: zero output
    o.sum().backward()
    for t in (q, k, v):
        assert torch.equal(t.grad, torch.zeros_like(t))


def test_int64_offsets_path(device, monkeypatch):
    """The int64 tile offsets used when a sequence spans 2**31 elements (forced here on small inputs)."""
    import sys

    monkeypatch.setattr(sys.modules["onepass.ops.attention"]._Geometry, "long_offsets", lambda self, *t: True)
    q, k, v = _qkv((1, 2, 33, 16), (1, 1, 33, 16), torch.float32, device)
    _check(q, k, v, torch.float32, causal=True, window=20)


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("l2_bytes", [0, 2**40])
def test_program_order_in_head_chunks(l2_bytes, causal, varlen, device, monkeypatch):
    """Programs in the smallest chunks of heads (causal: a shorter last one) or in one chunk of all."""
    import sys

    monkeypatch.setattr(sys.modules["onepass.ops.attention"], "L2_CHUNK_BYTES", l2_bytes)
    if varlen:
        cu = torch.tensor([0, 5, 38, 39, 59], dtype=torch.int32, device=device)
        q, k, v = _qkv((59, 5, 16), (59, 5, 16), torch.float32, device)
        _check(q, k, v, torch.float32, causal=causal, layout="bshd", cu_seqlens=cu)
    else:
        q, k, v = _qkv((2, 5, 33, 16), (2, 5, 33, 16), torch.float32, device)
        _check(q, k, v, torch.float32, causal=causal)


def test_torch_compile_fullgraph(device):
    """Also with a scale that changes between calls, which the recompile traces as a
    symbolic float (a graph break in the checks before)."""
    q, k, v = (t.requires_grad_(True) for t in _qkv((1, 4, 20, 16), (1, 2, 20, 16), torch.float32, device))

    def block(q, k, v, scale):
        o, lse = ops.attention(q, k, v, causal=True, window=9, scale=scale, return_lse=True)
        return o * 2 + lse[..., None]

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    for scale in (0.25, 0.125):
        out = compiled(q, k, v, scale)
        out.sum().backward()
        grads = [t.grad.clone() for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
        eager = block(q, k, v, scale)
        eager.sum().backward()
        assert_close(out, eager, torch.float32)
        for g, t in zip(grads, (q, k, v)):
            assert_close(g, t.grad, torch.float32)
            t.grad = None


def test_opcheck(device):
    from onepass.ops.attention import _attention_fwd

    q, k, v = (t.requires_grad_(True) for t in _qkv((1, 2, 17, 16), (1, 1, 17, 16), torch.float32, device))
    cu = torch.tensor([0, 7, 17], dtype=torch.int32, device=device)
    for args in [(q, k, v, None, 0.25, -1, 0, 0.0, "bhsd"),
                 (q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, 0.25, 4, 0, 2.0, "bshd")]:
        torch.library.opcheck(_attention_fwd, args)


@pytest.mark.parametrize("offsets", [[0, 4, 8], [0, 4, 12], [1, 4, 10], [0, 6, 4, 10]])
def test_cu_seqlens_that_do_not_cover_the_rows_raise(offsets):
    """On the CPU (read without a sync) offsets must go from 0 to the total without
    decreasing; before, the rows they missed came back unwritten."""
    q = torch.randn(10, 2, 16)
    with pytest.raises(ValueError, match="cu_seqlens"):
        ops.attention(q, q, q, layout="bshd", cu_seqlens=torch.tensor(offsets, dtype=torch.int32))


@pytest.mark.parametrize("call, error, words", [
    (lambda q, k, v: ops.attention(q, k.half(), v), TypeError, "dtype"),
    (lambda q, k, v: ops.attention(q.long(), k, v), TypeError, "q"),
    (lambda q, k, v: ops.attention(q, k[:, :3], v[:, :3]), ValueError, "multiple"),
    (lambda q, k, v: ops.attention(q, k, v[:, :, :5]), ValueError, "k and v"),
    (lambda q, k, v: ops.attention(q[0], k[0], v[0]), ValueError, "4-D"),
    (lambda q, k, v: ops.attention(q, k[..., :8], v[..., :8]), ValueError, "head dim"),
    (lambda q, k, v: ops.attention(q, k[:1], v[:1]), ValueError, "batch"),
    (lambda q, k, v: ops.attention(q, k, v, layout="sbhd"), ValueError, "layout"),
    (lambda q, k, v: ops.attention(q, k, v, softcap=-1.0), ValueError, "softcap"),
    (lambda q, k, v: ops.attention(q, k, v, softcap=float("inf")), ValueError, "softcap"),
    (lambda q, k, v: ops.attention(q, k, v, window=0), ValueError, "window"),
    (lambda q, k, v: ops.attention(q, k, v, window=(1, 2, 3)), ValueError, "window"),
    (lambda q, k, v: ops.attention(q, k, v, window=(3,)), ValueError, "window"),
    (lambda q, k, v: ops.attention(q, k, v, window=2.5), ValueError, "window"),
    (lambda q, k, v: ops.attention(q, k, v, window=True), ValueError, "window"),
    (lambda q, k, v: ops.attention(q[0], k[0], v[0], layout="bshd",
                                   cu_seqlens=torch.tensor([0, 4], device=q.device)), ValueError, "int32"),
    (lambda q, k, v: ops.attention(q, k, v, layout="bshd", cu_seqlens=torch.tensor([0, 4], dtype=torch.int32,
                                                                                   device=q.device)),
     ValueError, "packed"),
    (lambda q, k, v: ops.attention(*(torch.randn(1, 1, 4, 300, device=q.device) for _ in range(3))),
     ValueError, "head dim"),
    (lambda q, k, v: ops.attention(q, k.to("meta"), v), ValueError, "device"),
])
def test_bad_input_raises(call, error, words, device):
    q, k, v = _qkv((2, 4, 8, 16), (2, 4, 8, 16), torch.float32, device)
    with pytest.raises(error, match=words):
        call(q, k, v)


@pytest.mark.parametrize("head_dim", [32, 80, 160])  # rows 64 and 128 (DQ_TMA_ROWS), 256 (FWD_TMA_ROWS); padded
def test_tensor_descriptor_loads_match_pointer_tiles(head_dim, device, monkeypatch):
    """K and V through tensor descriptors (TMA, zeros past the edges) give the pointer tiles' results bit for bit,
    at a padded head dim, a window and a softcap, in both kernels that stream them."""
    attention_module = sys.modules["onepass.ops.attention"]
    q, k, v = _qkv((2, 4, 45, head_dim), (2, 2, 45, head_dim), torch.float16, device)
    taken = []
    real = attention_module.kv_descriptors

    def recorded(*args):
        descriptors = real(*args)
        taken.append(descriptors is not None)
        return descriptors

    monkeypatch.setattr(attention_module, "kv_descriptors", recorded)
    monkeypatch.setattr(attention_module, "TMA_MIN_FLOPS", 0)
    results = []
    for rows in ({64, 128, 256}, set()):
        monkeypatch.setattr(attention_module, "FWD_TMA_ROWS", rows)
        monkeypatch.setattr(attention_module, "DQ_TMA_ROWS", rows)
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        o = ops.attention(*leaves, causal=True, window=9, softcap=3.0)
        o.backward(torch.ones_like(o))
        results.append([o.detach(), *(t.grad for t in leaves)])
    assert taken == [True, True, False, False]  # forward and dQ through descriptors, then neither
    for name, a, b in zip(("o", "dq", "dk", "dv"), *results):
        assert torch.equal(a, b), name


def test_tensor_descriptors_only_where_tma_can_load(device, monkeypatch):
    """Pointer tiles for head dims off the rule, calls under TMA_MIN_FLOPS, fp32, varlen, a traced call, and a
    tensor TMA cannot address (not 16-byte aligned, an expanded dim); descriptors otherwise."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    attention_module = sys.modules["onepass.ops.attention"]

    def descriptors(k, cu_seqlens=None, layout="bhsd", v=None, head_dims=(64,), before=-1):
        g = attention_module._Geometry(k, k, layout, cu_seqlens)
        return attention_module.kv_descriptors(g, (k, k if v is None else v), 16, set(head_dims), before, 0)

    k = torch.randn(1, 2, 40, 32, dtype=torch.float16, device=device)
    assert descriptors(k) is None  # 4 * 2 * 40 * 40 / 2 * 32 FLOPs (causal): the descriptors' host time would not pay
    monkeypatch.setattr(attention_module, "TMA_MIN_FLOPS", 4 * 2 * 40 * 40 / 2 * 32)
    assert descriptors(k) is not None
    assert descriptors(k, before=9) is None  # a window of 10 keys a query: a quarter of the causal count
    assert descriptors(k.float()) is None
    assert descriptors(torch.randn(2 * 40 * 32 + 1, dtype=torch.float16, device=device)[1:].view(1, 2, 40, 32)) is None
    assert descriptors(torch.randn(1, 2, 40, 40, dtype=torch.float16, device=device)[..., :32]) is not None
    assert descriptors(torch.randn(1, 2, 40, 36, dtype=torch.float16, device=device)[..., :32]) is None  # 72-byte rows
    assert descriptors(k, head_dims=(128,)) is None
    assert descriptors(k, v=torch.randn(1, 2, 40, 36, dtype=torch.float16, device=device)[..., :32]) is None
    assert descriptors(torch.randn(1, 1, 40, 32, dtype=torch.float16, device=device).expand(1, 2, 40, 32)) is None
    packed = torch.randn(40, 2, 32, dtype=torch.float16, device=device)
    cu = torch.tensor([0, 15, 40], dtype=torch.int32, device=device)
    assert descriptors(packed, cu, "bshd") is None
    with FakeTensorMode() as mode:
        assert descriptors(mode.from_tensor(k)) is None


def test_hopper_forward_only_where_it_covers(device, monkeypatch):
    """Which calls take the Gluon forward (attention_hopper; its launch recorded here, as on a Hopper GPU): head dim 128
    or 64, full, causal or a causal window (at head dim 64 of at least GLUON_MIN_WINDOW keys), whole 128-row tiles,
    bhsd or bshd memory, k and v alike, softcap or not; not a window reaching keys after the query,
    varlen, fp32, a padded or other head dim, a part tile, more keys than queries, an expanded or
    odd-strided k, unlike k and v, or a call under TMA_MIN_FLOPS. The others launch the portable kernel."""
    attention_module = sys.modules["onepass.ops.attention"]
    hopper = pytest.importorskip("onepass.ops.attention_hopper")
    taken = []
    monkeypatch.setattr(attention_module, "_on_hopper", lambda t: True)
    monkeypatch.setattr(attention_module, "launch", lambda *args, **meta: taken.append("portable"))
    monkeypatch.setattr(hopper, "launch", lambda *args, **meta: taken.append("hopper"))

    def route(q, k, v=None, **kw):
        taken.clear()
        ops.attention(q, k, k if v is None else v, **kw)
        return taken[0]

    def t(*shape, dtype=torch.float16):
        return torch.zeros(shape, dtype=dtype, device=device)

    q, k = t(1, 4, 256, 128), t(1, 2, 256, 128)
    assert route(q, k) == "portable"  # 4 * 4 * 256 * 256 * 128 FLOPs: under TMA_MIN_FLOPS
    monkeypatch.setattr(attention_module, "TMA_MIN_FLOPS", 0)
    assert route(q, k) == route(q, k, causal=True) == route(t(1, 4, 256, 64), t(1, 2, 256, 64)) == "hopper"
    bshd_q, bshd_k = t(1, 256, 4, 128), t(1, 256, 2, 128)
    assert route(bshd_q, bshd_k, layout="bshd") == "hopper"
    assert route(bshd_q.transpose(1, 2), bshd_k.transpose(1, 2)) == "hopper"  # bshd memory, bhsd views
    qkv = t(2, 256, 8 * 128)  # a fused projection's slices
    assert route(*(qkv[..., a:b].view(2, 256, -1, 128) for a, b in ((0, 512), (512, 768), (768, 1024))),
                 layout="bshd") == "hopper"
    assert route(q, t(1, 2, 256, 144)[..., :128]) == "hopper"  # rows 288 bytes apart
    for call in (dict(causal=True, window=64), dict(window=(3, 0)), dict(causal=True, scale=0.5), dict(softcap=30.0),
                 dict(causal=True, window=64, softcap=30.0)):
        assert route(q, k, **call) == "hopper", call
    for call in (dict(window=64), dict(window=(3, 2))):
        assert route(q, k, **call) == "portable", call
    q64, k64 = q[..., :64], k[..., :64]
    assert route(q64, k64, causal=True) == route(q64, k64, causal=True, window=hopper.GLUON_MIN_WINDOW[64]) == "hopper"
    assert route(q64, k64, causal=True, window=hopper.GLUON_MIN_WINDOW[64] - 1) == "portable"
    assert route(t(1, 4, 256, 80), t(1, 2, 256, 80)) == "portable"
    assert route(t(1, 4, 256, 128, dtype=torch.float32), t(1, 2, 256, 128, dtype=torch.float32)) == "portable"
    assert route(q[:, :, :200], k[:, :, :200]) == "portable"  # a part tile
    assert route(q[:, :, :128], k) == "portable"  # more keys than queries
    assert route(q, t(1, 1, 256, 128).expand(1, 2, 256, 128)) == "portable"
    assert route(q, t(1, 2, 256, 132)[..., :128]) == "portable"  # rows 264 bytes apart: TMA needs 16-byte steps
    assert route(q, k, bshd_k.transpose(1, 2)) == "portable"  # k and v laid out differently
    packed = t(256, 4, 128)
    cu = torch.tensor([0, 128, 256], dtype=torch.int32, device=device)
    assert route(packed, t(256, 2, 128), layout="bshd", cu_seqlens=cu) == "portable"


def test_hopper_forward_programs(device, monkeypatch):
    """The Gluon forward's programs: one an SM (num_programs_for) looping over work items where an item's mean key
    tiles are at most PERSISTENT_TILES or two Q buffers fit (head dim 64); else one a work item."""
    attention_module = sys.modules["onepass.ops.attention"]
    hopper = pytest.importorskip("onepass.ops.attention_hopper")
    grids = []
    monkeypatch.setattr(attention_module, "_on_hopper", lambda t: True)
    monkeypatch.setattr(attention_module, "TMA_MIN_FLOPS", 0)
    monkeypatch.setattr(hopper, "num_programs_for", lambda device: 4)  # an SM count
    monkeypatch.setattr(hopper, "launch", lambda kernel, grid, *args, **meta: grids.append(grid))

    def programs(seqlen, head_dim, causal, window=None):
        grids.clear()
        q = torch.zeros(1, 4, seqlen, head_dim, dtype=torch.float16, device=device)
        ops.attention(q, q[:, :2], q[:, :2], causal=causal, window=window)
        return grids[0]

    assert programs(256, 128, True) == (4, )  # 8 items of 1.5 key tiles
    assert programs(2048, 128, False) == (4, )  # 64 items of 16 tiles
    assert programs(4096, 128, True) == programs(4096, 128, False) == (4, )  # 128 items of 16.5 and of 32 tiles
    assert programs(8192, 128, True) == (256, )  # 256 items of 32.5 tiles: one a program
    assert programs(4096, 128, True, window=512) == (4, )  # at most 6 tiles an item
    assert programs(8192, 128, True, window=4096) == (256, )  # 33
    assert programs(4096, 64, False) == programs(4096, 64, True) == (4, )  # head dim 64: two Q buffers


def test_hopper_backward_only_where_it_covers(device, monkeypatch):
    """Which backward calls take the Gluon kernels (their launches recorded, as on a Hopper GPU): at least
    GLUON_BWD_MIN_FLOPS, after either forward; head dim 128 full or causal, a causal window, a softcap, grouped-query
    heads, bhsd or bshd memory, fused q/k/v slices, a gradient into the LSE, head dim 64 on a small grid; not head dim
    64 on a larger one, a window reaching keys after the query, a part tile, or a dO whose rows TMA cannot address.
    The others launch the portable ones."""
    attention_module = sys.modules["onepass.ops.attention"]
    hopper = pytest.importorskip("onepass.ops.attention_hopper")
    taken = []
    monkeypatch.setattr(attention_module, "_on_hopper", lambda t: True)
    monkeypatch.setattr(attention_module, "launch", lambda *args, **meta: taken.append("portable"))
    monkeypatch.setattr(hopper, "launch", lambda *args, **meta: taken.append("hopper"))

    def route(q, k, v=None, do=None, with_lse=False, **kw):
        q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
        v = k if v is None else v.detach().requires_grad_()
        o, lse = ops.attention(q, k, v, return_lse=True, **kw)
        do = torch.zeros_like(o) if do is None else do
        taken.clear()
        torch.autograd.backward([o, lse] if with_lse else [o], [do, torch.ones_like(lse)] if with_lse else [do])
        return set(taken)

    def t(*shape):
        return torch.zeros(shape, dtype=torch.float16, device=device)

    q, k = t(1, 4, 256, 128), t(1, 2, 256, 128)
    flops = 4 * 4 * 256 * 256 * 128
    monkeypatch.setattr(attention_module, "GLUON_BWD_MIN_FLOPS", flops + 1)
    assert route(q, k) == {"portable"}  # under GLUON_BWD_MIN_FLOPS
    monkeypatch.setattr(attention_module, "GLUON_BWD_MIN_FLOPS", flops)  # the portable forward, the Gluon backward:
    assert route(q, k) == {"hopper"}  # (the forward's TMA_MIN_FLOPS, 1e11, is far above this call)
    monkeypatch.setattr(attention_module, "GLUON_BWD_MIN_FLOPS", 0)
    assert route(q, k) == route(q, k, causal=True) == route(q, k, with_lse=True) == {"hopper"}
    assert route(t(1, 256, 4, 128), t(1, 256, 2, 128), layout="bshd") == {"hopper"}
    qkv = t(2, 256, 8 * 128)  # a fused projection's slices
    assert route(*(qkv[..., a:b].view(2, 256, -1, 128) for a, b in ((0, 512), (512, 768), (768, 1024))),
                 layout="bshd") == {"hopper"}
    assert route(q, k, do=t(1, 256, 4, 128).transpose(1, 2)) == {"hopper"}  # dO in another memory order
    assert route(q, k, causal=True, window=64) == route(q, k, causal=True, window=64, softcap=30.0) == {"hopper"}
    assert route(q, k, window=64) == {"portable"}
    monkeypatch.setattr(hopper, "num_programs_for", lambda device: 4)  # 4 SMs: 8 dK/dV programs make a small grid
    q64, k64 = q[..., :64], k[..., :64]  # (2 kv heads x 2 key blocks)
    assert route(q64, k64) == route(q64, k64, causal=True, window=9) == {"hopper"}
    assert route(t(1, 4, 1024, 64), t(1, 2, 1024, 64)) == {"portable"}  # 16 programs: not small
    assert route(q[:, :, :200], k[:, :, :200]) == {"portable"}  # a part tile
    assert route(q, k, do=t(1, 4, 256, 132)[..., :128]) == {"portable"}  # dO rows 264 bytes apart


def test_group_shares_rule():
    """The dK/dV kernel splits a kv group's q heads between programs only where its grid has few programs and the
    split shortens the busiest SM's work: Llama-3.1-8B's 8 kv heads at batch 1 and 2048 causal tokens (128 programs,
    the first key block's 16x the last's work) in 2; not the same grid without a mask (even work) or with a narrow
    window, nor twice the programs; a short sequence's grid further; always a divisor of the group."""
    hopper = pytest.importorskip("onepass.ops.attention_hopper")
    block_m, block_n, _ = hopper.DKDV_SETTING

    def shares(n_bhk, seqlen, group, causal=True, before=-1):
        return hopper.group_shares(n_bhk, seqlen, group, block_m, block_n, 128, causal, before, 132)

    assert shares(8, 2048, 4) == 2
    assert shares(8, 2048, 4, causal=False) == shares(8, 2048, 4, before=500) == shares(16, 2048, 4) == 1
    assert shares(4, 8192, 7) == 1
    assert shares(4, 1536, 4) == shares(4, 1536, 4, causal=False) == 4
    assert shares(1, 2048, 32) in (8, 16, 32) and shares(2, 1024, 6) in (2, 3, 6)


def test_sum_group_shares(device):
    """The dK/dV kernel's fp32 partial sums (dK's shares, then dV's) added into dk and dv views of either memory
    order: bhsd, and bshd (a [B, S, H, D] tensor's transpose), in their dtype."""
    hopper = pytest.importorskip("onepass.ops.attention_hopper")
    B, Hk, S, D, shares = 2, 3, 32, 16, 3
    part = torch.randn(2, shares, B * Hk * S, D, device=device)
    dk = torch.empty(B, Hk, S, D, dtype=torch.float16, device=device)
    dv = torch.empty(B, S, Hk, D, dtype=torch.float16, device=device).transpose(1, 2)
    hopper.launch(hopper._sum_group_shares, (B * Hk * S // 16, 2), part, dk, dv, shares, B * Hk * S, Hk, S,
                  *dk.stride()[:3], *dv.stride()[:3], HEAD_DIM=D, BLOCK_R=16)
    want = part.sum(1).view(2, B, Hk, S, D)
    assert_close(dk, want[0].half(), torch.float16, "dk")
    assert_close(dv, want[1].half(), torch.float16, "dv")


def test_bfloat16_small(device):
    """bfloat16 at small sizes: the kernels on a GPU; in Triton's interpreter, whose tl.dot on
    bfloat16 tiles returns garbage (values of 1e8), the reference."""
    q, k, v = _qkv((2, 4, 40, 32), (2, 2, 40, 32), torch.bfloat16, device)
    _check(q, k, v, torch.bfloat16, causal=True)


# ---------------------------------------------------------------- GPU, real sizes


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(causal=True, window=700, softcap=30.0)])
def test_gpu_bf16_real_sizes(head_dim, kw, monkeypatch):
    monkeypatch.setattr(sys.modules["onepass.ops.attention"], "TMA_MIN_FLOPS", 0)  # descriptors where the rules say
    q, k, v = _qkv((2, 8, 1500, head_dim), (2, 2, 1500, head_dim), torch.bfloat16, "cuda")
    _check(q, k, v, torch.bfloat16, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, kw, persistent_tiles, shares", [
    (64, dict(), 16, None), (128, dict(), 16, None), (128, dict(), 16, 1), (128, dict(causal=True), 16, None),
    (128, dict(causal=True), 16, 1), (128, dict(causal=True, layout="bshd"), 16, None),
    (128, dict(causal=True, layout="bshd"), 16, 1), (128, dict(causal=True), 0, 2),
    (128, dict(causal=True, window=300), 16, None), (128, dict(causal=True, window=1024), 0, 1),
    (128, dict(causal=True, window=1), 16, 2), (64, dict(causal=True, window=400), 16, None),
    (128, dict(softcap=2.0), 16, None), (128, dict(causal=True, window=300, softcap=5.0), 16, 1)])
def test_gpu_hopper_kernels(head_dim, kw, persistent_tiles, shares, monkeypatch):
    """The Gluon forward and (GLUON_BWD) backward, which on a Hopper GPU must take these calls, against the float64
    reference with a gradient into the LSE, grouped-query heads, 12 query blocks (192 work items: persistent programs
    take one or two; PERSISTENT_TILES 0 at head dim 128, one a program), causal windows that start inside a tile, on
    a tile's edge, within a warpgroup's rows (the rows after the first see none of the item's first tile) and of one
    key, softcaps small enough to bend the scores (tanh saturates); the dK/dV kernel's kv groups split in shares by
    the rule (4 at these 48 programs), in 2, or whole; and at another scale against the portable kernels."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernels run on compute capability 9 only")
    import onepass.ops.attention_hopper as attention_hopper

    attention_module = sys.modules["onepass.ops.attention"]
    monkeypatch.setattr(attention_module, "TMA_MIN_FLOPS", 0)
    monkeypatch.setattr(attention_module, "GLUON_BWD_MIN_FLOPS", 0)
    monkeypatch.setattr(attention_hopper, "PERSISTENT_TILES", persistent_tiles)
    if shares:
        monkeypatch.setattr(attention_hopper, "group_shares", lambda *args: shares)
    taken = []
    for name in ("forward", "backward"):
        run = getattr(attention_hopper, name)
        monkeypatch.setattr(attention_hopper, name, lambda *args, run=run, name=name:
                            taken.append((name, run(*args))) or taken[-1][1])
    bshd = kw.get("layout") == "bshd"
    q, k, v = _qkv((2, 1536, 8, head_dim) if bshd else (2, 8, 1536, head_dim),
                   (2, 1536, 2, head_dim) if bshd else (2, 2, 1536, head_dim), torch.bfloat16, "cuda")
    _check(q, k, v, torch.bfloat16, use_lse=True, **kw)
    gluon_backward = ((head_dim, kw.get("causal", False)) in attention_hopper.GLUON_BWD
                      or head_dim in attention_hopper.SMALL_GRID_BWD)  # (48 dK/dV programs: a small grid)
    assert taken == [("forward", True), ("backward", gluon_backward)]
    do, dlse = torch.randn_like(q), torch.randn(2, 8, 1536, device="cuda")

    def outputs():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        o, lse = ops.attention(*leaves, scale=0.05, return_lse=True, **kw)
        torch.autograd.backward([o, lse], [do, dlse])
        return o, lse, *(t.grad for t in leaves)

    gluon = outputs()
    monkeypatch.setattr(attention_module, "_on_hopper", lambda t: False)
    portable = outputs()
    assert len(taken) == 4
    for name, a, b in zip(("output", "lse", "dq", "dk", "dv"), gluon, portable):
        assert_close(a, b, torch.bfloat16, name + " at scale 0.05")


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, kw, shares", [(128, dict(causal=True), 1), (128, dict(causal=True), 2),
                                                   (64, dict(causal=True, window=400), 2)])
def test_gpu_hopper_causal_chunks(head_dim, kw, shares, monkeypatch):
    """The Gluon kernels' causal programs in chunks of 3 heads (the last one shorter: 3 of 16 q heads, of 4 or 8
    dK/dV (kv head, share) rows) give what programs over every head give, bit for bit: each program's arithmetic is
    the same, only its place in the grid moves."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernels run on compute capability 9 only")
    import onepass.ops.attention_hopper as attention_hopper

    attention_module = sys.modules["onepass.ops.attention"]
    monkeypatch.setattr(attention_module, "TMA_MIN_FLOPS", 0)
    monkeypatch.setattr(attention_module, "GLUON_BWD_MIN_FLOPS", 0)
    monkeypatch.setattr(attention_hopper, "group_shares", lambda *args: shares)
    q, k, v = _qkv((2, 8, 1536, head_dim), (2, 2, 1536, head_dim), torch.bfloat16, "cuda")
    do = torch.randn_like(q)

    asked = []

    def outputs(chunk):
        monkeypatch.setattr(attention_hopper, "chunk_heads", lambda heads, *args: asked.append(heads) or chunk(heads))
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        o = ops.attention(*leaves, **kw)
        o.backward(do)
        return o, *(t.grad for t in leaves)

    whole = outputs(lambda heads: heads)
    assert asked == [16, 16, 4 * shares]  # the forward's, dQ's and dK/dV's programs: all three Gluon kernels ran
    for name, a, b in zip(("output", "dq", "dk", "dv"), outputs(lambda heads: 3), whole):
        assert torch.equal(a, b), name


@pytest.mark.gpu
def test_gpu_bf16_varlen_and_cross_lengths():
    lens = [1, 1000, 129, 2048, 77]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q, k, v = _qkv((sum(lens), 16, 128), (sum(lens), 4, 128), torch.bfloat16, "cuda")
    _check(q, k, v, torch.bfloat16, use_lse=True, causal=True, layout="bshd", cu_seqlens=cu)
    q, k, v = _qkv((1, 1000, 8, 128), (1, 3000, 8, 128), torch.bfloat16, "cuda")
    _check(q, k, v, torch.bfloat16, causal=True, layout="bshd")


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_memory_grows_linearly_in_sequence_length(causal):
    """Forward + backward peak memory above the inputs: 4x the sequence, ~4x the memory (S^2 would be 16x)."""
    def extra_bytes(s):
        q, k, v = (t.requires_grad_(True) for t in _qkv((1, 16, s, 128), (1, 16, s, 128), torch.bfloat16, "cuda"))
        do = torch.randn_like(q)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ops.attention(q, k, v, causal=causal).backward(do)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    small, large = extra_bytes(4096), extra_bytes(16384)
    assert large <= 5 * small, f"peak memory grew {large / small:.1f}x for 4x the sequence"
