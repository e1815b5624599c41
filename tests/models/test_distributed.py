"""FSDP2 and DDP on 2 CPU processes over gloo: an optimized tiny Llama or Gemma 2 (tied
embeddings) trains with the loss and every gradient of the unoptimized model run whole in one
process; DCP and save_pretrained round trips; the wrong order refused. The scenarios run in one
``torchrun`` (``distributed_worker.py``, which says what each does); each test reads its own."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import build

import onepass

WORKER = Path(__file__).with_name("distributed_worker.py")

PARITY = ["fsdp-llama", "fsdp-llama-head-unit", "fsdp-gemma2-tied-no-reshard", "fsdp-llama-checkpoint-wrapper",
          "fsdp-gemma2-hf-checkpointing", "fsdp-llama-compiled-blocks", "ddp-llama-no-sync",
          "ddp-gemma2-wrapped-first"]
MIXED_PRECISION = ["fsdp-llama-head-unit-bf16", "fsdp-gemma2-tied-bf16"]
CHECKPOINTS = ["fsdp-dcp-llama", "fsdp-dcp-gemma2-tied"]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("distributed") / "results.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(WORKER), str(out)], capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0 and out.exists(), proc.stderr[-4000:]
    return json.loads(out.read_text())


def _ok(results: dict, name: str) -> dict:
    result = results[name]
    assert "error" not in result, result.get("traceback", result["error"])
    return result


@pytest.mark.parametrize("name", PARITY)
def test_loss_and_every_gradient_match_the_whole_unoptimized_model(results, name):
    r = _ok(results, name)
    assert r["loss_error"] < 1e-5 and r["grad_error"] < 1e-4, r
    assert not r["missing_grads"]
    if name.startswith("fsdp") and "hf-checkpointing" not in name:
        assert r["fused_loss_calls"] == 1  # the fused LM-head loss ran (on the gathered weight)


@pytest.mark.parametrize("name", MIXED_PRECISION)
def test_bf16_mixed_precision_is_as_close_as_the_unoptimized_model_under_the_same_policy(results, name):
    r = _ok(results, name)
    assert r["fused_loss_calls"] == 1
    assert r["grad_error"] < max(3 * r["plain_grad_error"], 1e-3) and r["grad_error"] < 0.05, r


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_dcp_and_save_pretrained_round_trips_keep_keys_and_values(results, name):
    r = _ok(results, name)
    assert r["keys_match"]  # the full state dict has the unoptimized model's keys
    assert r["param_error"] == 0 and r["moment_error"] == 0
    assert r["losses"][0] == r["losses"][1]
    assert r["pretrained_error"] == 0


def test_optimize_after_fully_shard_is_refused_with_the_order_that_works(results):
    assert "optimize the model before sharding it" in _ok(results, "fsdp-optimize-after-shard")["refused"]


def test_undo_after_fully_shard_is_refused(results):
    assert "build the model again" in _ok(results, "fsdp-undo-after-shard")["refused"]


def test_a_model_partitioned_by_deepspeed_zero3_is_refused():
    # ZeRO-3 marks each partitioned parameter (ds_id) and gathers it in module hooks, which the fused
    # paths would skip, reading the empty partitions (Liger-Kernel's fused loss did: its issue #767)
    model = build("llama")
    model.lm_head.weight.ds_id = 0
    with pytest.raises(ValueError, match="already sharded by DeepSpeed ZeRO-3"):
        onepass.optimize(model)
