"""attn_implementation="onepass" in transformers after ``import onepass``, as a user of
"flash_attention_2" expects: from_config and from_pretrained give a model whose attention layers
run onepass.ops.attention, with the outputs of SDPA."""

from __future__ import annotations

import subprocess
import sys

import torch
import transformers as tf
from tiny_models import CONFIGS

from onepass import ops
from onepass.testing import rel_error


def _spy_attention(monkeypatch) -> list:
    calls = []
    original = ops.attention

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(ops, "attention", counted)
    return calls


def test_from_config_and_from_pretrained_run_the_onepass_kernel_with_sdpas_outputs(tmp_path, monkeypatch):
    torch.manual_seed(0)
    reference = tf.AutoModelForCausalLM.from_config(CONFIGS["llama"](), attn_implementation="sdpa").eval()
    reference.save_pretrained(tmp_path)
    ids = torch.randint(0, 256, (2, 9))
    expected = reference(ids).logits
    calls = _spy_attention(monkeypatch)
    for model in (tf.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="onepass"),
                  tf.AutoModelForCausalLM.from_config(reference.config, attn_implementation="onepass")):
        assert model.config._attn_implementation == "onepass"
        model.load_state_dict(reference.state_dict())
        got = model.eval()(ids).logits
        assert rel_error(got, expected) < 1e-5
    assert len(calls) == 2 * reference.config.num_hidden_layers


def test_import_onepass_registers_before_or_after_transformers_and_stays_light():
    code = """
import sys
first, second = sys.argv[1:]
__import__(first)
assert first != "onepass" or "torch" not in sys.modules, "import onepass imported torch"
__import__(second)
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface
assert "onepass" in AttentionInterface._global_mapping and "onepass" in AttentionMaskInterface._global_mapping
"""
    for order in (("onepass", "transformers"), ("transformers", "onepass")):
        proc = subprocess.run([sys.executable, "-c", code, *order], capture_output=True, text=True, check=False)
        assert proc.returncode == 0, (order, proc.stderr[-2000:])
