"""Chains found in the textbook examples, and the cases the design test keeps apart."""

import math

import pytest
import torch
import torch.nn.functional as F

from onepass.analyze import analyze

R, D = 64, 96


def chains_of(fn, *inputs, **kw):
    report = analyze(fn, *inputs, quiet=True, **kw)
    return report.fusion.chains, report


@pytest.mark.parametrize("k", [2, 3, 5])
def test_k_op_elementwise_chain_saves_k_fold(k):
    unary = [torch.exp, torch.neg, torch.sigmoid, torch.tanh, torch.sin][:k]

    def fn(x):
        for f in unary:
            x = f(x)
        return x

    (chain,), _ = chains_of(fn, torch.randn(R, D))
    assert chain.launches == k and chain.verdict == "fuse"
    assert chain.unfused_bytes == k * 2 * R * D * 4 and chain.fused_bytes == 2 * R * D * 4
    assert chain.passes == (2 * k, 2)


def test_relu_scale_bias():
    def fn(x, scale, bias):
        return torch.relu(x) * scale + bias

    (chain,), _ = chains_of(fn, torch.randn(R, D), 0.5, 1.0)
    assert [n for n in chain.names] == ["aten.relu", "aten.mul", "aten.add"]
    assert chain.unfused_bytes / chain.fused_bytes == 3
    # with per-feature scale and bias the small vectors add a little to both sides
    (chain,), _ = chains_of(fn, torch.randn(R, D), torch.randn(D), torch.randn(D))
    assert chain.unfused_bytes / chain.fused_bytes == pytest.approx(3, rel=0.03)
    assert chain.saved_s > 0 and chain.launches == 3


def test_bias_gelu():
    (chain,), _ = chains_of(lambda x, b: F.gelu(x + b, approximate="tanh"), torch.randn(R, D), torch.randn(D))
    assert chain.onepass_op == "onepass.ops.bias_gelu"
    assert chain.passes[0] == pytest.approx(4, rel=0.02) and chain.passes[1] == pytest.approx(2, rel=0.02)


def test_residual_add_layer_norm_dropout():
    def fn(x, residual, w, b):
        return F.layer_norm(residual + F.dropout(x, 0.1, training=True), (D,), w, b)

    (chain,), _ = chains_of(fn, torch.randn(R, D), torch.randn(R, D), torch.randn(D), torch.randn(D))
    assert chain.onepass_op == "onepass.ops.add_layer_norm"
    assert {"aten.add", "aten.native_layer_norm"} <= set(chain.names)
    assert any("dropout" in n or "bernoulli" in n for n in chain.names)  # native_dropout, or its CPU decomposition
    # unfused: dropout reads x, writes out and a mask; add reads 2, writes h; norm reads h, writes y
    # fused: read x and residual, write y (the mask is never stored: replayed from a seed)
    assert chain.fused_bytes == pytest.approx(3 * R * D * 4, rel=0.02)
    assert chain.unfused_bytes > 2 * chain.fused_bytes


def test_qk_norm_then_rope_is_not_a_residual_add_norm():
    """Qwen3 / Gemma 3: a per-head RMSNorm straight into RoPE, whose last add (q cos + rot(q) sin)
    adds two tensors of the output's size; it was named residual add + RMSNorm (add_rms_norm)."""
    def fn(x, w, cos, sin):
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
        return y * cos + torch.cat((-y[..., D // 2:], y[..., :D // 2]), -1) * sin

    (chain,), _ = chains_of(fn, torch.randn(R, D), torch.randn(D), torch.randn(R, D), torch.randn(R, D))
    assert chain.pattern == "RMSNorm + RoPE" and chain.onepass_op is None


def test_residual_stream_read_later_is_written_by_add_rms_norm():
    """h = x + residual feeds the norm and, after a matmul, the next residual add."""
    w = torch.randn(D, D)

    def fn(x, residual, g):
        h = x + residual
        y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * g
        return (y @ w) + h

    chains, report = chains_of(fn, torch.randn(R, D), torch.randn(R, D), torch.randn(D))
    (norm,) = [c for c in chains if c.onepass_op]
    assert norm.onepass_op == "onepass.ops.add_rms_norm"
    assert norm.fused_bytes == pytest.approx(4 * R * D * 4, rel=0.02)  # read x, residual; write h, y
    assert not any(f.kind == "reused intermediate" for f in report.fusion.flags)


def test_scores_softmax_at_v_is_attention():
    B, H, L, Dh = 1, 2, 64, 16
    q, k, v = (torch.randn(B, H, L, Dh) for _ in range(3))

    def fn(q, k, v):
        scores = q @ k.transpose(-1, -2) / math.sqrt(Dh)
        return torch.softmax(scores, dim=-1) @ v

    (chain,), _ = chains_of(fn, q, k, v)
    assert chain.onepass_op == "onepass.ops.attention"
    assert sum(n in ("aten.bmm", "aten.matmul") for n in chain.names) == 2
    assert chain.fused_bytes == 4 * B * H * L * Dh * 4  # read q, k, v; write the output
    assert chain.saved_bytes >= 4 * B * H * L * L * 4  # the scores and probabilities, written and read


def test_no_chain_across_a_matmul():
    w = torch.randn(D, D)
    chains, report = chains_of(lambda x: (torch.relu(x) @ w) * 2, torch.randn(R, D))
    assert chains == []
    assert any(f.kind == "compute-bound" for f in report.fusion.flags) or report.fusion.memory_bound[1]


def test_no_chain_across_a_reused_intermediate():
    w = torch.randn(D, D)

    def fn(x):
        t = torch.relu(x)  # read by the mul and, after the matmul, by the add
        return ((t * 2) @ w) + t

    chains, report = chains_of(fn, torch.randn(R, D))
    assert not any("aten.relu" in c.names for c in chains)
    assert [f.kind for f in report.fusion.flags if f.kind == "reused intermediate"] == ["reused intermediate"]


def test_returned_intermediate_is_not_fused_across():
    def fn(x):
        t = torch.relu(x)
        return t * 2, t

    chains, _ = chains_of(fn, torch.randn(R, D))
    assert chains == []


def test_row_too_big_for_on_chip_memory_is_charged_a_second_read():
    small, _ = chains_of(lambda x: torch.softmax(x * 2, -1), torch.randn(4, 1024))
    big, _ = chains_of(lambda x: torch.softmax(x * 2, -1), torch.randn(2, 128 * 1024))
    assert small[0].notes == [] and small[0].passes[1] == pytest.approx(2, rel=0.01)
    assert "shared memory" in big[0].notes[0] and big[0].passes[1] == pytest.approx(3, rel=0.01)


def test_launch_bound_region_is_flagged():
    _, report = chains_of(lambda x: torch.relu(x) + 1, torch.randn(4, 4))
    assert any(f.kind == "launch-bound" for f in report.fusion.flags)


def test_bad_gpu_name():
    with pytest.raises(ValueError, match="gpu"):
        analyze(torch.relu, torch.randn(2), gpu="Z80")


def test_a_plain_function_has_no_module():
    _, report = chains_of(lambda x: torch.relu(x) * 2, torch.randn(R, D))
    assert {op.module for op in report.ops} == {""}  # ModuleTracker's top level was shown as "Global"


def test_a_name_is_not_a_model():
    with pytest.raises(TypeError, match="configs.build"):  # it failed with "'str' object is not callable"
        analyze("llama-tiny", torch.zeros(1, 4, dtype=torch.long))
