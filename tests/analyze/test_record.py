"""Exact byte and FLOP counts the recorder gives known ops."""

import pytest
import torch
import torch.nn.functional as F

from onepass.analyze.record import record

R, D = 6, 40  # irregular sizes on purpose


def ops_of(fn, *inputs, mode="forward"):
    return record(fn, inputs, mode=mode, quiet=True).ops


def test_matmul_bytes_and_flops():
    a, b = torch.randn(7, 13), torch.randn(13, 5)
    (op,) = ops_of(torch.mm, a, b)
    assert op.name == "aten.mm" and op.kind == "matmul"
    assert op.bytes_read == (7 * 13 + 13 * 5) * 4
    assert op.bytes_written == 7 * 5 * 4
    assert op.flops == 2 * 7 * 13 * 5


def test_linear_reads_transposed_weight_once():
    x, w, b = torch.randn(R, D), torch.randn(3, D), torch.randn(3)
    (op,) = ops_of(F.linear, x, w, b)
    assert op.name == "aten.addmm"
    assert op.bytes_read == (R * D + 3 * D + 3) * 4 and op.bytes_written == R * 3 * 4
    assert op.flops == 2 * R * D * 3


def hf_rms_norm(x, weight, eps=1e-6):
    """LlamaRMSNorm.forward, as Hugging Face writes it."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(input_dtype)


def test_hf_rms_norm_op_by_op():
    x, w = torch.randn(R, D, dtype=torch.bfloat16), torch.randn(D, dtype=torch.bfloat16)
    ops = ops_of(hf_rms_norm, x, w)
    rd = R * D
    expected = [  # (op, bytes read, bytes written, FLOPs)
        ("aten._to_copy", rd * 2, rd * 4, 0),
        ("aten.pow", rd * 4, rd * 4, rd),
        ("aten.mean", rd * 4, R * 4, rd),
        ("aten.add", R * 4, R * 4, R),
        ("aten.rsqrt", R * 4, R * 4, R),
        ("aten.mul", rd * 4 + R * 4, rd * 4, rd),  # h and the broadcast rstd, each read once
        ("aten._to_copy", rd * 4, rd * 2, 0),
        ("aten.mul", D * 2 + rd * 2, rd * 2, rd),  # the broadcast weight counts D elements
    ]
    assert [(op.name, op.bytes_read, op.bytes_written, op.flops) for op in ops] == expected
    # producers: the normalising mul reads the fp32 copy (op 0) and rstd (op 4)
    assert [u.producer for u in ops[5].inputs] == [0, 4]


def test_broadcast_add_counts_what_it_touches():
    x, b = torch.randn(R, D), torch.randn(D)
    (op,) = ops_of(torch.add, x, b)
    assert op.bytes_read == (R * D + D) * 4 and op.bytes_written == R * D * 4
    (op,) = ops_of(lambda x, b: x + b.expand(R, D), x, b)  # an explicit expand is a view: same bytes
    assert op.bytes_read == (R * D + D) * 4


def test_views_are_free_and_keep_the_producer():
    x = torch.randn(R, D)
    ops = ops_of(lambda x: torch.relu(x).view(-1).unsqueeze(0).t() * 2, x)
    assert [op.name for op in ops] == ["aten.relu", "aten.mul"]
    assert ops[1].inputs[0].producer == 0 and ops[1].bytes_read == R * D * 4


def test_one_storage_counted_once_per_op():
    x = torch.randn(R, D)
    (op,) = ops_of(lambda x: x * x, x)
    assert op.bytes_read == R * D * 4
    (op,) = ops_of(lambda x: x[:, : D // 2] + x[:, D // 2:], x)  # two halves: the storage, once
    assert op.bytes_read == R * D * 4 and op.bytes_written == R * D // 2 * 4
    (op,) = ops_of(lambda x: x.t().contiguous(), x)  # a real copy of a view
    assert op.name == "aten.clone" and op.bytes == 2 * R * D * 4


def test_embedding_reads_the_rows_it_gathers():
    table, ids = torch.randn(1000, D), torch.randint(0, 1000, (3, 4))
    (op,) = ops_of(F.embedding, ids, table)
    assert op.bytes_written == 12 * D * 4
    assert op.bytes_read == 12 * D * 4 + ids.numel() * 8


def test_meta_tensors_give_the_same_counts():
    args = torch.randn(R, D, dtype=torch.bfloat16), torch.randn(D, dtype=torch.bfloat16)
    real = ops_of(hf_rms_norm, *args)
    meta = ops_of(hf_rms_norm, *(a.to("meta") for a in args))
    assert [(o.name, o.bytes, o.flops) for o in real] == [(o.name, o.bytes, o.flops) for o in meta]


def test_train_mode_records_the_backward():
    x = torch.randn(R, D, requires_grad=True)
    w = torch.randn(D, 3, requires_grad=True)
    trace = record(lambda x, w: (torch.relu(x) @ w).sum(), (x, w), mode="train", quiet=True)
    phases = [op.phase for op in trace.ops]
    assert phases[:3] == ["forward"] * 3 and "backward" in phases
    assert any(op.name == "aten.threshold_backward" for op in trace.ops)


def test_sdpa_is_one_attention_op_each_way():
    q, k, v = (torch.randn(1, 2, 8, 16, requires_grad=True) for _ in range(3))
    trace = record(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True).sum(), (q, k, v),
                   mode="train", quiet=True)
    att = [op for op in trace.ops if op.kind == "attention"]
    assert [op.phase for op in att] == ["forward", "backward"]
    assert att[0].bytes_read == 3 * 8 * 2 * 16 * 4 and att[0].bytes_written == 8 * 2 * 16 * 4
    assert att[0].flops == 4 * 2 * 8 * 8 * 16 // 2  # two matmuls, half of them under the causal mask
    assert not any(op.name in ("aten.bmm", "aten._softmax") for op in trace.ops)


def test_bad_mode():
    with pytest.raises(ValueError, match="mode"):
        record(torch.relu, (torch.randn(2),), mode="backward")


@pytest.mark.parametrize("step, returned", [(lambda x: None, "returned None"),
                                             (lambda x: (x * 2).sum().item(), "returned a float")])
def test_train_mode_needs_a_loss_tensor(step, returned):
    """A train step that returns no tensor: an IndexError inside the recorder before."""
    with pytest.raises(TypeError, match=f"must return a loss tensor .*; it {returned}, with no tensor"):
        record(step, (torch.randn(3, requires_grad=True),), mode="train", quiet=True)


def test_storage_numbers_are_not_reused():
    """A freed storage's number is never given to a new one (its address is: new tensors were
    taken for old ones, read from their writers, and the chains varied from run to run)."""
    from onepass.analyze.record import _storage_id

    seen = {}
    for _ in range(20):
        t = torch.empty(64, device="meta")
        assert _storage_id(t) not in seen
        seen[_storage_id(t)] = t.untyped_storage()._cdata
        del t
    assert len(set(seen.values())) < len(seen)  # addresses did come round again: the case is exercised


def test_same_model_same_report():
    import transformers

    from onepass.analyze import analyze

    config = transformers.Qwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=128, vocab_size=256, head_dim=16)
    model = transformers.AutoModelForCausalLM.from_config(config)
    ids = torch.randint(0, 256, (1, 16))
    reports = {(meta, len(f.chains), sum(c.saved_bytes for c in f.chains))
               for meta in (True, False) for f in (analyze(model, ids, meta=meta, quiet=True).fusion for _ in range(4))}
    assert len({r[1:] for r in reports}) == 1, reports


def test_backward_ops_belong_to_the_module_whose_forward_made_them():
    """Identical layers get identical backward rows (the module tracker's view during backward
    held stale modules: ops went to other layers, the embedding's backward to an attention)."""
    import collections

    import transformers

    from onepass.analyze import analyze

    config = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=128, vocab_size=256, head_dim=16)
    model = transformers.AutoModelForCausalLM.from_config(config)
    ids = torch.randint(0, 256, (1, 16))
    ops = analyze(model, ids, mode="train", labels=ids, meta=True, quiet=True, use_cache=False).ops
    backward = [op for op in ops if op.phase == "backward"]
    per_layer = collections.Counter(".".join(op.module.split(".")[:3]) for op in backward
                                    if op.module.startswith("model.layers."))
    assert len(per_layer) == 4 and len(set(per_layer.values())) == 1, per_layer
    assert [op.module for op in backward if op.name == "aten.embedding_dense_backward"] == ["model.embed_tokens"]
    attention = [op.module for op in backward if op.kind == "attention"]
    assert attention == [f"model.layers.{i}.self_attn" for i in (3, 2, 1, 0)]


def test_an_optimized_model_is_said_to_be_one():
    """Its recorded ops are not what it runs (the reference on meta/CPU tensors): the report
    recommended the very ops it runs, so analyze says so."""
    import transformers

    import onepass
    from onepass.analyze import analyze

    config = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=128, vocab_size=256, head_dim=16)
    model = onepass.optimize(transformers.AutoModelForCausalLM.from_config(config))
    with pytest.warns(UserWarning, match="optimized by onepass"):
        analyze(model, torch.randint(0, 256, (1, 8)), meta=True, quiet=True)
