"""Families optimize recognises by what their blocks compute (no family file): the loss and every
gradient against the unoptimized model (fp32, kernels through the interpreter on a CPU), the
report of what is fused; and near-misses of the recognised blocks, left as they are."""

from __future__ import annotations

import copy
import warnings

import pytest
import tiny_models as tiny
import torch
from torch import nn

import onepass
from onepass.testing import TOLERANCE, rel_error

transformers = pytest.importorskip("transformers")

SCALE = 20  # fp32 kernels vs PyTorch: one layer of rounding per fused op, summed over 2 layers

# what each family's report must say is fused (every other switch: fused, or n/a)
PARTLY = {
    "olmo2": {"norm"},  # post-norm layers: norms fused, residual add + norm not
    "cohere": {"norm"},  # parallel branches, and q/k norms with a weight per head
}


def _optimized(model: nn.Module) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return onepass.optimize(model)


def _loss_and_grads(model, ids):
    model.train()
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _assert_same_training(model, ref, device):
    ids = torch.randint(0, tiny.VOCAB, (2, 10), generator=torch.Generator().manual_seed(1)).to(device)
    loss, grads = _loss_and_grads(model, ids)
    ref_loss, ref_grads = _loss_and_grads(ref, ids)
    assert rel_error(loss, ref_loss) <= TOLERANCE[torch.float32] * SCALE
    for name, g in ref_grads.items():
        assert (g is None) == (grads[name] is None), name
        if g is not None:
            err = rel_error(grads[name], g)
            assert err <= TOLERANCE[torch.float32] * SCALE, f"d {name}: relative error {err:.3g}"


@pytest.mark.parametrize("family", sorted(tiny.MORE_CONFIGS))
def test_loss_and_gradients_match(family, device):
    ref = tiny.build(family).to(device)
    model = _optimized(copy.deepcopy(ref))
    report = onepass.optimize_report(model)
    for switch, status in report.items():
        if switch in ("lora", "recompute"):
            continue
        wanted = ("fused", "unfused") if switch in PARTLY.get(family, ()) else ("fused", "n/a")
        assert status.startswith(wanted), f"{switch}: {status}"
    _assert_same_training(model, ref, device)
    onepass.undo(model)


# ------------------------------------------------------------------------- near-misses


class MovedEpsRMSNorm(nn.Module):
    """eps outside the square root: x / (sqrt(mean(x^2)) + eps) * weight."""

    def __init__(self, weight, eps):
        super().__init__()
        self.weight, self.variance_epsilon = weight, eps

    def forward(self, x):
        return self.weight * (x / (x.pow(2).mean(-1, keepdim=True).sqrt() + self.variance_epsilon))


class ScaledRMSNorm(MovedEpsRMSNorm):
    """Llama's RMSNorm times 1.01."""

    def forward(self, x):
        return 1.01 * self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


@pytest.mark.parametrize("norm_class", [MovedEpsRMSNorm, ScaledRMSNorm])
def test_a_norm_computing_something_else_stays(norm_class, device):
    ref = tiny.build("llama")
    layer = ref.model.layers[0]
    old = layer.input_layernorm
    layer.input_layernorm = norm_class(old.weight, 1e-2)  # an eps that matters on the probe's small rows
    ref = ref.to(device)
    model = _optimized(copy.deepcopy(ref))
    assert type(model.model.layers[0].input_layernorm) is norm_class
    assert type(model.model.layers[1].input_layernorm) is onepass.nn.RMSNorm
    report = onepass.optimize_report(model)["norm"]
    assert report.startswith("unfused") and "model.layers.0.input_layernorm" in report, report
    _assert_same_training(model, ref, device)


def test_a_different_activation_stays(device):
    ref = tiny.build("llama")
    for layer in ref.model.layers:
        layer.mlp.act_fn = nn.Mish()
    ref = ref.to(device)
    model = _optimized(copy.deepcopy(ref))
    assert "forward" not in model.model.layers[0].mlp.__dict__
    assert onepass.optimize_report(model)["activation"].startswith("n/a") or \
        onepass.optimize_report(model)["activation"].startswith("unfused")
    _assert_same_training(model, ref, device)


def _subclass_with_forward(module: nn.Module, forward) -> None:
    """Give ``module`` a class of its own whose forward is ``forward`` (as a family that differs would)."""
    module.__class__ = type("Different" + type(module).__name__, (type(module),), {"forward": forward})


def test_a_layer_with_an_extra_scale_stays(device):
    ref = tiny.build("llama")
    for layer in ref.model.layers:
        base_forward = type(layer).forward

        def forward(self, hidden_states, *args, _base=base_forward, **kwargs):
            return _base(self, hidden_states * 1.5, *args, **kwargs)

        _subclass_with_forward(layer, forward)
    ref = ref.to(device)
    model = _optimized(copy.deepcopy(ref))
    assert "forward" not in model.model.layers[0].__dict__
    assert "relative error" in onepass.optimize_report(model)["norm"]
    _assert_same_training(model, ref, device)


def test_an_attention_with_other_rotary_stays(device):
    ref = tiny.build("llama")
    for layer in ref.model.layers:
        base_forward = type(layer.self_attn).forward

        def forward(self, hidden_states, position_embeddings, *args, _base=base_forward, **kwargs):
            cos, sin = position_embeddings
            return _base(self, hidden_states, (cos, -sin), *args, **kwargs)  # rotating the other way

        _subclass_with_forward(layer.self_attn, forward)
    ref = ref.to(device)
    model = _optimized(copy.deepcopy(ref))
    assert "forward" not in model.model.layers[0].self_attn.__dict__
    assert onepass.optimize_report(model)["rope"].startswith("unfused")
    _assert_same_training(model, ref, device)


def test_a_model_on_meta_is_patched_without_a_probe():
    with torch.device("meta"):
        model = tiny.build("qwen3")
    _optimized(model)
    report = onepass.optimize_report(model)
    assert "not probed" in report["rope"] and type(model.model.norm) is onepass.nn.RMSNorm


def test_a_model_whose_own_forward_fails_is_refused_clearly():
    ref = tiny.build("llama")

    def forward(self, *args, **kwargs):
        raise RuntimeError("needs inputs onepass does not give")

    _subclass_with_forward(ref.model.layers[1], forward)
    with pytest.raises(ValueError, match="own forward fails on 8 random tokens.*needs inputs"):
        onepass.optimize(ref)
    assert "forward" not in ref.model.layers[0].__dict__  # nothing was patched
