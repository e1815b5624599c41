"""A weight shared by the input embedding and the LM head gets one gradient in the training
forward: the embedding's token rows added into the head's, never a dense embedding
gradient summed by autograd (models/tied_embedding.py)."""

from __future__ import annotations

import copy
import warnings

import pytest
import tiny_models as tiny
import torch
import transformers as tf

import onepass
from onepass.testing import TOLERANCE, rel_error

PAD = 3


def _tied_llama():
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(
        tf.LlamaConfig(**tiny._GATED, tie_word_embeddings=True, pad_token_id=PAD)).float()


def _pair(build, device):
    ref = build().to(device)
    model = copy.deepcopy(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        onepass.optimize(model)
    return model, ref


def _ids(device):
    """Few distinct tokens (each repeated), padding among them."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 8, (2, 12), generator=g)
    ids[0, :3] = PAD
    return ids.to(device)


def _backward(model, ids, steps=1):
    """Runs ``steps`` forward/backward passes (gradients accumulate); how many dense embedding
    gradients the last backward built."""
    model.train()
    model.zero_grad(set_to_none=True)
    for _ in range(steps):
        loss = model(ids, labels=ids).loss
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            loss.backward()
    return sum(e.name == "aten::embedding_dense_backward" for e in prof.events())


def _assert_grads_match(model, ref):
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        err = rel_error(p.grad, r.grad)
        assert err <= TOLERANCE[torch.float32] * 20, f"d {name}: relative error {err:.3g}"


@pytest.mark.parametrize("build, steps", [(_tied_llama, 1), (_tied_llama, 2), (lambda: tiny.build("gemma2"), 1),
                                          (lambda: tiny.build("gpt2"), 1)],
                         ids=["llama", "llama-accumulated", "gemma2-scaled", "gpt2"])
def test_tied_weight_gets_one_gradient(build, steps, device):
    model, ref = _pair(build, device)
    assert model.get_input_embeddings().weight is model.lm_head.weight
    ids = _ids(device)
    dense = _backward(model, ids, steps)
    ref_dense = _backward(ref, ids, steps)
    assert dense == ref_dense - 1  # GPT-2's position embedding keeps its own
    _assert_grads_match(model, ref)


def test_embedding_with_a_hook_keeps_autograd_path(device):
    """A hooked embedding is called as a module: its hook runs, the gradient is still right."""
    model, ref = _pair(_tied_llama, device)
    calls = []
    model.get_input_embeddings().register_forward_hook(lambda *args: calls.append(1))
    ids = _ids(device)
    assert _backward(model, ids) == _backward(ref, ids) == 1
    assert calls == [1]
    _assert_grads_match(model, ref)


def test_autograd_grad_of_the_tied_weight(device):
    model, ref = _pair(_tied_llama, device)
    ids = _ids(device)
    model.train(), ref.train()
    (g,) = torch.autograd.grad(model(ids, labels=ids).loss, [model.lm_head.weight])
    (r,) = torch.autograd.grad(ref(ids, labels=ids).loss, [ref.lm_head.weight])
    assert rel_error(g, r) <= TOLERANCE[torch.float32] * 20


def test_torch_compile_traces_the_one_gradient(device):
    """The tied node is plain PyTorch: traced with fullgraph, the step still builds no dense
    embedding gradient, and the gradients match (aot_eager, so the backward's aten ops are
    there to count; the GPU bench runs inductor)."""
    model, ref = _pair(_tied_llama, device)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    ids = _ids(device)
    assert _backward(compiled, ids) == _backward(ref, ids) - 1
    _assert_grads_match(model, ref)


@pytest.mark.parametrize("uses", ["both", "embeddings", "head"])
def test_tied_node_gradient_with_either_use_alone(uses, device):
    """The node's one gradient equals autograd's sum of F.embedding's and the head's, also when
    only one of its two outputs reaches the loss (the other's gradient is None)."""
    from onepass.ops.tied_embedding import tied_embedding

    weight = torch.randn(10, 4, device=device, dtype=torch.float64, requires_grad=True)
    ids = torch.tensor([[1, 2, 2], [0, 9, 1]], device=device)
    x = torch.randn(3, 4, device=device, dtype=torch.float64)

    def loss(embeds, head):
        terms = {"embeddings": (embeds ** 2).sum(), "head": (x @ head.t()).sin().sum()}
        return sum(terms.values()) if uses == "both" else terms[uses]

    (got,) = torch.autograd.grad(loss(*tied_embedding(weight, ids, 2)), [weight])
    (want,) = torch.autograd.grad(loss(torch.nn.functional.embedding(ids, weight, 2), weight), [weight])
    assert torch.allclose(got, want)
