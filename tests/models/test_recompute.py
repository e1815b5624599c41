"""The ``recompute`` switch of onepass.optimize: the norm outputs that feed projections and
the MLP's activation product are not kept for backward but rebuilt there.

On tiny fp32 models: the same loss and bit-identical gradients with it on and off (the
recomputation runs the same kernel on the same stored inputs), the tensors really dead
after the forward, LoRA, torch.compile, and where it must stay off. The mechanism
(``recomputing.with_recomputed``) on plain PyTorch: one recomputation however many ops saved
the tensor, repeated backward, in-place modifications caught, no leak. On a GPU: the peak
memory saved at a mid size in bf16, against the bytes expected.
"""

from __future__ import annotations

import copy
import gc
import warnings
import weakref

import pytest
import tiny_models as tiny
import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef

import onepass
from onepass.models import recompute as recomputing
from onepass.testing import TOLERANCE, rel_error

pytest.importorskip("transformers")

# Per family: the modules whose first input is recomputed (input norm -> q/k/v, post-attention
# norm -> gate/up or the MLP, activation product -> down_proj / c_proj).
CONSUMERS = {
    "llama": ("self_attn.q_proj", "mlp.gate_proj", "mlp.down_proj"),
    "qwen3": ("self_attn.q_proj", "mlp.gate_proj", "mlp.down_proj"),
    "gemma2": ("self_attn.q_proj", "mlp.gate_proj", "mlp.down_proj"),
    "gpt2": ("attn.c_attn", "mlp", "mlp.c_proj"),
}


def _optimized(model, **switches):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return onepass.optimize(model, **switches)


def _layers(model):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.model.layers if hasattr(base, "model") else base.transformer.h


def _watch_inputs(model, family):
    """Weak references to the memory of the first input of every consumer module (the storage,
    not the tensor object: autograd may keep the memory through another tensor), filled by
    forward pre-hooks."""
    refs = []
    for layer in _layers(model):
        for name in CONSUMERS[family]:
            layer.get_submodule(name).register_forward_pre_hook(
                lambda m, args: refs.append(StorageWeakRef(args[0].untyped_storage())))
    return refs


def _step(model, ids, family="llama"):
    """Forward (train) and backward; the liveness of the watched inputs between the two."""
    model.train()
    model.zero_grad(set_to_none=True)
    refs = _watch_inputs(model, family)
    loss = model(ids, labels=ids).loss
    gc.collect()
    alive = [not r.expired() for r in refs]
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, alive


def _pair(family, device, **switches):
    """Two optimized copies of one tiny model: recompute on, recompute off."""
    base = tiny.build(family).to(device)
    return _optimized(copy.deepcopy(base), **switches), _optimized(copy.deepcopy(base), recompute=False, **switches)


def _ids(device, batch=2, seq=12):
    return torch.randint(0, tiny.VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1)).to(device)


def _assert_same(got, expected):
    loss, grads, _ = got
    ref_loss, ref_grads, _ = expected
    assert torch.equal(loss, ref_loss), f"loss {loss.item()} vs {ref_loss.item()}"
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        assert torch.equal(g, ref_grads[name]), f"d {name}: relative difference {rel_error(g, ref_grads[name]):.3g}"


@pytest.mark.parametrize("family", list(CONSUMERS))
def test_same_gradients_and_activations_freed(family, device):
    on, off = _pair(family, device)
    assert onepass.optimize_report(on)["recompute"].startswith("on: ")
    assert onepass.optimize_report(off)["recompute"] == "off"
    ids = _ids(device)
    got, expected = _step(on, ids, family), _step(off, ids, family)
    # bit-identical: each recomputation runs the forward's kernel on the forward's stored inputs
    _assert_same(got, expected)
    assert not any(got[2]), f"recomputed activations kept alive after the forward: {got[2]}"
    assert all(expected[2]), "without recompute the activations must be saved (else the check above is void)"


def test_reference_mode(device):
    """The ops run as their PyTorch references: the recomputation too, with the same result."""
    on, off = _pair("gemma2", device)
    ids = _ids(device)
    with onepass.reference_mode():
        got, expected = _step(on, ids, "gemma2"), _step(off, ids, "gemma2")
    _assert_same(got, expected)
    assert not any(got[2]) and all(expected[2])


def test_with_lora_adapters(device):
    """PEFT LoRA on q, k, v, gate and down: lora_A saves the same input as its base layer."""
    peft = pytest.importorskip("peft")
    on, off = _pair("llama", device)
    cfg = peft.LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "gate_proj", "down_proj"],
                          lora_dropout=0.0, init_lora_weights=False)
    models = []
    for model in (on, off):
        switches = {} if model is on else {"recompute": False}
        onepass.undo(model)
        torch.manual_seed(3)
        model = peft.get_peft_model(model, cfg)
        models.append(_optimized(model, **switches))
    ids = _ids(device)
    got, expected = (_step(m, ids) for m in models)
    _assert_same(got, expected)
    assert any("lora_A" in name for name in got[1])
    assert not any(got[2]) and all(expected[2])


def test_torch_compile_training(device):
    """Compiled, the switch steps aside (Inductor's partitioner decides what to recompute)
    without a graph break (fullgraph): the same loss and gradients as eager."""
    on, _ = _pair("llama", device, rope=device != "cpu")  # the interpreter runs rope a program per token
    ids = _ids(device)
    expected_loss, expected, _ = _step(copy.deepcopy(on), ids)
    compiled = torch.compile(on, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    on.train()
    loss = compiled(ids, labels=ids).loss
    loss.backward()
    assert rel_error(loss.detach(), expected_loss) <= 20 * TOLERANCE[torch.float32]
    grads = dict(on.named_parameters())
    for name, g in expected.items():
        assert rel_error(grads[name].grad, g) <= 20 * TOLERANCE[torch.float32], f"d {name}"


def test_off_where_it_does_not_apply(device, monkeypatch):
    """Nothing is recomputed in eval mode, without grad, or under gradient checkpointing."""
    built = []

    class Spy(recomputing._Recomputed):
        def __init__(self, *args):
            built.append(1)
            super().__init__(*args)

    monkeypatch.setattr(recomputing, "_Recomputed", Spy)
    on, off = _pair("llama", device, rope=False)
    ids = _ids(device)
    on.train()
    on(ids, labels=ids)
    assert len(built) == 4  # the 2 norm outputs a layer (the fused MLP keeps no product): the check below is not void
    built.clear()
    with torch.no_grad():
        on(ids, labels=ids)
    on.eval()
    on(ids, labels=ids).loss.backward()
    assert not built
    on.gradient_checkpointing_enable()
    off.gradient_checkpointing_enable()
    got, expected = _step(on, ids), _step(off, ids)
    assert not built
    _assert_same(got, expected)


def test_report():
    model = _optimized(tiny.build("llama"), norm=False, activation=False, rope=False, attention=False, loss=False)
    assert onepass.optimize_report(model)["recompute"].startswith("n/a")
    status = onepass.optimize_report(_optimized(tiny.build("llama"), activation=False, rope=False))["recompute"]
    assert status.startswith("on: ") and "64 values a token a layer" in status  # 2 x hidden 32
    # plain-linear MLPs run as one node, which never keeps the product: nothing more to recompute
    status = onepass.optimize_report(_optimized(tiny.build("llama"), rope=False))["recompute"]
    assert "64 values a token a layer" in status and "act(gate)" not in status
    # an MLP run as modules (here a hook on up_proj) keeps it unless recomputed
    model = tiny.build("llama")
    model.model.layers[1].mlp.up_proj.register_forward_hook(lambda *a: None)
    status = onepass.optimize_report(_optimized(model, rope=False))["recompute"]
    assert "128 values a token a layer" in status and "act(gate)" in status  # + intermediate 64


# ---------------------------------------------------------------- the mechanism, plain torch


def _consumers(p, w1, w2):
    """Three ops that save p: two linears on its 3-D shape (which save 2-D views) and a product."""
    return (F.linear(p, w1) * F.linear(p, w2)).sum() + (p * p).sum()


def _setup(seed=0):
    g = torch.Generator().manual_seed(seed)
    x, w1, w2 = (torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True)
                 for s in ((2, 3, 4), (5, 4), (5, 4)))
    return x, w1, w2


def test_with_recomputed_once_per_backward():
    calls = []

    def recompute(h):
        calls.append(1)
        return torch.sin(h)

    x, w1, w2 = _setup()
    expected_loss = _consumers(torch.sin(x * 2), w1, w2)
    expected = torch.autograd.grad(expected_loss, (x, w1, w2))

    h = x * 2  # kept anyway: sin's backward saves it
    produced = torch.sin(h)
    ref = StorageWeakRef(produced.untyped_storage())
    loss = recomputing.with_recomputed(lambda p: _consumers(p, w1, w2), produced, recompute, (h,))
    del produced
    assert ref.expired(), "the recomputed tensor's memory is still held after the forward"
    assert torch.equal(loss, expected_loss)
    for _ in range(2):  # retain_graph: every backward recomputes once, for all four saved copies
        calls.clear()
        grads = torch.autograd.grad(loss, (x, w1, w2), retain_graph=True)
        assert len(calls) == 1
        for g, e in zip(grads, expected):
            assert torch.equal(g, e)


def test_with_recomputed_nested_regions():
    x, w1, w2 = _setup(1)
    expected = torch.autograd.grad(_consumers(torch.exp(torch.sin(x)), w1, w2), (x, w1, w2))
    s = torch.sin(x)

    def inner(s):
        e = torch.exp(s)  # saves its output e, with the outer hooks active (our pack runs)
        return recomputing.with_recomputed(lambda p: _consumers(p, w1, w2), e, torch.exp, (s,))

    loss = recomputing.with_recomputed(inner, s, torch.sin, (x,))
    for g, e in zip(torch.autograd.grad(loss, (x, w1, w2)), expected):
        assert torch.equal(g, e)


# the input the activation is recomputed from; a tensor saved as is inside the region (w1,
# by the linears): autograd's own check, which it skips for tensors under hooks, is done by
# the unpack hook
@pytest.mark.parametrize("changed, error", [("h", "modified in place after the forward"),
                                            ("w1", "modified by an inplace operation")])
def test_with_recomputed_catches_in_place_changes(changed, error):
    x, w1, w2 = _setup(2)
    h = x * 2
    loss = recomputing.with_recomputed(lambda p: _consumers(p, w1, w2), torch.sin(h), torch.sin, (h,))
    with torch.no_grad():
        {"h": h, "w1": w1}[changed].add_(1)
    with pytest.raises(RuntimeError, match=error):
        loss.backward()


def test_with_recomputed_does_not_leak_saved_outputs():
    """An op that saves its own output (exp) inside the region must not keep it alive
    through the hooks (a node -> packed -> tensor -> node cycle)."""
    x = torch.randn(3, 4, requires_grad=True)
    h = x * 2
    out = recomputing.with_recomputed(lambda p: torch.exp(p * 3), torch.sin(h), torch.sin, (h,))
    ref = weakref.ref(out)
    del out
    gc.collect()
    assert ref() is None


def test_with_recomputed_steps_aside_under_other_hooks():
    x, w1, w2 = _setup(3)
    calls = []

    def recompute(h):
        calls.append(1)
        return torch.sin(h)

    expected = torch.autograd.grad(_consumers(torch.sin(x * 2), w1, w2), (x, w1, w2))
    with torch.autograd.graph.save_on_cpu():
        h = x * 2
        loss = recomputing.with_recomputed(lambda p: _consumers(p, w1, w2), torch.sin(h), recompute, (h,))
    for g, e in zip(torch.autograd.grad(loss, (x, w1, w2)), expected):
        assert torch.equal(g, e)
    assert not calls


# ------------------------------------------------------------------ GPU, mid size, bf16


def _peak_step(model, ids):
    """Peak memory of one forward + backward above what was allocated before it; loss, grads."""
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = model(ids, labels=ids).loss
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    return peak, loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_bf16_peak_memory_saved(family):
    """Four layers at Llama-3.2-1B's (GPT-2 XL's) width, batch 2 x 2048, bf16: the peak of a
    training step drops by at least 80% of the activation bytes not kept, per layer and token
    2 hidden (Llama: the fused MLP keeps no product, recompute or not) or 2 hidden + intermediate
    (GPT-2) bf16 values; gradients match recompute off within bf16 tolerance."""
    import transformers as tf

    layers, batch, seq = 4, 2, 2048
    if family == "llama":
        config = tf.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=layers,
                                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=seq)
        per_token = 2 * config.hidden_size
    else:
        config = tf.GPT2Config(vocab_size=32000, n_embd=1600, n_layer=layers, n_head=25, n_positions=seq,
                               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        per_token = 2 * config.n_embd + 4 * config.n_embd
    expected = layers * batch * seq * per_token * 2
    torch.manual_seed(0)
    base = tf.AutoModelForCausalLM.from_config(config).cuda().bfloat16().train()
    ids = torch.randint(0, 32000, (batch, seq), device="cuda")
    results = {}
    for recompute in (False, True):
        model = onepass.optimize(copy.deepcopy(base), recompute=recompute)
        _peak_step(model, ids)  # warm-up: kernel compilation, autotuning
        results[recompute] = _peak_step(model, ids)
        del model
        gc.collect()
        torch.cuda.empty_cache()
    (peak_off, loss_off, grads_off), (peak_on, loss_on, grads_on) = results[False], results[True]
    saved = peak_off - peak_on
    print(f"{family}: peak {peak_off / 2**20:.0f} MiB -> {peak_on / 2**20:.0f} MiB, saved {saved / 2**20:.0f} MiB "
          f"of {expected / 2**20:.0f} MiB expected")
    assert saved >= 0.8 * expected, f"saved {saved / 2**20:.0f} MiB, expected {expected / 2**20:.0f} MiB"
    assert rel_error(loss_on.float(), loss_off.float()) <= TOLERANCE[torch.bfloat16]
    for name, g in grads_on.items():
        assert rel_error(g.float(), grads_off[name].float()) <= TOLERANCE[torch.bfloat16], f"d {name}"
