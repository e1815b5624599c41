"""onepass.optimize on tiny random models of every family: same logits, loss and every
parameter gradient as the unoptimized model, the same training curve, checkpoints that
load both ways, undo, switches, reference mode, torch.compile, generate, checkpointing."""

from __future__ import annotations

import copy
import pathlib
import warnings

import pytest
import tiny_models as tiny
import torch
import transformers as tf

import onepass
from onepass.models.cache import cache_keyword
from onepass.testing import TOLERANCE, assert_close, rel_error

pytest.importorskip("transformers")

FAMILIES = list(tiny.CONFIGS)
CORPUS = pathlib.Path(__file__).parent / "data" / "corpus.txt"
# fp32 kernels vs PyTorch: one layer of rounding per fused op, summed over 2 layers
SCALE = 20


def _batch(batch=2, seq=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, tiny.VOCAB, (batch, seq), generator=g)


def _pair(family, device, **switches):
    ref = tiny.build(family).to(device)
    model = copy.deepcopy(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "partly fused" while some ops are missing: checked in the report test
        onepass.optimize(model, **switches)
    return model, ref


def _assert_close(out, ref, name):
    err = rel_error(out, ref)
    assert err <= TOLERANCE[torch.float32] * SCALE, f"{name}: relative error {err:.3g}"


def _loss_and_grads(model, ids):
    model.train()
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_loss_and_gradients_match(family, device):
    model, ref = _pair(family, device)
    ids = _batch().to(device)
    model.eval(), ref.eval()
    with torch.no_grad():
        _assert_close(model(ids).logits, ref(ids).logits, "logits")
    loss, grads = _loss_and_grads(model, ids)
    ref_loss, ref_grads = _loss_and_grads(ref, ids)
    _assert_close(loss, ref_loss, "loss")
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        assert g is not None, f"no gradient for {name}"
        _assert_close(g, ref_grads[name], f"d {name}")


@pytest.mark.parametrize("family, norms", [
    ("llama", ("input_layernorm", "post_attention_layernorm")),
    ("gemma2", ("input_layernorm", "pre_feedforward_layernorm")),
    ("gpt2", ("ln_1", "ln_2")),
])
def test_norm_hooks_see_hf_tensors_and_may_replace_the_output(family, norms, device):
    """Forward hooks on a layer's fused norms, one registered before optimize (on the module it
    swaps out) and one after, see the input and output HF's layer gives them, and an output
    they replace is used: loss and every gradient match HF with the same hooks (recompute on)."""
    ref = tiny.build(family).to(device)
    model = copy.deepcopy(ref)
    seen = {"ref": [], "model": []}

    def hook(tag):
        def scale(module, args, out):
            seen[tag].append((args[0].detach(), out.detach()))
            return out * 1.5
        return scale

    def layer(m):
        return (m.transformer.h if family == "gpt2" else m.model.layers)[0]

    getattr(layer(ref), norms[0]).register_forward_hook(hook("ref"))
    getattr(layer(model), norms[0]).register_forward_hook(hook("model"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        onepass.optimize(model)
    getattr(layer(ref), norms[1]).register_forward_hook(hook("ref"))
    getattr(layer(model), norms[1]).register_forward_hook(hook("model"))
    ids = _batch().to(device)
    loss, grads = _loss_and_grads(model, ids)
    ref_loss, ref_grads = _loss_and_grads(ref, ids)
    assert len(seen["model"]) == len(seen["ref"]) == 2
    for (x, y), (x_ref, y_ref) in zip(seen["model"], seen["ref"]):
        _assert_close(x, x_ref, "hooked input")
        _assert_close(y, y_ref, "hooked output")
    _assert_close(loss, ref_loss, "loss")
    for name, g in grads.items():
        _assert_close(g, ref_grads[name], f"d {name}")


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_training_forward_builds_no_kv_cache_unless_asked(family, device):
    model, _ = _pair(family, device)
    ids = _batch().to(device)
    model.train()
    out = model(ids, labels=ids)
    assert getattr(out, cache_keyword()) is None
    asked = model(ids, labels=ids, use_cache=True)
    assert getattr(asked, cache_keyword()) is not None
    torch.testing.assert_close(asked.loss, out.loss)


@pytest.mark.parametrize("family", FAMILIES)
def test_training_forward_never_syncs_on_packed_sequence_check(family, device, monkeypatch):
    """Without a cache HF checks the position ids for packed sequences (``.all()`` on the
    device: a host sync each forward); the training forward hands the base model an unfilled
    cache, so the check never runs and nothing is copied into a cache."""
    import transformers.masking_utils as masking

    calls = []
    check = masking.find_packed_sequence_indices
    monkeypatch.setattr(masking, "find_packed_sequence_indices", lambda *a: calls.append(1) or check(*a))
    model, ref = _pair(family, device)
    model.train(), ref.train()
    ids = _batch().to(device)
    out = model(ids, labels=ids)
    assert calls == []
    assert getattr(out, cache_keyword()) is None
    _assert_close(out.loss, ref(ids, labels=ids).loss, "loss")


def test_training_curve_matches(device):
    """12 AdamW steps on the shipped corpus (bytes as tokens): the loss curves agree within
    1e-3 absolute at every step (fp32; rounding differences compound through the updates),
    and the model learns (the last loss is well below the first).

    On the CPU the rope kernel stays off here: the interpreter runs it one program per
    token (~1 s a step at this size); its outputs and gradients are checked per family above.
    """
    data = torch.tensor(list(CORPUS.read_bytes()), dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, len(data) - 9, (12, 2), generator=g)
    switches = {"rope": False} if device == "cpu" else {}
    curves = []
    for optimized in (False, True):
        model = tiny.build("llama").to(device)
        if optimized:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                onepass.optimize(model, **switches)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        curve = []
        for step in range(len(starts)):
            ids = torch.stack([data[s:s + 8] for s in starts[step]]).to(device)
            loss = model(ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            curve.append(loss.item())
        curves.append(torch.tensor(curve))
    ref, ours = curves
    assert (ours - ref).abs().max() < 1e-3, f"curves differ: {ref.tolist()} vs {ours.tolist()}"
    assert ours[-5:].mean() < ours[:5].mean() - 0.5


@pytest.mark.parametrize("family", ["qwen3", "gemma2", "gpt2"])
def test_state_dict_round_trip(family, device, tmp_path):
    model, ref = _pair(family, device)
    assert list(model.state_dict()) == list(ref.state_dict())
    # optimized -> file -> a fresh unoptimized model, and back into a fresh optimized one
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    torch.save(model.state_dict(), tmp_path / "ckpt.pt")
    state = torch.load(tmp_path / "ckpt.pt")
    plain = tiny.build(family, seed=5).to(device)
    plain.load_state_dict(state)
    fresh, _ = _pair(family, device)
    fresh.load_state_dict(plain.state_dict())
    ids = _batch().to(device)
    for m in (model, plain, fresh):
        m.eval()
    with torch.no_grad():
        expected = plain(ids).logits
        _assert_close(model(ids).logits, expected, "optimized logits")
        _assert_close(fresh(ids).logits, expected, "reloaded optimized logits")


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "gpt2"])
def test_undo_restores_the_model(family, device):
    model, ref = _pair(family, device)
    kinds = {n: type(m) for n, m in ref.named_modules()}
    onepass.undo(model)
    assert {n: type(m) for n, m in model.named_modules()} == kinds
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert model.config._attn_implementation == ref.config._attn_implementation
    ids = _batch().to(device)
    model.eval(), ref.eval()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
    with pytest.raises(RuntimeError, match="not optimized"):
        onepass.undo(model)
    onepass.optimize(model, rope=False)  # optimizable again after undo
    with pytest.raises(RuntimeError, match="already optimized"):
        onepass.optimize(model)


def test_models_sharing_a_config_object_are_optimized_and_undone_apart(device):
    """from_config shares its config object between the models it builds; optimizing one (its attention
    switch writes the config) must leave the other as it is, and each undo restore its own model only."""
    config = tiny.CONFIGS["llama"]()
    first, second = (tf.AutoModelForCausalLM.from_config(config).to(device) for _ in range(2))
    assert first.config is second.config
    before = config._attn_implementation
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        onepass.optimize(first)
        assert first.config._attn_implementation == "onepass"
        assert second.config._attn_implementation == before and config._attn_implementation == before
        assert all(m.config is first.config for m in first.modules() if "config" in m.__dict__)
        onepass.optimize(second)
        onepass.undo(first)
    assert first.config is config and config._attn_implementation == before
    assert second.config._attn_implementation == "onepass"
    onepass.undo(second)
    assert second.config is config and config._attn_implementation == before


def test_attention_reported_unfused_where_transformers_keeps_its_own(device):
    """Falcon refuses set_attn_implementation after loading (transformers logs why): the report says
    attention is unfused, as it runs (it said fused)."""
    model = tf.AutoModelForCausalLM.from_config(tf.FalconConfig(vocab_size=tiny.VOCAB, hidden_size=32,
                                                                num_hidden_layers=1, num_attention_heads=4)).to(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        onepass.optimize(model)
    assert model.config._attn_implementation != "onepass"
    assert onepass.optimize_report(model)["attention"].startswith("unfused")


def test_switches_and_report(device):
    model, ref = _pair("llama", device, norm=False, activation=False, rope=False, attention=False, loss=False,
                       lora=False, recompute=False)
    assert onepass.optimize_report(model) == dict.fromkeys(onepass.patching.SWITCHES, "off")
    assert [type(m) for m in model.modules()] == [type(m) for m in ref.modules()]
    model, _ = _pair("llama", device, activation=False)
    report = onepass.optimize_report(model)
    assert report["activation"] == "off" and report["norm"].startswith("fused")
    assert "forward" not in model.model.layers[0].mlp.__dict__
    assert type(model.model.layers[0].input_layernorm) is onepass.nn.RMSNorm
    for status in report.values():
        assert status.startswith(("fused", "unfused", "n/a", "off", "on")), status


def test_float64_model_is_refused():
    """The kernels take float32/16/bf16: a float64 model was accepted, then failed in the first forward."""
    model = tiny.build("llama").double()
    with pytest.raises(TypeError, match="float64"):
        onepass.optimize(model)
    assert not hasattr(model, "_onepass_state")


def test_model_dispatched_by_accelerate_is_refused(tmp_path):
    """A device_map that offloads (or splits across GPUs) leaves accelerate's hooks moving weights
    and inputs in the modules' forwards, which optimize replaces: refused with a clear error (the
    patched model read meta weights deep in a kernel's checks)."""
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM

    tiny.build("llama").save_pretrained(tmp_path / "model")
    layers = {f"model.layers.{i}": "cpu" if i == 0 else "disk" for i in range(2)}
    device_map = {"model.embed_tokens": "cpu", **layers, "model.norm": "cpu", "model.rotary_emb": "cpu",
                  "lm_head": "cpu"}
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model", device_map=device_map,
                                                 offload_folder=str(tmp_path / "offload"))
    with pytest.raises(ValueError, match="dispatched by accelerate"):
        onepass.optimize(model)
    assert not hasattr(model, "_onepass_state")


def test_a_model_on_the_cpu_without_the_interpreter_is_warned_about(monkeypatch):
    """There every op runs its PyTorch reference: the report's "fused" would be all the user saw."""
    from onepass.ops import dispatch

    monkeypatch.setattr(dispatch, "_INTERPRETING", False)
    with pytest.warns(UserWarning, match="on the CPU"):
        onepass.optimize(tiny.build("llama"))


def test_a_transformers_release_outside_the_tested_range_is_warned_about(monkeypatch):
    """The hf extra's range is read from onepass's installed metadata: a release outside it
    (here: a range that excludes the installed one) is warned about, one inside it is not."""
    from importlib import metadata

    import transformers

    def requires(ranges):
        monkeypatch.setattr(metadata, "requires", lambda name: ["numpy", f'transformers{ranges}; extra == "hf"'])

    requires(f"<{transformers.__version__}")
    with pytest.warns(UserWarning, match=f"transformers {transformers.__version__} is not among the releases"):
        onepass.optimize(tiny.build("llama"))
    requires(f">=5,<={transformers.__version__}")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert onepass.patching.untested_transformers() is None


def test_partly_fused_warns_what_stays_unfused(device, monkeypatch):
    monkeypatch.delattr(onepass.ops, "rope")
    model = tiny.build("llama").to(device)
    with pytest.warns(UserWarning, match="rope: unfused"):
        onepass.optimize(model)
    assert onepass.optimize_report(model)["rope"].startswith("unfused")


def test_unknown_family_is_a_clear_error():
    from transformers import BertConfig, BertModel

    model = BertModel(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                 intermediate_size=32))
    with pytest.raises(ValueError, match="BertModel has no list of decoder layers.*decoder-only causal LMs"):
        onepass.optimize(model)
    with pytest.raises(TypeError, match="Hugging Face"):
        onepass.optimize(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("how", ["context", "env"])
def test_reference_mode_runs_the_pytorch_reference(how, device, monkeypatch):
    calls = []
    real = onepass.reference.add_rms_norm

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(onepass.reference, "add_rms_norm", spy)
    model, ref = _pair("llama", device)
    calls.clear()  # optimize's probe runs the references
    ids = _batch().to(device)
    model.eval(), ref.eval()
    with torch.no_grad():
        model(ids)
        assert not calls  # the Triton kernels ran
        if how == "env":
            monkeypatch.setenv("ONEPASS_REFERENCE", "1")
            out = model(ids).logits
        else:
            with onepass.reference_mode():
                out = model(ids).logits
        assert len(calls) == 2  # one add_rms_norm a layer
        _assert_close(out, ref(ids).logits, "reference-mode logits")


def test_gradient_checkpointing(device):
    model, ref = _pair("llama", device)
    model.gradient_checkpointing_enable()
    ref.gradient_checkpointing_enable()
    ids = _batch().to(device)
    loss, grads = _loss_and_grads(model, ids)
    ref_loss, ref_grads = _loss_and_grads(ref, ids)
    _assert_close(loss, ref_loss, "loss")
    for name, g in grads.items():
        _assert_close(g, ref_grads[name], f"d {name}")


@pytest.mark.parametrize("family", ["qwen3", "gemma2", "mistral"])
def test_generate_matches(family, device):
    """HF's generate (a dynamic cache: a prompt, then one query a step, to which HF hands no
    mask), soft-capped Gemma 2 and sliding-window Mistral included."""
    model, ref = _pair(family, device)
    ids = _batch(batch=1, seq=5).to(device)
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kw), ref.generate(ids, **kw))


@pytest.mark.parametrize("family", ["gemma2", "llama"])
def test_static_cache_prefill_matches(family, device):
    """A prompt into a static cache much longer than it: HF hands the full-attention layers
    no mask (SDPA's is_causal covers it), so onepass's fallbacks must spell the causal mask
    out (Gemma 2's soft-capped eager path attended to every slot before)."""
    from transformers import StaticCache

    model, ref = _pair(family, device)
    model.eval(), ref.eval()
    ids = _batch().to(device)
    with torch.no_grad():
        got = model(ids, **{cache_keyword(): StaticCache(config=model.config, max_cache_len=64)}).logits
        want = ref(ids, **{cache_keyword(): StaticCache(config=ref.config, max_cache_len=64)}).logits
    _assert_close(got, want, "logits")


def test_cache_found_under_either_keyword(device):
    """transformers 5.24 renamed the KV cache's keyword to ``cache`` (its forwards still take
    ``past_key_values``, deprecated): an optimized model's layers find the cache under either
    name, as HF's do. A prompt into a static cache, then one token that must read it."""
    from transformers import StaticCache

    model, ref = _pair("llama", device)
    model.eval(), ref.eval()
    ids = _batch(batch=1, seq=6).to(device)
    for name in dict.fromkeys((cache_keyword(), "past_key_values")):
        caches = {m: StaticCache(config=m.config, max_cache_len=16) for m in (model, ref)}
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            for m, cache in caches.items():
                m(ids[:, :5], **{name: cache})
            got, want = (m(ids[:, 5:], **{name: cache}).logits for m, cache in caches.items())
        _assert_close(got, want, f"logits of a step reading the cache passed as {name}")


@pytest.mark.parametrize("family", ["gemma2", "mistral"])
def test_attention_dropout_keeps_the_masks(family, device):
    """With attention dropout the kernel hands over to SDPA / eager attention, which must get
    the causal and sliding-window mask the kernel would apply (a dropout too small to drop
    anything, so the loss must match; a changed last token must not move earlier logits)."""
    import transformers as tf

    config = tiny.CONFIGS[family]()
    config.attention_dropout = 1e-9
    torch.manual_seed(0)
    ref = tf.AutoModelForCausalLM.from_config(config).float().to(device).train()
    model = copy.deepcopy(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        onepass.optimize(model)
    ids = _batch().to(device)
    _assert_close(model(ids, labels=ids).loss, ref(ids, labels=ids).loss, "loss")
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % tiny.VOCAB
    with torch.no_grad():
        assert torch.equal(model(ids).logits[:, :-1], model(changed).logits[:, :-1])


def test_deepcopy_runs_its_own_weights_and_undoes_itself(device):
    """A deepcopy of an optimized model (EMA weights, a frozen reference) computes with its own
    parameters, and undoing it leaves the original optimized."""
    model, ref = _pair("llama", device)
    model.eval()
    twin = copy.deepcopy(model)
    ids = _batch().to(device)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
        assert not torch.equal(twin(ids).logits, model(ids).logits)
        onepass.undo(twin)
        assert model.config._attn_implementation == "onepass" and twin.config._attn_implementation != "onepass"
        _assert_close(model(ids).logits, ref.eval()(ids).logits, "the original's logits")


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_whole_model_pickles_optimized(family, device, tmp_path):
    """torch.save(model) of an optimized model loads as an optimized model computing the same
    logits (its patched forwards were bound local functions, which pickle could not find)."""
    model, _ = _pair(family, device)
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert onepass.optimize_report(loaded) == onepass.optimize_report(model)
    assert all(type(a.__dict__.get("forward")) is type(b.__dict__.get("forward"))
               for a, b in zip(loaded.modules(), model.modules()))
    ids = _batch().to(device)
    model.eval(), loaded.eval()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    onepass.undo(loaded)
    assert not any("forward" in m.__dict__ for m in loaded.modules())


def test_whole_model_loads_in_a_fresh_process(device, tmp_path):
    """The loading process never ran optimize: the "onepass" attention it names must be set up
    by the load itself (it raised KeyError: not a registered attention implementation)."""
    import subprocess
    import sys

    model, _ = _pair("llama", device)
    model.eval()
    ids = _batch().to(device)
    with torch.no_grad():
        expected = model(ids).logits
    torch.save({"model": model, "ids": ids, "expected": expected}, tmp_path / "saved.pt")
    code = ("import sys, torch\n"
            "saved = torch.load(sys.argv[1], weights_only=False)\n"
            "with torch.no_grad():\n"
            "    out = saved['model'](saved['ids']).logits\n"
            "assert torch.allclose(out, saved['expected'], rtol=1e-4, atol=1e-4), "
            "(out - saved['expected']).abs().max()\n")
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path / "saved.pt")], capture_output=True, text=True,
                         check=False, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_patched_forwards_show_hf_signatures(family, device):
    """HF reads the forward's signature: Trainer drops the dataset columns it does not name
    (attention_mask was dropped), generate passes logits_to_keep only when it is named."""
    import inspect

    model, ref = _pair(family, device)
    patched = [(mine, theirs) for mine, theirs in zip(model.modules(), ref.modules()) if "forward" in mine.__dict__]
    assert len(patched) > 3  # the model, its layers, their attention and MLP blocks
    for mine, theirs in patched:
        assert inspect.signature(mine.forward) == inspect.signature(theirs.forward), type(theirs).__name__
    assert model._supports_logits_to_keep()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_packed_sequences_stay_apart_in_training(family, device):
    """A padding-free batch (two documents in one row, position ids restarting, no attention mask,
    as DataCollatorWithFlattening makes it) with the cache off: HF masks attention between the
    documents, and so does the optimized model (its stand-in cache switched HF's check off)."""
    model, ref = _pair(family, device)
    ids = _batch(batch=1, seq=12).to(device)
    positions = torch.cat([torch.arange(5), torch.arange(7)])[None].to(device)
    labels = ids.clone()
    labels[0, 5] = -100  # each document's first token is no target of the one before
    for m in (model, ref):
        m.train()
        m.zero_grad(set_to_none=True)
        m(ids, position_ids=positions, labels=labels, use_cache=False).loss.backward()
    _assert_close(model(ids, position_ids=positions, labels=labels, use_cache=False).loss,
                  ref(ids, position_ids=positions, labels=labels, use_cache=False).loss, "loss")
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        _assert_close(p.grad, q.grad, f"d {name}")


def test_signature_survives_a_wrapper_of_the_forward(device):
    """accelerate's mixed precision (Trainer(bf16=True), Accelerator.prepare) replaces forward by
    a functools.wraps wrapper of ``model.forward.__func__`` bound to the model; its signature
    (which generate and a later Trainer read) must still be HF's."""
    import functools
    import inspect
    import types

    model, ref = _pair("llama", device)
    inner = model.forward.__func__

    @functools.wraps(inner)
    def mixed_precision_forward(*args, **kwargs):
        return inner(*args, **kwargs)

    model.forward = types.MethodType(mixed_precision_forward, model)
    assert inspect.signature(model.forward) == inspect.signature(ref.forward)
    ids = _batch().to(device)
    _assert_close(model(ids, labels=ids).loss, ref(ids, labels=ids).loss, "loss")


def test_training_loss_is_float32_as_hf(device):
    """HF's causal-LM loss upcasts the logits: a float32 loss under 16-bit autocast, where the
    fused loss came back rounded to bfloat16 (and a summed one, Trainer's num_items_in_batch,
    overflowed in float16). Reference mode: the interpreter's 16-bit dots are not exact."""
    model, ref = _pair("llama", device)
    ids = _batch().to(device)
    with onepass.reference_mode(), torch.autocast(device, dtype=torch.bfloat16):
        loss, expected = model(ids, labels=ids).loss, ref(ids, labels=ids).loss
        items = torch.tensor(ids.numel())
        summed, expected_summed = (m(ids, labels=ids, num_items_in_batch=items).loss for m in (model, ref))
    assert loss.dtype == expected.dtype == summed.dtype == torch.float32
    assert_close(loss, expected, torch.bfloat16)
    assert_close(summed, expected_summed, torch.bfloat16)


def test_export_of_an_optimized_model(device):
    """torch.export (non-strict) reads each module's forward.__code__, through the patched forward."""
    model, ref = _pair("llama", device)
    model.eval(), ref.eval()
    ids = _batch().to(device)
    exported = torch.export.export(model, (ids,), kwargs={"use_cache": False})
    with torch.no_grad():
        _assert_close(exported.module()(ids, use_cache=False).logits, ref(ids).logits, "logits")


def test_a_module_whose_own_forward_computes_something_else_keeps_it(device):
    """A forward set on one instance (here a builtin, which inspect cannot read) is probed on its
    own: it computes something else than the MLP, so it stays, and the other MLPs are fused."""
    model, ref = _pair("llama", device)
    onepass.undo(model)
    model.model.layers[0].mlp.forward = ref.model.layers[0].mlp.forward = torch.sigmoid
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        onepass.optimize(model)
    assert model.model.layers[0].mlp.__dict__["forward"] is torch.sigmoid
    assert type(model.model.layers[1].mlp.__dict__["forward"]).__name__ == "InstanceForward"
    assert "relative error" in onepass.optimize_report(model)["activation"]
    ids = _batch().to(device)
    _assert_close(_loss_and_grads(model, ids)[0], _loss_and_grads(ref, ids)[0], "loss")


def test_labels_passed_positionally(device):
    """As HF's forward takes them: (input_ids, attention_mask, position_ids, past_key_values,
    inputs_embeds, labels)."""
    model, ref = _pair("llama", device)
    ids = _batch().to(device)
    args = (ids, torch.ones_like(ids), None, None, None, ids)
    _assert_close(model(*args).loss, ref(*args).loss, "loss")


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_output_attentions_returns_the_weights(family, device):
    """output_attentions=True gets the attention weights HF's eager attention returns (the
    fused kernels never form them; they came back empty, without a word)."""
    model, ref = _pair(family, device)
    ref.set_attn_implementation("eager")
    model.eval(), ref.eval()
    ids = _batch().to(device)
    with torch.no_grad():
        out, expected = model(ids, output_attentions=True), ref(ids, output_attentions=True)
    assert len(out.attentions) == len(expected.attentions) == ref.config.num_hidden_layers
    for i, (a, b) in enumerate(zip(out.attentions, expected.attentions)):
        _assert_close(a, b, f"layer {i} attention weights")
    _assert_close(out.logits, expected.logits, "logits")


def test_return_dict_false_keeps_hf_tuple_positions(device):
    """A training forward with labels and return_dict=False: (loss, logits, ...) as HF's tuple,
    the logits' place held by None (the fused loss never forms them), not the next output."""
    model, ref = _pair("llama", device)
    model.train(), ref.train()
    ids = _batch().to(device)
    out, expected = model(ids, labels=ids, return_dict=False), ref(ids, labels=ids, return_dict=False)
    _assert_close(out[0], expected[0], "loss")
    assert out[1] is None and expected[1].shape == (*ids.shape, tiny.VOCAB)
    hidden = model(ids, labels=ids, return_dict=False, output_hidden_states=True)
    assert hidden[1] is None and len(hidden[2]) == ref.config.num_hidden_layers + 1


def test_torch_compile_fullgraph(device):
    model, ref = _pair("llama", device)
    model.eval(), ref.eval()
    ids = _batch().to(device)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    with torch.no_grad():
        _assert_close(compiled(ids).logits, ref(ids).logits, "compiled logits")


@pytest.mark.parametrize("family", FAMILIES)
def test_torch_compile_training_step_fullgraph(family, device):
    """A training forward with labels (the fused loss, the unfilled cache) compiles as one
    graph, and its loss and gradients match the unoptimized model's, for every family (the
    projection nodes inside it: q/k/v biases in Qwen2, GeGLU and soft-caps in Gemma 2)."""
    model, ref = _pair(family, device)
    model.train(), ref.train()
    ids = _batch().to(device)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    loss = compiled(ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    ref_loss, ref_grads = _loss_and_grads(ref, ids)
    _assert_close(loss, ref_loss, "compiled loss")
    for name, g in ref_grads.items():
        _assert_close(grads[name], g, f"compiled d {name}")


def test_optimize_after_torch_compile(device):
    """optimize on the torch.compile wrapper patches the model inside it, which dynamo then
    compiles: the wrapper itself was patched, its training steps ran eagerly (no graph), and
    undo and optimize both refused it."""
    ref = tiny.build("llama").to(device)
    model = copy.deepcopy(ref)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(model, backend=backend)
    assert onepass.optimize(compiled) is compiled
    model.train(), ref.train()
    ids = _batch().to(device)
    loss = compiled(ids, labels=ids).loss
    assert graphs  # compiled
    _assert_close(loss, _loss_and_grads(ref, ids)[0], "loss")
    onepass.undo(compiled)
    assert "forward" not in vars(model)  # the patched forward gone from the model inside
    onepass.optimize(compiled)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_mixed_precision_autocast(family, compiled, device):
    """fp32 weights under autocast (bf16 on a GPU; fp16 on the CPU, where the interpreter's
    bf16 ``tl.dot`` is wrong, see the GUIDE), eager and compiled: the loss and every
    gradient (fp32, as the parameters) match the unoptimized model's under the same autocast."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    model, ref = _pair(family, device)
    ids = _batch().to(device)

    def step(m):
        m.train()
        backend = "aot_eager" if device == "cpu" else "inductor"
        run = torch.compile(m, fullgraph=True, backend=backend) if compiled else m
        with torch.autocast(device, dtype=dtype):
            loss = run(ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in m.named_parameters()}

    (loss, grads), (ref_loss, ref_grads) = step(model), step(ref)
    assert rel_error(loss, ref_loss) <= TOLERANCE[dtype], "loss"
    for name, g in ref_grads.items():
        assert grads[name].dtype == torch.float32, name
        err = rel_error(grads[name], g)
        assert err <= TOLERANCE[dtype], f"d {name}: relative error {err:.3g}"


def test_torch_compile_runs_the_onepass_attention_kernel(device, monkeypatch):
    """Under torch.compile, HF would materialise the causal mask (its skip test is off while
    tracing) and send attention to SDPA; the onepass mask function leaves it to the kernel."""
    model, ref = _pair("llama", device)
    model.eval(), ref.eval()
    calls = []
    attention = onepass.ops.attention
    monkeypatch.setattr(onepass.ops, "attention", lambda *a, **k: calls.append(1) or attention(*a, **k))
    ids = _batch().to(device)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    with torch.no_grad():
        _assert_close(compiled(ids).logits, ref(ids).logits, "compiled logits")
    assert len(calls) == model.config.num_hidden_layers


def test_onepass_mask_needs_no_mask_without_padding_even_when_hf_would_build_one(monkeypatch):
    """As when HF's skip test is off (tracing on older torch): no mask where the kernel masks
    causally itself; a padding mask or fewer queries than keys still get SDPA's mask."""
    import transformers.masking_utils as masking

    from onepass.models.attention import onepass_mask

    monkeypatch.setattr(masking, "_ignore_causal_mask_sdpa", lambda *a, **k: False)
    kw = dict(batch_size=2, q_offset=0, kv_offset=0, mask_function=masking.causal_mask_function)
    assert onepass_mask(q_length=6, kv_length=6, **kw) is None
    padding = torch.ones(2, 6, dtype=torch.bool)
    padding[0, 0] = False
    assert onepass_mask(q_length=6, kv_length=6, attention_mask=padding, **kw) is not None
    assert onepass_mask(q_length=1, kv_length=6, **kw) is not None


ALL_LLAMA_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# (family, targets, dropout, lora_linear calls a layer: q/k/v and gate/up all adapted run as
# one shared node each instead)
LORA_CASES = [("llama", ["q_proj", "v_proj", "gate_proj"], 0.0, 3),
              ("llama", ALL_LLAMA_PROJECTIONS, 0.1, 2),
              ("llama", ALL_LLAMA_PROJECTIONS, 0.0, 2),
              ("gpt2", ["c_attn", "c_fc"], 0.0, 2)]  # transformers' Conv1D bases (fan_in_fan_out)


def _peft_pair(family, device, config, **switches):
    peft = pytest.importorskip("peft")
    ref = tiny.build(family).to(device)
    torch.manual_seed(3)
    ref = peft.get_peft_model(ref, config)
    model = copy.deepcopy(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's fan_in_fan_out notice for Conv1D
        onepass.optimize(model, **switches)
    return model, ref


@pytest.mark.parametrize("family, targets, dropout, calls_a_layer", LORA_CASES)
def test_peft_lora_layers_run_fused(family, targets, dropout, calls_a_layer, device, monkeypatch):
    """Every LoRA linear runs as lora_linear; loss and every adapter gradient match PEFT's
    (with dropout: the same masks, drawn from the same random stream in the same order)."""
    peft = pytest.importorskip("peft")
    calls = []
    monkeypatch.setattr(onepass.ops, "lora_linear",
                        lambda *a, _op=onepass.ops.lora_linear, **k: calls.append(1) or _op(*a, **k))
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=dropout, init_lora_weights=False,
                          fan_in_fan_out=family == "gpt2")
    model, ref = _peft_pair(family, device, cfg)
    n_layers = sum(type(m).__name__ == "Linear" and hasattr(m, "lora_A") for m in model.modules())
    assert onepass.optimize_report(model)["lora"].startswith(f"fused: {n_layers} of {n_layers}")
    ids = _batch().to(device)
    torch.manual_seed(4)
    loss, grads = _loss_and_grads(model, ids)
    torch.manual_seed(4)
    ref_loss, ref_grads = _loss_and_grads(ref, ids)
    _assert_close(loss, ref_loss, "loss")
    assert len(calls) == calls_a_layer * model.config.num_hidden_layers
    assert any("lora_A" in name for name, g in grads.items() if g is not None)
    for name, g in grads.items():
        if g is not None:
            _assert_close(g, ref_grads[name], f"d {name}")


def test_head_wrapped_or_hooked_after_optimize_is_honoured(device):
    """A LoRA adapter put on lm_head after optimize trains (the fused loss read the head's weight
    through PEFT's wrapper: the adapter was ignored, no gradient); a forward hook on the head is
    called with the logits."""
    peft = pytest.importorskip("peft")
    base, ref = _pair("llama", device)
    cfg = peft.LoraConfig(r=4, target_modules=["q_proj", "lm_head"], init_lora_weights=False)
    torch.manual_seed(3)
    ref = peft.get_peft_model(ref, cfg)
    torch.manual_seed(3)
    model = peft.get_peft_model(base, cfg)
    ids = _batch().to(device)
    loss, grads = _loss_and_grads(model, ids)
    ref_loss, ref_grads = _loss_and_grads(ref, ids)
    _assert_close(loss, ref_loss, "loss")
    head_lora = [n for n in grads if "lm_head.lora" in n]
    assert head_lora and all(grads[n] is not None for n in head_lora)
    for name in head_lora:
        _assert_close(grads[name], ref_grads[name], f"d {name}")
    plain, _ = _pair("llama", device)
    seen = []
    plain.lm_head.register_forward_hook(lambda module, inputs, out: seen.append(out.shape))
    plain.train()
    plain(ids, labels=ids)
    assert seen == [(*ids.shape, tiny.VOCAB)]


def test_head_replaced_after_optimize_trains_as_hugging_face(device):
    """A new lm_head put in after optimize (resize_token_embeddings of an untied model puts in a new
    nn.Linear) lacks the patched forward: the loss runs Hugging Face's, with a warning (it was a
    TypeError from the fused path calling the plain head with the loss's arguments)."""
    model, ref = _pair("llama", device)
    torch.manual_seed(5)
    head = torch.nn.Linear(32, tiny.VOCAB, bias=False).to(device)
    model.lm_head, ref.lm_head = head, copy.deepcopy(head)
    ids = _batch().to(device)
    with pytest.warns(UserWarning, match="lm_head was replaced"):
        loss, grads = _loss_and_grads(model, ids)
    ref_loss, ref_grads = _loss_and_grads(ref, ids)
    _assert_close(loss, ref_loss, "loss")
    _assert_close(grads["lm_head.weight"], ref_grads["lm_head.weight"], "d lm_head.weight")


def test_peft_lora_falls_back_where_unfused(device):
    """DoRA layers keep PEFT's forward (said in the report); merged adapters and the
    reference mode run PEFT's forward too; undo removes the fused forwards."""
    peft = pytest.importorskip("peft")
    cfg = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False, use_dora=True)
    model, _ = _peft_pair("llama", device, cfg)
    assert onepass.optimize_report(model)["lora"].startswith("unfused: 0 of 4")
    cfg = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model, ref = _peft_pair("llama", device, cfg)
    ids = _batch().to(device)
    model.eval(), ref.eval()
    with torch.no_grad():
        expected = ref(ids).logits
        with onepass.reference_mode():
            _assert_close(model(ids).logits, expected, "logits, reference mode")
        model.merge_adapter()
        _assert_close(model(ids).logits, expected, "logits, merged")
        model.unmerge_adapter()
        _assert_close(model(ids).logits, expected, "logits, unmerged")
        # a hook put on a base layer after optimize: PEFT's forward honours it
        layer = next(m for m in model.modules() if hasattr(m, "lora_A"))
        handle = layer.base_layer.register_forward_hook(lambda module, inputs, out: out)
        _assert_close(model(ids).logits, expected, "logits, a hooked base layer")
        handle.remove()
        # a DoRA adapter added after optimize, then made active: PEFT's forward runs it
        dora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False, use_dora=True)
        for m in (model, ref):
            torch.manual_seed(6)
            m.add_adapter("dora", dora)
            m.set_adapter("dora")
            for name, p in m.named_parameters():
                if "lora_magnitude_vector" in name:
                    p.mul_(1.5)  # DoRA starts equal to plain LoRA; this makes it differ
        _assert_close(model(ids).logits, ref(ids).logits, "logits, a DoRA adapter added later")
    onepass.undo(model)
    assert not any("forward" in m.__dict__ for m in model.modules() if hasattr(m, "lora_A"))


# ------------------------------------------------------------------ GPU, real sizes, bf16


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "gpt2", "phi3", "qwen3_moe"])
def test_bf16_real_size_matches(family):
    """Two layers at real width in bf16: loss and gradients of the optimized model against
    the unoptimized one, both measured against an fp32 copy of the unoptimized model."""
    import transformers as tf

    sizes = dict(vocab_size=32000, num_hidden_layers=2, max_position_embeddings=2048)
    configs = {
        "llama": lambda: tf.LlamaConfig(**sizes, hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
                                        num_key_value_heads=8),
        "qwen3": lambda: tf.Qwen3Config(**sizes, hidden_size=2048, intermediate_size=6144, num_attention_heads=16,
                                        num_key_value_heads=8, head_dim=128),
        "gemma2": lambda: tf.Gemma2Config(**sizes, hidden_size=2304, intermediate_size=9216, num_attention_heads=8,
                                          num_key_value_heads=4, head_dim=256, sliding_window=512),
        "gpt2": lambda: tf.GPT2Config(vocab_size=32000, n_embd=1600, n_layer=2, n_head=25, n_positions=2048,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
        # a dense family of its own parts (one qkv_proj, one gate_up_proj) and a mixture of experts
        "phi3": lambda: tf.Phi3Config(**sizes, hidden_size=3072, intermediate_size=8192, num_attention_heads=32,
                                      num_key_value_heads=32, resid_pdrop=0.0, embd_pdrop=0.0, pad_token_id=0),
        "qwen3_moe": lambda: tf.Qwen3MoeConfig(**sizes, hidden_size=2048, moe_intermediate_size=768, num_experts=128,
                                               num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4,
                                               head_dim=128, norm_topk_prob=True),
    }
    torch.manual_seed(0)
    fp32 = tf.AutoModelForCausalLM.from_config(configs[family]()).cuda().float()
    ref = copy.deepcopy(fp32).bfloat16()
    model = onepass.optimize(copy.deepcopy(ref))
    report = onepass.optimize_report(model)  # the probe recognises every part in bf16 at this size
    assert all(report[k].startswith(("fused", "n/a")) for k in ("norm", "activation", "rope", "loss")), report
    _assert_bf16_as_close_as_hf(fp32, ref, model)


@pytest.mark.gpu
def test_bf16_real_size_lora_matches():
    """Llama-3.2-1B's width, two layers, bf16 base with PEFT's fp32 adapters (rank 16) on all
    seven projections: the fused LoRA layers against PEFT's, both against an fp32 copy."""
    peft = pytest.importorskip("peft")
    import transformers as tf

    config = tf.LlamaConfig(vocab_size=32000, num_hidden_layers=2, max_position_embeddings=2048, hidden_size=2048,
                            intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    torch.manual_seed(0)
    base = tf.AutoModelForCausalLM.from_config(config).cuda().bfloat16()
    ref = peft.get_peft_model(base, peft.LoraConfig(r=16, lora_alpha=32, target_modules=targets,
                                                    init_lora_weights=False))
    assert ref.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"].weight.dtype == torch.float32
    model = onepass.optimize(copy.deepcopy(ref))
    assert onepass.optimize_report(model)["lora"].startswith("fused: 14 of 14")
    _assert_bf16_as_close_as_hf(copy.deepcopy(ref).float(), ref, model)


def _assert_bf16_as_close_as_hf(fp32, ref, model):
    """Loss and every gradient of ``model`` (optimized) no further from the fp32 model's than
    twice the bf16 unoptimized ``ref``'s error, or within the bf16 tolerance."""
    ids = torch.randint(0, 32000, (2, 1024), device="cuda")
    exact_loss, exact = _loss_and_grads(fp32, ids)
    errors = []  # per model: {parameter: relative error of its gradient against fp32}
    for m in (ref, model):
        loss, grads = _loss_and_grads(m, ids)
        assert abs(loss.item() - exact_loss.item()) < 2e-2 * exact_loss.item()
        errors.append({n: rel_error(g.float(), exact[n]) for n, g in grads.items() if g is not None})
    hf_errors, our_errors = errors
    for name, err in our_errors.items():
        # no worse than bf16 HF itself (twice its error), or within the bf16 tolerance
        assert err <= max(2 * hf_errors[name], TOLERANCE[torch.bfloat16]), \
            f"d {name}: {err:.3g} vs HF {hf_errors[name]:.3g}"
