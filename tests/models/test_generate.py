"""onepass.generate / onepass.Decoder: the tokens of Hugging Face's greedy generate (padded
prompts, end-of-sequence tokens, sliding windows), sampling's settings, reuse of one
Decoder, bad input; on a GPU, the replayed CUDA graph against eager decoding in bf16."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import tiny_models as tiny
import torch

import onepass
from onepass.decoding import CHECK_EVERY, Decoder
from onepass.ops import kv_cache, projections
from onepass.testing import assert_close

pytest.importorskip("transformers")

PAD = 1  # never drawn in prompts below: HF reads a pad id inside a prompt as padding when no mask is given
FAMILIES = sorted({**tiny.CONFIGS, **tiny.MORE_CONFIGS})
# window 5 (on some layers: gemma2, qwen2), under prompts of 7 and 4 to 12 new tokens
SLIDING = ["gemma2", "gemma3_text", "mistral", "qwen2"]
# HF's two likeliest tokens closer than this (fp32 logits of order 0.1 to 1, both sides' rounding
# about 1e-6): a rounding may pick either. Scaling the logits (the LM head) would not widen the
# gap relative to that rounding, which scales with them.
NEAR_TIE = 1e-4


def _prompts(batch=2, seq=7, seed=3, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, tiny.VOCAB, (batch, seq), generator=g).to(device)


def _hf(model, ids, new, **kw):
    return model.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=PAD, **kw)


def _assert_hf_greedy(ours, model, ids, new, near_tie=NEAR_TIE, least_compared=0.5, **kw):
    """``ours`` is HF's greedy continuation of ``ids``, in each row up to the first step where
    HF's two likeliest tokens are a near-tie (there either may be picked; the rest of the row
    follows from it). A share ``least_compared`` of the tokens must be compared, or the test
    would say nothing."""
    out = _hf(model, ids, new, output_logits=True, return_dict_in_generate=True, **kw)
    top2 = torch.stack(out.logits, 1).float().topk(2, -1).values
    margins = top2[..., 0] - top2[..., 1]  # [batch, steps]
    prompt, compared = ids.shape[1], 0
    for row in range(ids.shape[0]):
        ties = (margins[row] < near_tie).nonzero()
        end = prompt + (int(ties[0]) if len(ties) else margins.shape[1])
        assert torch.equal(ours[row, :end], out.sequences[row, :end]), f"row {row}"
        compared += end - prompt
        if not len(ties):
            assert ours.shape[1] == out.sequences.shape[1]
    assert compared >= ids.shape[0] * margins.shape[1] * least_compared, f"{compared} tokens compared"


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_hf(family):
    model = tiny.build(family).eval()
    ids = _prompts()
    _assert_hf_greedy(onepass.generate(model, ids, 12, pad_token_id=PAD), model, ids, 12)


def test_sliding_window_layers_are_full_length_and_sliding():
    """Every layer of the cache is a full-length static layer, indexed by position (graph-safe);
    the sliding ones stay marked sliding, so transformers builds them its sliding-window masks;
    and the decode steps hand onepass attention the lengths."""
    from transformers.cache_utils import StaticLayer

    model = tiny.build("gemma2").eval()
    decoder = Decoder(model, batch_size=2, max_len=20)
    assert [type(layer) for layer in decoder.cache.layers] == [StaticLayer, StaticLayer]
    assert decoder.cache.is_sliding == [t == "sliding_attention" for t in model.config.layer_types] == [True, False]
    assert decoder._lengths is not None and "not a GPU" in decoder.graph_off
    decoder.generate(_prompts(), 10)
    assert all(layer.keys.shape[2] == 20 for layer in decoder.cache.layers)


def test_chunked_attention_layers_refuse_the_graph():
    """A layer whose cache update branches on a host integer (chunked attention) cannot be captured."""
    with pytest.raises(ValueError, match="chunked attention.*host integer"):
        Decoder._why_no_graph(torch.device("cuda"), True, True)
    assert "host integer" in Decoder._why_no_graph(torch.device("cuda"), None, True)
    assert Decoder._why_no_graph(torch.device("cuda"), None, False) is None


def test_decoder_follows_replaced_weights_and_dtype():
    """A Decoder built before the model's tensors were replaced (load_state_dict with assign=True)
    or cast (model.to(dtype)) decodes with the model as it is now, as HF's generate does."""
    model = tiny.build("llama").eval()
    decoder = Decoder(model, batch_size=2, max_len=32, pad_token_id=PAD)
    ids = _prompts()
    decoder.generate(ids, 6)
    other = tiny.build("llama", seed=1).state_dict()
    model.load_state_dict(other, assign=True)
    assert torch.equal(decoder.generate(ids, 6), _hf(model, ids, 6))
    model.to(torch.float64)
    assert torch.equal(decoder.generate(ids, 6), _hf(model, ids, 6))


def _left_padded(batch=3):
    ids = _prompts(batch=batch)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[-1, :1] = 0
    return ids.masked_fill(mask == 0, PAD), mask


@pytest.mark.parametrize("family", ["llama", "gpt2", *SLIDING])
def test_left_padded_prompts_match_hf(family):
    model = tiny.build(family).eval()
    ids, mask = _left_padded()
    ours = onepass.generate(model, ids, 10, attention_mask=mask, pad_token_id=PAD)
    _assert_hf_greedy(ours, model, ids, 10, attention_mask=mask)


# left-padded prompts (decode steps through the mask, every kernel launch interpreted: slow) on one
# family, with both kinds of layer and softcap
@pytest.mark.parametrize("family, padded", [*((f, False) for f in SLIDING), ("gemma2", True)])
def test_optimized_sliding_window_model_matches_hf(family, padded, device, monkeypatch):
    """Kernels through the interpreter on the CPU: the optimized model gives HF's greedy tokens
    of the unoptimized model past the window (prompt 7 + 4 new tokens, window 5); unpadded, its
    decode steps run decode_attention with each layer's window over the full-length cache."""
    ref = tiny.build(family).to(device).eval()
    model = copy.deepcopy(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        onepass.optimize(model)
    windows = []
    decode_attention = onepass.ops.decode_attention
    monkeypatch.setattr(onepass.ops, "decode_attention",
                        lambda *a, window=None, **k: windows.append(window) or decode_attention(*a, window=window, **k))
    ids, mask = _left_padded(batch=2) if padded else (_prompts(), None)
    ids, mask = ids.to(device), mask if mask is None else mask.to(device)
    ours = onepass.generate(model, ids, 4, attention_mask=mask, pad_token_id=PAD, cuda_graph=False)
    _assert_hf_greedy(ours, ref, ids, 4, attention_mask=mask)
    kinds = getattr(ref.config, "layer_types", None) or ["sliding_attention"] * ref.config.num_hidden_layers
    assert windows == ([] if padded else [5 if kind == "sliding_attention" else None for kind in kinds] * 3)


def test_end_of_sequence_matches_hf():
    """Rows ending at different steps get the pad token after their end, and the output
    stops where the last row ended, as HF returns it (past a check of the finished flags)."""
    model = tiny.build("llama").eval()
    ids = _prompts()
    free = onepass.generate(model, ids, 8, eos_token_id=[], pad_token_id=PAD)
    eos = [int(free[0, 7 + 2]), int(free[1, 7 + 5])]  # row 0 ends at its 3rd new token, row 1 by its 6th
    ours = onepass.generate(model, ids, 3 * CHECK_EVERY, eos_token_id=eos, pad_token_id=PAD)
    assert torch.equal(ours, _hf(model, ids, 3 * CHECK_EVERY, eos_token_id=eos))
    assert ours.shape[1] <= 7 + 6 and (ours[0, 7 + 3:] == PAD).all()


def test_decoder_reused_across_calls():
    model = tiny.build("llama").eval()
    decoder = Decoder(model, batch_size=2, max_len=32, pad_token_id=PAD)
    for seq, new in ((7, 10), (4, 20), (7, 10)):
        ids = _prompts(seq=seq, seed=seq)
        assert torch.equal(decoder.generate(ids, new), _hf(model, ids, new))


def test_optimized_model_same_tokens(device, monkeypatch):
    """Kernels through the interpreter on the CPU (fp32): the optimized model decodes the same
    tokens, its decode steps through decode_attention over the static cache (unpadded
    prompts: 2 layers x 3 steps, each appending k and v in its launch, which also applies RoPE,
    so rope itself runs for the prompts only) or, with padded prompts, through SDPA with the
    mask; every forward's MLP (prompt of 14 rows included) through decode_gated_linear, its
    down projection adding the residual stream in the same launch."""
    ref = tiny.build("llama").to(device).eval()
    model = copy.deepcopy(ref)
    ropes, rope = [], onepass.ops.rope
    monkeypatch.setattr(onepass.ops, "rope", lambda *a, **k: ropes.append(1) or rope(*a, **k))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        onepass.optimize(model)
    ropes.clear()  # (optimize's probe ran each attention class once)
    calls = []
    decode_attention = onepass.ops.decode_attention
    monkeypatch.setattr(onepass.ops, "decode_attention",
                        lambda *a, **k: calls.append(k["k_new"] is not None) or decode_attention(*a, **k))
    gated_calls, appends, residual_calls = [], [], []
    decode_gated, decode_linear = projections.decode_gated, projections.decode_linear
    monkeypatch.setattr(projections, "decode_gated", lambda *a: gated_calls.append(1) or decode_gated(*a))
    monkeypatch.setattr(projections, "decode_linear", lambda *a, residual=None: (
        residual_calls.append(1) if residual is not None else None) or decode_linear(*a, residual=residual))
    append = kv_cache.append_to_cache
    monkeypatch.setattr(kv_cache, "append_to_cache", lambda *a: appends.append(1) or append(*a))
    import transformers.masking_utils as masking

    masks, sdpa_mask = [], masking.sdpa_mask
    monkeypatch.setattr(masking, "sdpa_mask", lambda *a, **k: masks.append(1) or sdpa_mask(*a, **k))
    ids = _prompts(device=device)
    eager = {"cuda_graph": False}  # every step through Python, so that the calls are counted
    new = 4  # tokens: the first from the prompt's forward, then new - 1 decode steps
    assert torch.equal(onepass.generate(model, ids, new, **eager), onepass.generate(ref, ids, new, **eager))
    assert len(masks) == 1  # the prompt's: the decode steps read the lengths, and build no mask
    assert calls == [True] * 2 * (new - 1) and not appends  # each step's append in decode attention's launch
    assert len(gated_calls) == len(residual_calls) == 2 * new
    assert len(ropes) == 2  # the prompt's forward (the unoptimized model runs HF's rotary)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    ids = ids.masked_fill(mask == 0, PAD)
    assert torch.equal(onepass.generate(model, ids, new, attention_mask=mask, **eager),
                       onepass.generate(ref, ids, new, attention_mask=mask, **eager))
    assert len(masks) == 1 + new  # padded: the prompt's and every step's
    assert len(calls) == 2 * (new - 1) and not appends  # padded: HF's attention and cache update
    assert len(gated_calls) == len(residual_calls) == 2 * new * 2
    assert len(ropes) == 2 + 2 * new  # padded prompts: every step's rope apart


@pytest.mark.gpu
def test_optimized_model_same_tokens_at_batch_48(monkeypatch):
    """48 sequences (fp32, CUDA graphs): each step's projections through decode_linear's largest
    tile (33 to MAX_ROWS = 64 rows), the same tokens as unoptimized."""
    ref = tiny.build("llama").cuda().eval()
    model = copy.deepcopy(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        onepass.optimize(model)
    rows, decode_gated = [], projections.decode_gated
    monkeypatch.setattr(projections, "decode_gated", lambda x, *a: rows.append(x.numel() // x.shape[-1])
                        or decode_gated(x, *a))
    ids = _prompts(batch=48, device="cuda")
    assert torch.equal(onepass.generate(model, ids, 6), onepass.generate(ref, ids, 6))
    assert 48 in rows


def test_hf_generate_of_an_optimized_model_infers_the_padding_mask(device):
    """HF's generate builds the attention mask from pad_token_id only for a forward whose
    signature names attention_mask: the optimized model's did not, so its padded prompts were
    attended as tokens."""
    ref = tiny.build("llama").to(device).eval()
    model = copy.deepcopy(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        onepass.optimize(model)
    ids = _prompts(device=device)
    ids[0, :3] = PAD
    assert torch.equal(_hf(model, ids, 4), _hf(ref, ids, 4))


@pytest.mark.parametrize("family", ["gemma2", "mistral"])
def test_optimized_model_with_a_cache_far_longer_than_the_prompt(family, device):
    """Soft-capped (Gemma 2) and sliding-window (Mistral) models whose prefill falls back from
    the kernel (the prompt is shorter than the static cache): the same tokens as unoptimized."""
    ref = tiny.build(family).to(device).eval()
    model = copy.deepcopy(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        onepass.optimize(model)
    ids = _prompts(device=device)
    settings = {"pad_token_id": PAD, "cuda_graph": False}
    got, want = (Decoder(m, 2, 64, **settings).generate(ids, 6) for m in (model, ref))
    assert torch.equal(got, want)


def test_hooked_mlp_sees_its_own_output(device):
    """With a forward hook on a layer's MLP, the optimized inference forward hands the hook the
    MLP's output (not the residual sum the decode route would fold into down_proj)."""
    ref = tiny.build("llama").to(device).eval()
    model = copy.deepcopy(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        onepass.optimize(model)
    seen = {}
    for name, m in (("ref", ref), ("model", model)):
        m.model.layers[0].mlp.register_forward_hook(lambda mod, args, out, name=name: seen.setdefault(name, out))
    ids = _prompts(device=device)[:1, :5]
    with torch.no_grad():
        logits = [m(ids).logits for m in (ref, model)]
    assert_close(seen["model"], seen["ref"], torch.float32)
    assert_close(logits[1], logits[0], torch.float32)


# --------------------------------------------------------------------------- sampling


def _decoder(**settings):
    return Decoder(tiny.build("llama").eval(), batch_size=2, max_len=16, **settings)


def test_sampling_follows_the_softmax():
    """The Gumbel-max draw: token frequencies over many rows are the softmax of logits / temperature."""
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0]).expand(40000, 4)
    drawn = _decoder(do_sample=True, temperature=0.5)._scores(logits).argmax(-1)
    freq = torch.bincount(drawn, minlength=4).float() / drawn.numel()
    assert torch.allclose(freq, (logits[0] / 0.5).softmax(-1), atol=0.01)


def test_top_k_and_top_p_keep_the_likeliest():
    logits = torch.tensor([0.5, 0.3, 0.2, 0.0]).log().expand(4000, 4)  # probabilities 0.5, 0.3, 0.2, 0
    top_k = _decoder(do_sample=True, top_k=2)._scores(logits).argmax(-1)
    assert set(top_k.tolist()) == {0, 1}
    # smallest set reaching 0.7: {0, 1}; reaching 0.5: {0}
    assert set(_decoder(do_sample=True, top_p=0.7)._scores(logits).argmax(-1).tolist()) == {0, 1}
    assert set(_decoder(do_sample=True, top_p=0.5)._scores(logits).argmax(-1).tolist()) == {0}


def test_sampling_reproducible_and_top_k_1_is_greedy():
    model = tiny.build("llama").eval()
    ids = _prompts()
    torch.manual_seed(0)
    first = onepass.generate(model, ids, 8, do_sample=True, temperature=1.5)
    torch.manual_seed(0)
    assert torch.equal(onepass.generate(model, ids, 8, do_sample=True, temperature=1.5), first)
    greedy = onepass.generate(model, ids, 8)
    assert torch.equal(onepass.generate(model, ids, 8, do_sample=True, top_k=1), greedy)


# --------------------------------------------------------------------------- bad input


def test_bad_input_raises_clearly():
    model = tiny.build("llama").eval()
    ids = _prompts()
    decoder = Decoder(model, batch_size=2, max_len=12)
    with pytest.raises(ValueError, match="batch_size=2"):
        decoder.generate(_prompts(batch=3), 2)
    with pytest.raises(ValueError, match="max_len=12"):
        decoder.generate(ids, 6)
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="max_new_tokens"):
            decoder.generate(ids, bad)
    assert decoder.generate(ids, np.int64(2)).shape == (2, ids.shape[1] + 2)
    with pytest.raises(TypeError, match="input_ids"):
        decoder.generate(ids.float(), 2)
    right = torch.ones_like(ids)
    right[0, -2:] = 0
    with pytest.raises(ValueError, match="left"):
        decoder.generate(ids, 2, attention_mask=right)
    with pytest.raises(ValueError, match="attention_mask"):
        decoder.generate(ids, 2, attention_mask=right[:, :3])
    empty = torch.ones_like(ids)
    empty[1] = 0
    with pytest.raises(ValueError, match="row of zeros"):  # it was told it padded on the right
        decoder.generate(ids, 2, attention_mask=empty)
    for bad, match in (({"temperature": 0.0}, "temperature"), ({"top_p": 0.0}, "top_p"),
                       ({"top_k": 0}, "top_k"), ({"cuda_graph": True}, "cuda_graph"),
                       ({"temperature": None}, "temperature"), ({"top_p": None}, "top_p"),
                       ({"temperature": float("nan")}, "temperature"), ({"batch_size": True}, "batch_size"),
                       ({"pad_token_id": tiny.VOCAB}, "pad_token_id"), ({"eos_token_id": [2, -1]}, "eos_token_id")):
        with pytest.raises(ValueError, match=match):
            Decoder(model, **{"batch_size": 2, "max_len": 12, **bad})
    with pytest.raises(TypeError, match="causal LM"):
        Decoder(torch.nn.Linear(2, 2), batch_size=1, max_len=4)
    with pytest.raises(TypeError, match="causal LM"):  # a base model: no LM head (it failed at generate)
        Decoder(model.base_model, batch_size=1, max_len=4)


# --------------------------------------------------------------------- GPU, bf16, graphs


def _bf16_model(family: str):
    import transformers as tf

    configs = {
        "llama": lambda: tf.LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=4096,
                                        num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4),
        "gpt2": lambda: tf.GPT2Config(vocab_size=32000, n_embd=1024, n_layer=4, n_head=16),
        # sliding and full layers, softcaps; prompts of 64 and 100 new tokens pass the window
        "gemma2": lambda: tf.Gemma2Config(vocab_size=32000, hidden_size=1024, intermediate_size=4096,
                                          num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4,
                                          head_dim=64, sliding_window=32),
    }
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(configs[family]()).cuda().bfloat16().eval()


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma2"])
@pytest.mark.parametrize("optimized", [False, True])
def test_graph_replay_matches_eager(family, optimized):
    """bf16: the captured step gives the eager loop's tokens, over several calls of one
    Decoder (prompts padded or not: two graphs), with rows ending on their end token."""
    model = _bf16_model(family)
    if optimized:
        onepass.optimize(model)
    ids = torch.randint(2, 32000, (4, 64), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :20] = 0
    eager = Decoder(model, batch_size=4, max_len=256, cuda_graph=False, eos_token_id=[])
    graphed = Decoder(model, batch_size=4, max_len=256, eos_token_id=[])
    assert graphed.graph_off is None
    for attention_mask in (None, mask, None):
        want = eager.generate(ids, 100, attention_mask=attention_mask)
        assert torch.equal(graphed.generate(ids, 100, attention_mask=attention_mask), want)
    assert set(graphed._graphs) == {False, True}
    # new weights at new addresses: the replayed step must read them, not the captured ones
    model.load_state_dict({k: v * 0.5 for k, v in model.state_dict().items()}, assign=True)
    fresh = Decoder(model, batch_size=4, max_len=256, cuda_graph=False, eos_token_id=[]).generate(ids, 100)
    assert torch.equal(graphed.generate(ids, 100), fresh)
    eos = [int(want[0, 64 + 10]), int(want[2, 64 + 40])]
    ended = [Decoder(model, batch_size=4, max_len=256, eos_token_id=eos, cuda_graph=g).generate(ids, 100)
             for g in (False, None)]
    assert torch.equal(*ended)


@pytest.mark.gpu
def test_graph_replay_draws_fresh_noise():
    """Sampling in the graph: each replay draws new noise (near-uniform at temperature 100:
    most of 4 x 100 tokens differ), the same seed gives the same tokens, another seed others."""
    model = _bf16_model("llama")
    decoder = Decoder(model, batch_size=4, max_len=160, do_sample=True, temperature=100.0, eos_token_id=[])
    ids = torch.randint(2, 32000, (4, 32), device="cuda")
    runs = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        runs.append(decoder.generate(ids, 100)[:, 32:])
    assert decoder._graphs and torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
    assert runs[2].unique().numel() > 300


@pytest.mark.gpu
@pytest.mark.parametrize("family", SLIDING)
@pytest.mark.parametrize("optimized", [False, True])
def test_sliding_window_model_replays_the_graph(family, optimized):
    """fp32: the decode step of a sliding-window model is captured and replayed over several
    calls (prompts padded or not), past its window of 5 many times over (7 + 40 tokens), and
    gives HF's greedy tokens of the unoptimized model (near-ties wider: cuBLAS may sum otherwise;
    tiny Gemma 3 and Mistral meet one within 8 tokens of a row: 15 of 80 were compared on an H100)."""
    ref = tiny.build(family).cuda().eval()
    model = copy.deepcopy(ref)
    if optimized:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            onepass.optimize(model)
    decoder = Decoder(model, batch_size=2, max_len=64, pad_token_id=PAD, cuda_graph=True)
    assert decoder.graph_off is None
    ids, (padded, mask) = _prompts(device="cuda"), (t.cuda() for t in _left_padded(batch=2))
    for prompts, attention_mask in ((ids, None), (padded, mask), (ids, None)):
        ours = decoder.generate(prompts, 40, attention_mask=attention_mask)
        _assert_hf_greedy(ours, ref, prompts, 40, near_tie=1e-3, least_compared=0.15, attention_mask=attention_mask)
    assert set(decoder._graphs) == {False, True}


@pytest.mark.gpu
def test_a_step_that_cannot_be_captured_decodes_eagerly():
    """A forward that copies a CPU tensor (Gemma 2's in transformers 5.17) cannot be captured: by
    default the Decoder says so, decodes eagerly and gives HF's tokens; cuda_graph=True raises."""
    model = tiny.build("llama").cuda().eval()
    model.get_input_embeddings().register_forward_hook(lambda _m, _i, out: out + torch.zeros(1).to(out.device))
    ids = _prompts(device="cuda")
    decoder = Decoder(model, batch_size=2, max_len=32, pad_token_id=PAD)
    with pytest.warns(UserWarning, match="without a CUDA graph"):
        ours = decoder.generate(ids, 12)
    assert "CPU" in decoder.graph_off
    _assert_hf_greedy(ours, model, ids, 12, near_tie=1e-3)
    with pytest.raises(RuntimeError, match="cuda_graph=False"):
        Decoder(model, batch_size=2, max_len=32, pad_token_id=PAD, cuda_graph=True).generate(ids, 12)
