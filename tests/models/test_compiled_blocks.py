"""torchtitan's recipe, each decoder block under its own torch.compile: an optimized model's
blocks share one graph, as the unoptimized model's do (a forward set on each layer's attention
and MLP instance was guarded by identity, so each block compiled its own graph and past dynamo's
limit of 8 the rest ran eagerly)."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from torch._dynamo.utils import counters

import onepass

CONFIGS = {
    "llama": lambda: tf.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                    num_key_value_heads=2, intermediate_size=64),
    "gpt2": lambda: tf.GPT2Config(vocab_size=64, n_embd=32, n_layer=3, n_head=4, n_positions=64),
}


@pytest.mark.parametrize("family", sorted(CONFIGS))
@pytest.mark.parametrize("optimized", [False, True])
def test_blocks_compiled_one_by_one_share_one_graph(family, optimized):
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(CONFIGS[family]()).train()
    if optimized:
        onepass.optimize(model, attention=False)  # (the interpreter's attention is slow; it is not what recompiled)
    blocks = model.base_model.layers if family == "llama" else model.base_model.h
    for i, block in enumerate(blocks):
        blocks[i] = torch.compile(block, backend="eager", fullgraph=True)
    torch._dynamo.reset()
    counters.clear()
    ids = torch.randint(0, 64, (1, 6))
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    assert counters["stats"]["unique_graphs"] == 1


def test_a_block_compiled_in_place_runs_compiled():
    model = tf.AutoModelForCausalLM.from_config(CONFIGS["llama"]()).train()
    onepass.optimize(model, attention=False)
    model.model.layers[0].mlp.compile(backend="eager")  # nn.Module.compile: the module's own call is compiled
    torch._dynamo.reset()
    counters.clear()
    ids = torch.randint(0, 64, (1, 6))
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    assert counters["stats"]["unique_graphs"] == 1
