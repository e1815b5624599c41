import sys

import pytest
import torch

from onepass import ops, reference
from onepass.testing import assert_close

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _shape(layout, b, h, s, d):
    return (b, h, s, d) if layout == "bhsd" else (b, s, h, d)


def _hf_tables(b, s, r, device, base=10000.0, style="half", offset=0):
    """cos/sin [B, S, R] as HF's rotary embedding builds them (each frequency twice)."""
    inv_freq = 1.0 / base ** (torch.arange(0, r, 2, dtype=torch.float32, device=device) / r)
    pos = torch.arange(offset, offset + s, device=device, dtype=torch.float32)[None].expand(b, s)
    freqs = pos[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), -1) if style == "half" else freqs.repeat_interleave(2, -1)
    return emb.cos(), emb.sin()


def _check(q, k, cos, sin, dtype, position_ids=None, layout="bhsd", style="half"):
    """Outputs and the gradients of q and k against the float64 reference."""
    q.requires_grad_(True)
    k.requires_grad_(True)
    qo, ko = ops.rope(q, k, cos, sin, position_ids, layout, style)
    assert qo.shape == q.shape and ko.shape == k.shape and qo.dtype == q.dtype
    gq, gk = torch.randn_like(qo), torch.randn_like(ko)
    torch.autograd.backward((qo, ko), (gq, gk))
    qd, kd = (t.detach().double().requires_grad_(True) for t in (q, k))
    rq, rk = reference.rope(qd, kd, cos.double(), sin.double(), position_ids, layout, style)
    torch.autograd.backward((rq, rk), (gq.double(), gk.double()))
    for name, out, ref in (("q'", qo, rq), ("k'", ko, rk), ("dq", q.grad, qd.grad), ("dk", k.grad, kd.grad)):
        assert_close(out, ref, dtype, name)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("style", ["half", "interleaved"])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_matches_reference_gqa(layout, style, dtype, device):
    b, hq, hk, s, d = 2, 6, 2, 7, 24  # irregular: 7 tokens, 6 q heads over 2 k heads, half dim 12
    q = torch.randn(_shape(layout, b, hq, s, d), dtype=dtype, device=device)
    k = torch.randn(_shape(layout, b, hk, s, d), dtype=dtype, device=device)
    cos, sin = _hf_tables(b, s, d, device, style=style)
    _check(q, k, cos.to(dtype), sin.to(dtype), dtype, layout=layout, style=style)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_per_batch_tables_in_token_tiles(layout, device, monkeypatch):
    """Per-batch tables over more tokens than a tile: tiles of tokens, each over every head block
    in turn, the last tile partial (on a GPU from 1025 tokens; here tiles of 4 over 14)."""
    monkeypatch.setattr(sys.modules["onepass.ops.rope"], "TOKEN_TILE", 4)
    b, hq, hk, s, d = 2, 6, 2, 7, 24
    q = torch.randn(_shape(layout, b, hq, s, d), device=device)
    k = torch.randn(_shape(layout, b, hk, s, d), device=device)
    cos, sin = _hf_tables(b, s, d, device)
    _check(q, k, cos, sin, torch.float32, layout=layout)


@pytest.mark.parametrize("case", ["half", "interleaved", "partial", "position_ids", "shared_table", "inplace"])
def test_head_major_order_gives_the_token_major_results(case, device, monkeypatch):
    """Short head rows whose tokens are contiguous run head-major (tokens of one head a program, in tiles of
    tokens over every head): forward, backward and in place give the token-major order's results (here
    blocks of 4 tokens in tiles of 8 over 11 tokens, so the last tile and block are partial; equal up to
    float32 rounding: two compiled kernels may contract the products differently)."""
    rope = sys.modules["onepass.ops.rope"]
    monkeypatch.setattr(rope, "HEAD_MAJOR_TOKENS", 4)
    monkeypatch.setattr(rope, "HEAD_MAJOR_TILE", 8)
    b, hq, hk, s, d = 2, 3, 2, 11, 16
    style = "interleaved" if case == "interleaved" else "half"
    q, k = torch.randn(b, hq, s, d, device=device), torch.randn(b, hk, s, d, device=device)
    assert rope._head_major((q, k), "bhsd", s)
    cos, sin = _hf_tables(1 if case == "shared_table" else b, s, 8 if case == "partial" else d, device, style=style)
    pos = torch.randint(0, s, (b, s), device=device) if case == "position_ids" else None
    if pos is not None:
        cos, sin = cos[0], sin[0]

    def run(head_major_bytes):
        monkeypatch.setattr(rope, "HEAD_MAJOR_ROW_BYTES", head_major_bytes)
        if case == "inplace":
            qi, ki = q.clone(), k.clone()
            ops.rope(qi, ki, cos, sin, pos, inplace=True)
            return qi, ki
        qg, kg = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
        qo, ko = ops.rope(qg, kg, cos, sin, pos, style=style)
        torch.autograd.backward((qo, ko), (q * 0.5, k * 0.5))
        return qo.detach(), ko.detach(), qg.grad, kg.grad

    token_major, head_major = run(0), run(256)
    for a, e in zip(head_major, token_major):
        torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-6)
    _check(q.clone(), k.clone(), cos, sin, torch.float32, position_ids=pos, style=style)  # (head-major again)


@pytest.mark.parametrize("tables", ["per_batch", "shared", "random"])
@pytest.mark.parametrize("d", [24, 40])
def test_head_major_flat_runs_at_head_dims_no_power_of_two(d, tables, device, monkeypatch):
    """A head dim that is no power of two runs head-major as flat runs of values (_rope_flat_kernel), forward
    and backward, against the reference: here blocks of 64 lanes (2 tokens or 1, lanes left over) in two tiles
    of 6 tokens over 11 (at d 24 the last block partial, at d 40 a spare block past the sequence). Random
    tables (each half's own cos and sin) tell the backward's partner sine from the value's own, which HF's
    tables (each frequency twice) do not."""
    rope = sys.modules["onepass.ops.rope"]
    monkeypatch.setattr(rope, "HEAD_MAJOR_TOKENS", 4)
    monkeypatch.setattr(rope, "HEAD_MAJOR_TILE", 8)
    monkeypatch.setattr(rope, "FLAT_BLOCK", 64)
    kernels = []
    launch = rope.launch
    monkeypatch.setattr(rope, "launch", lambda kernel, *args, **meta: (kernels.append(kernel), launch(kernel, *args,
                                                                                                       **meta)))
    b, hq, hk, s = 2, 3, 2, 11
    q, k = torch.randn(b, hq, s, d, device=device), torch.randn(b, hk, s, d, device=device)
    cos, sin = _hf_tables(b if tables == "per_batch" else 1, s, d, device)
    if tables == "random":
        cos, sin = torch.randn(b, s, d, device=device), torch.randn(b, s, d, device=device)
    _check(q, k, cos, sin, torch.float32)
    assert kernels == [rope._rope_flat_kernel] * 2  # forward and backward


def test_head_major_flat_runs_only_where_its_offsets_fit_int32():
    """The flat kernel's offsets are int32: a head whose blocks, the grid's spare ones past the sequence
    included, span 2^31 values or more takes the padded head-major kernel (a sequence of 26,840,519 tokens at
    d 80 fits seq x d under 2^31, but its last tile's spare blocks do not)."""
    rope = sys.modules["onepass.ops.rope"]
    table = torch.empty(1, 1, 80)
    assert rope._flat(80, 80, False, None, table, 16384, False)
    assert not rope._flat(80, 80, False, None, table, 26_840_519, False)
    assert not rope._flat(64, 64, False, None, table, 16384, False)  # a power of two: pairs of half-rows


def test_head_major_order_runs_where_a_heads_tokens_are_contiguous_and_its_rows_short():
    rope = sys.modules["onepass.ops.rope"]
    bf16 = dict(dtype=torch.bfloat16, device="meta")
    q80, q128 = torch.empty(1, 4, 64, 80, **bf16), torch.empty(1, 4, 64, 128, **bf16)
    assert rope._head_major((q80,), "bhsd", 64)
    assert not rope._head_major((q128,), "bhsd", 64)  # 256-byte rows: token-major was faster
    assert not rope._head_major((q80.float(),), "bhsd", 64)  # 320-byte rows
    assert not rope._head_major((q80,), "bhsd", rope.HEAD_MAJOR_TOKENS - 1)
    projected = torch.empty(1, 64, 4, 80, **bf16).transpose(1, 2)  # HF's q: [B, S, H, D] memory seen as bhsd
    assert not rope._head_major((projected,), "bhsd", 64) and not rope._head_major((q80,), "bshd", 64)
    many = torch.empty(1 << 16, 1, 16, 80, **bf16)  # 65536 sequences: past the grid's third dim
    assert rope._head_major((many[:-1],), "bhsd", 16) and not rope._head_major((many,), "bhsd", 16)
    heads = torch.empty(1, 1 << 15, 16, 80, **bf16)  # q's and k's heads, 65536 together: past its second dim
    assert rope._head_major((heads, heads[:, 1:]), "bhsd", 16) and not rope._head_major((heads, heads), "bhsd", 16)


@pytest.mark.parametrize("style", ["half", "interleaved"])
def test_arbitrary_tables_use_the_exact_transpose(style, device):
    """Tables whose two halves differ (not HF's): forward and backward still match the formula."""
    q, k = torch.randn(2, 3, 5, 16, device=device), torch.randn(2, 1, 5, 16, device=device)
    _check(q, k, torch.randn(2, 5, 16, device=device), torch.randn(2, 5, 16, device=device), torch.float32,
           style=style)


@pytest.mark.parametrize("table_shape", ["s_r", "1_s_r", "hf_unsqueezed"])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_table_shapes(table_shape, layout, device):
    b, s, d = 2, 9, 32
    cos, sin = _hf_tables(1, s, d, device)
    if table_shape == "s_r":
        cos, sin = cos[0], sin[0]
    elif table_shape == "hf_unsqueezed":
        cos, sin = (t.unsqueeze(1 if layout == "bhsd" else 2) for t in (cos, sin))
    q = torch.randn(_shape(layout, b, 4, s, d), device=device)
    k = torch.randn(_shape(layout, b, 4, s, d), device=device)
    _check(q, k, cos, sin, torch.float32, layout=layout)


@pytest.mark.parametrize("pos_shape", ["b_s", "1_s", "s"])
def test_position_ids_gather_table_rows(pos_shape, device):
    b, s, d, max_pos = 3, 6, 16, 50
    cos, sin = _hf_tables(1, max_pos, d, device)
    table_c, table_s = cos[0], sin[0]  # [max_positions, R]
    pos = torch.randint(0, max_pos, (b if pos_shape == "b_s" else 1, s), device=device)
    if pos_shape == "s":
        pos = pos[0]
    q, k = torch.randn(b, 4, s, d, device=device), torch.randn(b, 2, s, d, device=device)
    _check(q, k, table_c, table_s, torch.float32, position_ids=pos)
    # the gather gives what rope on the pre-gathered [B, S, R] tables gives
    qo, ko = ops.rope(q.detach(), k.detach(), table_c, table_s, pos)
    gathered = table_c[pos.reshape(-1, s)], table_s[pos.reshape(-1, s)]
    qg, kg = ops.rope(q.detach(), k.detach(), *gathered)
    assert torch.equal(qo, qg) and torch.equal(ko, kg)


@pytest.mark.parametrize("style", ["half", "interleaved"])
def test_partial_rotary_passes_the_rest_through(style, device):
    q, k = torch.randn(2, 3, 5, 40, device=device), torch.randn(2, 1, 5, 40, device=device)
    cos, sin = _hf_tables(2, 5, 16, device, style=style)  # 16 of 40 dims rotate (NeoX rotary_pct 0.4)
    _check(q, k, cos, sin, torch.float32, style=style)
    qo, _ = ops.rope(q.detach(), k.detach(), cos, sin, style=style)
    assert torch.equal(qo[..., 16:], q[..., 16:])


def test_matches_transformers_implementations(device):
    """Against the code HF models run: Llama's rotate-half and Cohere's interleaved rotation."""
    from transformers.models.cohere.modeling_cohere import apply_rotary_pos_emb as cohere_rope
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_rope

    q, k = torch.randn(2, 4, 11, 32, device=device), torch.randn(2, 2, 11, 32, device=device)
    for style, hf in (("half", llama_rope), ("interleaved", cohere_rope)):
        cos, sin = _hf_tables(2, 11, 32, device, style=style, offset=5)
        for out, ref in zip(ops.rope(q, k, cos, sin, style=style), hf(q, k, cos, sin)):
            assert_close(out, ref, torch.float32, style)
        bshd = ops.rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin, layout="bshd", style=style)
        for out, ref in zip(bshd, hf(q.transpose(1, 2), k.transpose(1, 2), cos, sin, unsqueeze_dim=2)):
            assert_close(out, ref, torch.float32, f"{style} bshd")


def test_non_contiguous_inputs(device):
    """q and k as views of a fused qkv projection, [B, S, H, D] read through a transpose."""
    b, s, hq, hk, d = 2, 5, 4, 2, 16
    qkv = torch.randn(b, s, (hq + 2 * hk) * d, device=device)
    q = qkv[..., : hq * d].view(b, s, hq, d).transpose(1, 2)
    k = qkv[..., hq * d: (hq + hk) * d].view(b, s, hk, d).transpose(1, 2)
    cos, sin = _hf_tables(b, s, d, device)
    assert not q.is_contiguous() and not k.is_contiguous()
    _check(q.detach(), k.detach(), cos, sin, torch.float32)
    wide_cos = torch.cat((cos, cos), -1)[..., :d]  # a strided table, unlike sin
    _check(q.detach(), k.detach(), wide_cos, sin, torch.float32)


def test_inplace_writes_into_q_and_k(device):
    q, k = torch.randn(2, 4, 6, 16, device=device), torch.randn(2, 2, 6, 16, device=device)
    cos, sin = _hf_tables(2, 6, 16, device)
    expected = ops.rope(q, k, cos, sin)
    q_ptr = q.data_ptr()
    qo, ko = ops.rope(q, k, cos, sin, inplace=True)
    assert qo is q and ko is k and q.data_ptr() == q_ptr
    assert torch.equal(q, expected[0]) and torch.equal(k, expected[1])


def test_inplace_refuses_inputs_that_need_grad(device):
    q = torch.randn(1, 2, 3, 8, device=device, requires_grad=True)
    k = torch.randn(1, 2, 3, 8, device=device)
    cos, sin = _hf_tables(1, 3, 8, device)
    with pytest.raises(ValueError, match="inplace"):
        ops.rope(q, k, cos, sin, inplace=True)
    with torch.no_grad():
        ops.rope(q, k, cos, sin, inplace=True)  # fine without autograd


def test_inplace_refuses_one_tensor_as_q_and_k(device):
    """In place, q passed as k too would be rotated twice (once as q, once as k)."""
    q = torch.randn(1, 2, 3, 8, device=device)
    cos, sin = _hf_tables(1, 3, 8, device)
    before = q.clone()
    for k in (q, q.view(1, 2, 3, 8)):
        with pytest.raises(ValueError, match="rotated twice"):
            ops.rope(q, k, cos, sin, inplace=True)
    assert torch.equal(q, before)
    assert torch.equal(ops.rope(q, q, cos, sin)[1], ops.rope(q, q.clone(), cos, sin)[1])  # out of place: fine
    meta = [torch.empty(1, 2, 3, 8, device="meta") for _ in range(2)]  # (no addresses: both read 0)
    assert ops.rope(*meta, *(torch.empty(1, 3, 8, device="meta"),) * 2, inplace=True)[0] is meta[0]


def test_empty(device):
    q = torch.randn(2, 4, 0, 16, device=device, requires_grad=True)
    k = torch.randn(2, 2, 0, 16, device=device, requires_grad=True)
    cos, sin = _hf_tables(2, 0, 16, device)
    qo, ko = ops.rope(q, k, cos, sin)
    (qo.sum() + ko.sum()).backward()
    assert qo.shape == q.shape and q.grad.shape == q.shape
    for position_ids in (None, torch.zeros(2, 0, dtype=torch.long, device=device)):  # the CPU fallback's path
        ref_q, ref_k = reference.rope(q, k, cos, sin, position_ids)
        assert ref_q.shape == q.shape and ref_k.shape == k.shape


# ------------------------------------------------------------- compile and opcheck


def test_torch_compile_fullgraph(device):
    q = torch.randn(2, 4, 6, 16, device=device, requires_grad=True)
    k = torch.randn(2, 2, 6, 16, device=device, requires_grad=True)
    cos, sin = _hf_tables(2, 6, 16, device)

    def attention_inputs(q, k, cos, sin):
        qo, ko = ops.rope(q, k, cos, sin)
        return qo.sum(1) * ko.sum(1)

    compiled = torch.compile(attention_inputs, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    out = compiled(q, k, cos, sin)
    out.sum().backward()
    grads = q.grad.clone(), k.grad.clone()
    q.grad = k.grad = None
    eager = attention_inputs(q, k, cos, sin)
    eager.sum().backward()
    assert_close(out, eager, torch.float32)
    assert_close(grads[0], q.grad, torch.float32)
    assert_close(grads[1], k.grad, torch.float32)


def test_torch_compile_inplace(device):
    q, k = torch.randn(1, 2, 5, 8, device=device), torch.randn(1, 1, 5, 8, device=device)
    cos, sin = _hf_tables(1, 5, 8, device)
    expected = ops.rope(q, k, cos, sin)

    def rotate_cache(q, k, cos, sin):
        ops.rope(q, k, cos, sin, inplace=True)
        return q + 0, k + 0

    out = torch.compile(rotate_cache, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")(
        q, k, cos, sin)
    assert torch.equal(q, expected[0]) and torch.equal(k, expected[1])
    assert torch.equal(out[0], expected[0])


def test_opcheck(device):
    from onepass.ops.rope import _rope, _rope_inplace

    q = torch.randn(2, 3, 5, 16, device=device, requires_grad=True)
    k = torch.randn(2, 1, 5, 16, device=device, requires_grad=True)
    cos, sin = _hf_tables(2, 5, 16, device)
    table_c, table_s = _hf_tables(1, 12, 8, device)
    pos = torch.randint(0, 12, (2, 5), device=device)
    for args in [(q, k, cos, sin, None, "bhsd", False, False),
                 (q.transpose(1, 2), k.transpose(1, 2), table_c[0], table_s[0], pos, "bshd", False, False)]:
        torch.library.opcheck(_rope, args)
    # interleaved, backward: its schema, autograd registration and fake kernel (the AOT checks take most of the time)
    torch.library.opcheck(_rope, (q, k, cos, sin, None, "bhsd", True, True),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    torch.library.opcheck(_rope_inplace, (q.detach().clone(), k.detach().clone(), cos, sin, None, "bhsd", False))


# ------------------------------------------------------------------------ the rotary tables


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tables_match_transformers_rotary_embedding(dtype, device):
    """Llama's rotary embedding (llama3 scaling: an attention_scaling of 1 and scaled frequencies),
    and a scaling != 1 with frequencies held in bfloat16; positions per row, expanded, and large."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=64, num_attention_heads=2, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    emb = LlamaRotaryEmbedding(config).to(device)
    x = torch.zeros(1, dtype=dtype, device=device)
    for positions in (torch.tensor([[0, 5, 131071], [3, 4, 9]], device=device),
                      torch.arange(7, device=device).expand(3, 7)):
        for ours, theirs in zip(ops.rope_tables(positions, emb.inv_freq, emb.attention_scaling, dtype),
                                emb(x, positions)):
            assert ours.dtype == dtype and ours.shape == theirs.shape == (*positions.shape, 32)
            assert_close(ours, theirs, dtype)
    inv_freq = emb.inv_freq.bfloat16()
    for ours, ref in zip(ops.rope_tables(positions, inv_freq, 0.7, dtype),
                         reference.rope_tables(positions, inv_freq, 0.7, dtype)):
        assert_close(ours, ref, dtype)


def test_tables_opcheck_and_bad_input(device):
    from onepass.ops.rope import _rope_tables

    positions = torch.arange(6, device=device).reshape(2, 3)
    inv_freq = torch.rand(8, device=device)
    torch.library.opcheck(_rope_tables, (positions, inv_freq, 1.5, torch.bfloat16))
    assert [t.shape for t in ops.rope_tables(positions[:, :0], inv_freq)] == [(2, 0, 16)] * 2
    with pytest.raises(ValueError, match="position_ids"):
        ops.rope_tables(positions.float(), inv_freq)
    with pytest.raises(ValueError, match="inv_freq"):
        ops.rope_tables(positions, inv_freq[None])
    with pytest.raises(TypeError, match="dtype"):  # (cos and sin of an int table would round to 0 and 1)
        ops.rope_tables(positions, inv_freq, dtype=torch.int32)
    assert ops.rope_tables(positions, inv_freq, dtype=torch.float64)[0].dtype == torch.float64


def test_optimize_gives_the_rotary_embedding_the_one_launch_tables(device):
    """optimize patches Llama's rotary embedding (its tables then come from rope_tables: same
    values) and leaves a dynamic one, whose frequencies change on the host, as it is."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import onepass

    def tiny(rope_parameters):
        config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, rope_parameters=rope_parameters)
        return LlamaForCausalLM(config).to(device).eval()

    model = tiny({"rope_type": "default", "rope_theta": 10000.0})
    positions = torch.arange(5, device=device)[None]
    x = torch.zeros(1, device=device)
    before = model.model.rotary_emb(x, positions)
    onepass.optimize(model)
    assert "rotary tables in one launch" in onepass.optimize_report(model)["rope"]
    for ours, theirs in zip(model.model.rotary_emb(x, positions), before):
        assert_close(ours, theirs, torch.float32)
    dynamic = tiny({"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    onepass.optimize(dynamic)
    assert "rotary tables" not in onepass.optimize_report(dynamic)["rope"]
    assert "forward" not in vars(dynamic.model.rotary_emb)  # the class's own


# ------------------------------------------------------------------------ bad input


def _bad_calls(device="cpu"):
    def tables(s=5, r=16, b=2):
        return _hf_tables(b, s, r, device)

    def table():  # a [max_positions = 5, R] table for position_ids
        return tuple(t[0] for t in tables())

    def ids(t):
        return t.to(device)

    return [
        (lambda q, k: ops.rope(q, k, *tables(), layout="sbhd"), ValueError, "layout"),
        (lambda q, k: ops.rope(q, k, *tables(), style="gptj"), ValueError, "style"),
        (lambda q, k: ops.rope(q.long(), k, *tables()), TypeError, "q"),
        (lambda q, k: ops.rope(q, k[0], *tables()), ValueError, "4-D"),
        (lambda q, k: ops.rope(q, k[..., :8], *tables()), ValueError, "k"),
        (lambda q, k: ops.rope(q, k, *tables(s=4)), ValueError, "cos"),
        (lambda q, k: ops.rope(q, k, *tables(b=3)), ValueError, "cos"),
        (lambda q, k: ops.rope(q, k, *tables(r=18)), ValueError, "cos"),
        (lambda q, k: ops.rope(q, k, tables()[0][..., :7], tables()[1][..., :7]), ValueError, "even"),
        (lambda q, k: ops.rope(q, k, tables()[0], tables()[1][..., :8]), ValueError, "sin"),
        (lambda q, k: ops.rope(q, k, *table(), ids(torch.zeros(2, 5))), TypeError, "position_ids"),
        (lambda q, k: ops.rope(q, k, *table(), ids(torch.zeros(2, 4, dtype=torch.long))), ValueError, "position_ids"),
        (lambda q, k: ops.rope(q, k, *table(), ids(torch.full((2, 5), 5))), ValueError, "position_ids"),
        (lambda q, k: ops.rope(q, k, *table(), ids(torch.full((2, 5), -1))), ValueError, "position_ids"),
        (lambda q, k: ops.rope(q, k, tables()[0].requires_grad_(True), tables()[1]), ValueError, "cos/sin"),
        (lambda q, k: ops.rope(q, k.to("meta"), *tables()), ValueError, "device"),
    ]


@pytest.mark.parametrize("index", range(len(_bad_calls())))
def test_bad_input_raises_and_writes_nothing(index, device):
    call, error, words = _bad_calls(device)[index]
    q, k = torch.randn(2, 3, 5, 16, device=device), torch.randn(2, 1, 5, 16, device=device)
    q0, k0 = q.clone(), k.clone()
    with pytest.raises(error, match=words):
        call(q, k)
    assert torch.equal(q, q0) and torch.equal(k, k0)


# ---------------------------------------------------------------- GPU, real sizes


@pytest.mark.gpu
@pytest.mark.parametrize("style", ["half", "interleaved"])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_gpu_bf16_llama_sizes(layout, style):
    b, hq, hk, s, d = 2, 32, 8, 4096, 128
    q = torch.randn(_shape(layout, b, hq, s, d), dtype=torch.bfloat16, device="cuda")
    k = torch.randn(_shape(layout, b, hk, s, d), dtype=torch.bfloat16, device="cuda")
    cos, sin = _hf_tables(b, s, d, "cuda", base=500000.0, style=style)
    _check(q, k, cos.bfloat16(), sin.bfloat16(), torch.bfloat16, layout=layout, style=style)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 80, 96])
def test_gpu_bf16_head_major_head_dims(d):
    b, hq, hk, s = 2, 32, 8, 20000  # two tiles of tokens, a partial block last
    q = torch.randn(b, hq, s, d, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(b, hk, s, d, dtype=torch.bfloat16, device="cuda")
    assert sys.modules["onepass.ops.rope"]._head_major((q, k), "bhsd", s)
    cos, sin = _hf_tables(b, s, d, "cuda", base=500000.0)
    _check(q, k, cos.bfloat16(), sin.bfloat16(), torch.bfloat16)


@pytest.mark.gpu
def test_gpu_bf16_position_ids_and_inplace():
    b, s, d = 4, 2048, 128
    cos, sin = _hf_tables(1, 8192, d, "cuda")
    pos = torch.randint(0, 8192, (b, s), device="cuda")
    q = torch.randn(b, 32, s, d, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(b, 8, s, d, dtype=torch.bfloat16, device="cuda")
    _check(q, k, cos[0], sin[0], torch.bfloat16, position_ids=pos)
    expected = ops.rope(q.detach(), k.detach(), cos[0], sin[0], pos)
    qi, ki = q.detach().clone(), k.detach().clone()
    ops.rope(qi, ki, cos[0], sin[0], pos, inplace=True)
    assert torch.equal(qi, expected[0]) and torch.equal(ki, expected[1])
