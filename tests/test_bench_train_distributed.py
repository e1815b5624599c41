"""``onepass bench train --gpus N``: the FSDP2 recipe (``shard``, ``init_weights``), the rounds with a
fake launcher (``fake_launch``, which tests/test_bench_max_seq.py shares), and the whole path through
torchrun on 2 CPU processes over gloo (eager, onepass, and Liger failing as a row where it is not
installed)."""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import threading
import time
import uuid

import pytest
import torch
import torch.distributed as dist

from onepass.bench import max_seq as ms
from onepass.bench import train_distributed as td
from onepass.bench.train import liger_patch
from onepass.bench.train_distributed import DistResult

ENV = {"gpu": "NVIDIA H100 80GB HBM3", "gpus": 2, "torch": "2.11", "triton": "3.6.0", "python": "3.12",
       "date": "2026-11-26 10:00 UTC", "copy_GBps": 3000.0, "matmul_bf16_TFLOPs": 650.0}


# ---------------------------------------------------------------- the recipe, in this process


@pytest.fixture
def one_rank_group(tmp_path):
    """A gloo process group of this process alone (fully_shard needs one)."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_shard_makes_each_layer_a_unit_checkpointed_then_compiled(one_rank_group):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from onepass.models.configs import build

    model = build("llama-tiny-untied", "meta", torch.float32)
    td.shard(model, head_unit=True, compile_blocks=True, checkpoint=True)
    for layer in model.model.layers:
        assert isinstance(layer, FSDPModule) and isinstance(layer, torch._dynamo.eval_frame.OptimizedModule)
        assert isinstance(layer._orig_mod, CheckpointWrapper)
        assert layer.mlp is layer._orig_mod._checkpoint_wrapped_module.mlp  # attributes reach the layer
    assert isinstance(model.lm_head, FSDPModule) and isinstance(model, FSDPModule)
    assert not isinstance(model.model.embed_tokens, FSDPModule)  # in the root's unit
    assert all(isinstance(p, DTensor) and p.device.type == "meta" for p in model.parameters())
    mp = model._get_fsdp_state()._mp_policy
    assert (mp.param_dtype, mp.reduce_dtype) == (torch.bfloat16, torch.float32)

    tied = build("llama-tiny", "meta", torch.float32)
    with pytest.raises(ValueError, match="head_unit"):
        td.shard(tied, head_unit=True)
    td.shard(tied, mp=False)
    assert all(not isinstance(layer, torch._dynamo.eval_frame.OptimizedModule) for layer in tied.model.layers)
    assert tied._get_fsdp_state()._mp_policy.param_dtype is None
    assert tied.lm_head.weight is tied.model.embed_tokens.weight


def test_init_weights_fills_the_shards_and_rebuilds_rotary_tables(one_rank_group):
    from onepass.models.configs import build

    model = build("llama-tiny", "meta", torch.float32)
    td.shard(model)
    model.to_empty(device="cpu")
    td.init_weights(model, seed=0)
    norms = [p.to_local() for n, p in model.named_parameters() if "norm" in n]
    assert norms and all(bool((w == 1).all()) for w in norms)
    embed = model.model.embed_tokens.weight.to_local()
    assert abs(embed.std().item() - 0.02) < 0.002 and abs(embed.mean().item()) < 0.002
    q = model.model.layers[0].self_attn.q_proj.weight.to_local()
    assert abs(q.std().item() - 0.02) < 0.004
    fresh = build("llama-tiny", "cpu", torch.float32).model.rotary_emb.inv_freq
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, fresh, rtol=0, atol=0)
    ids = torch.randint(0, 256, (1, 16))
    loss = model.train()(input_ids=ids, labels=ids).loss
    assert abs(loss.item() - math.log(256)) < 0.1  # random init: about uniform over the vocabulary


# ------------------------------------------------------------- the rounds, with a fake launcher


def fake_launch(limit, calls, error="OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"):
    """A launcher whose trials above ``limit`` tokens fail with ``error``."""

    def launch(gpus, spec, timeout_s, log):
        calls.append(spec)
        if spec["job"] == "heat":
            return DistResult("heat"), dict(ENV)
        if spec["seq"] > limit or spec["variant"] == "broken":
            return DistResult(spec["variant"], error=error), dict(ENV)
        step_ms = {"eager": 400.0, "liger": 300.0, "onepass": 250.0}.get(spec["variant"], 280.0) + len(calls)
        return DistResult(spec["variant"], tokens_per_s=spec["batch"] * spec["seq"] / step_ms * 1e3, step_ms=step_ms,
                          peak_gib=spec["seq"] / 1000, loss=11.9, reserved_gib=spec["seq"] / 900), dict(ENV)

    return launch


def test_a_failed_rank_says_when_memory_ran_out():
    nccl = RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:3356, unhandled cuda error " + "x" * 400
                        + " Last error: Cuda failure 2 'out of memory'")
    assert td.error_text(nccl).endswith(" ... out of memory") and len(td.error_text(nccl)) == 298
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 7.83 GiB. " + "y" * 400)
    assert td.error_text(oom) == f"OutOfMemoryError: {oom}"[:300]
    assert td.error_text(ImportError("no liger")) == "ImportError: no liger"


def test_rows_of_ranks_failing_at_once_are_read_even_where_their_lines_run_together():
    # four ranks out of memory at once wrote into one pipe: one line held two rows (a JSON error killed the run)
    out = (f"log\n{td.RESULT_TAG}" + json.dumps({"variant": "onepass", "error": "OutOfMemoryError: a"})
           + td.RESULT_TAG + json.dumps({"variant": "onepass", "error": "OutOfMemoryError: b"}) + "\n"
           + td.RESULT_TAG + "{cut off\n")
    assert [row["error"] for row in td._tagged(out, td.RESULT_TAG)] == ["OutOfMemoryError: a", "OutOfMemoryError: b"]


def test_run_distributed_alternates_the_order_and_combines_the_rounds(monkeypatch, tmp_path, four_gpus):
    calls = []
    monkeypatch.setattr(td, "launch", fake_launch(10**6, calls))
    summary = td.run_distributed("llama-3b", 4, 2, 2048, ("eager", "liger", "onepass"), tmp_path, log=lambda line: None)
    assert calls[0] == {"job": "heat", "seconds": td.HEAT_S}
    assert [c["variant"] for c in calls[1:]] == ["eager", "liger", "onepass", "onepass", "liger", "eager"]
    assert {(c["batch"], c["seq"], c["warmup"], c["timed"]) for c in calls[1:]} == {(2, 2048, 3, 8)}
    rows = {r["variant"]: r for r in summary["results"]}
    onepass = rows["onepass"]
    assert onepass["round_step_ms"] == [254.0, 255.0] and onepass["step_ms"] == 254.5
    assert onepass["tokens_per_s"] == pytest.approx(4096 / 0.2545)
    flops = summary["matmul_tflop_per_gpu_step"] * 1e12
    assert onepass["mfu"] == pytest.approx(flops / 0.2545 / 650e12)
    assert 0.3 < onepass["mfu"] < 0.6  # 3.2B weights x 6 x 4096 tokens + attention: about 85 TFLOP
    text = (tmp_path / "h100-80gb-hbm3" / "train-llama-3b-4gpu.md").read_text()
    assert "| onepass | 16.09k | 254.5 | " in text and "| 1.20x | " in text  # tokens/s against Liger's 304.5 ms
    assert "4 x NVIDIA H100 80GB HBM3" in text


def test_rounds_without_a_peak_combine():
    """CPU ranks read no peak memory: two rounds still make one row."""
    from onepass.bench.train import combine_rounds

    rounds = [DistResult("eager", tokens_per_s=1000.0, step_ms=16.0, loss=5.5),
              DistResult("eager", tokens_per_s=500.0, step_ms=32.0, loss=5.4)]
    row = combine_rounds(rounds)
    assert (row.step_ms, row.peak_gib, row.loss) == (24.0, None, 5.4)


# ------------------------------------------------------------- through torchrun, on 2 CPU ranks


def test_two_cpu_ranks_train_eager_and_onepass_and_liger_fails_as_a_row(tmp_path):
    lines = []
    summary = td.run_distributed("llama-tiny", 2, 1, 16, ("eager", "onepass", "liger"), tmp_path, rounds=1,
                                 warmup=1, timed=1, log=lines.append)
    rows = {r["variant"]: r for r in summary["results"]}
    for name in ("eager", "onepass"):
        assert rows[name]["error"] is None and rows[name]["tokens_per_s"] > 0 and rows[name]["mfu"] > 0
        assert abs(rows[name]["loss"] - math.log(256)) < 0.2
    assert rows["onepass"]["note"] == "all switches on"
    assert rows["eager"]["loss"] == pytest.approx(rows["onepass"]["loss"], abs=1e-3)  # same weights, same tokens
    if liger_patch() is None:
        assert rows["liger"]["error"] == "ImportError: liger_kernel is not importable here"
        assert any(line.startswith("    [onepass rank ") and "] ImportError: liger" in line for line in lines)
    assert summary["env"]["gpu"] == "cpu" and summary["env"]["gpus"] == 2
    assert (tmp_path / "cpu" / "train-llama-tiny-2gpu.json").exists()
    assert "| eager | " in (tmp_path / "cpu" / "train-llama-tiny-2gpu.md").read_text()


def test_onepass_trains_with_its_head_a_unit_and_checkpointed_layers_in_bf16(monkeypatch):
    """The 8B layout (an untied head) as its own unit, checkpointing, bf16 compute over fp32
    weights; the ops run their references (the kernels ran through the interpreter above)."""
    monkeypatch.setenv("ONEPASS_REFERENCE", "1")
    spec = {"job": "train", "model": "llama-tiny-untied", "variant": "onepass", "batch": 1, "seq": 16,
            "head_unit": True, "checkpoint": True, "mp": True, "warmup": 1, "timed": 1}
    row, env = td.launch(2, spec, 300, lambda line: None)
    assert row.error is None and abs(row.loss - math.log(256)) < 0.2
    assert env["gpu"] == "cpu" and "copy_GBps" not in env  # ceilings only in the heat job


def _tagged_processes(tag: str) -> list[str]:
    """The processes whose command line holds ``tag``, after up to 5 s for killed ones to go."""
    for _ in range(50):
        left = []
        for pid in os.listdir("/proc"):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if tag.encode() in f.read():
                        left.append(pid)
            except OSError:
                pass
        if not left:
            break
        time.sleep(0.1)
    return left


def _long_spec(tag: str) -> dict:
    return {"job": "train", "model": "llama-tiny", "variant": "onepass", "batch": 1, "seq": 64, "tag": tag,
            "warmup": 50, "timed": 1}


def test_a_launch_past_its_time_ends_every_rank(monkeypatch):
    tag = uuid.uuid4().hex
    spec = _long_spec(tag)
    row, _ = td.launch(2, spec, 8, lambda line: None)
    assert row.error == "timed out after 8 s"
    assert _tagged_processes(tag) == []

    monkeypatch.setattr(sys, "executable", "false")  # a process that prints nothing and exits 1
    row, env = td.launch(2, spec, 30, lambda line: None)
    assert row.error == "torchrun exited with code 1: " and env is None


def test_a_launch_stopped_by_sigterm_ends_every_rank_before_exiting():
    """torchrun and its ranks run in their own session (a Ctrl-C in the terminal does not reach them): a SIGTERM
    or Ctrl-C of the parent ends them before it exits, where they ran on (holding the GPUs)."""
    tag = uuid.uuid4().hex
    before = signal.getsignal(signal.SIGTERM)
    timer = threading.Timer(6.0, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    try:
        with pytest.raises(SystemExit) as stopped:
            td.launch(2, _long_spec(tag), 60, lambda line: None)
    finally:
        timer.cancel()
    assert stopped.value.code == 128 + signal.SIGTERM
    assert _tagged_processes(tag) == []
    assert signal.getsignal(signal.SIGTERM) is before  # the handler it replaced is back


def test_the_command_line_reaches_the_distributed_mode(monkeypatch, capsys):
    from onepass.cli import main

    calls = []
    monkeypatch.setattr(td, "run_distributed", lambda *a, **k: calls.append(("run", a, k)))
    monkeypatch.setattr(ms, "run_max_seq", lambda *a, **k: calls.append(("max", a, k)))
    assert main(["bench", "train", "--gpus", "4", "--model", "llama-8b", "--variants", "liger,onepass",
                 "--checkpoint", "--rounds", "1", "--out", "o"]) == 0
    assert calls.pop() == ("run", ("llama-8b", 4, 2, 2048, ("liger", "onepass"), "o"),
                           {"checkpoint": True, "head_unit": False, "rounds": 1})
    assert main(["bench", "train", "--gpus", "4", "--max-seq", "--model", "llama-8b"]) == 0
    assert calls.pop() == ("max", ("llama-8b", 4, None, (False,), "benchmarks/results"), {"start": 4096})
    for argv, words in ((["--checkpoint"], "--checkpoint is for the distributed mode"),
                        (["--variants", "eager"], "--variants is for the distributed mode"),
                        (["--gpus", "2", "--lora", "8"], "--lora runs on one GPU")):
        assert main(["bench", "train", *argv]) == 2 and words in capsys.readouterr().err
    monkeypatch.undo()
    if not torch.cuda.is_available():
        assert main(["bench", "train", "--gpus", "2"]) == 2
        assert "-tiny model only, not 'llama-3b'" in capsys.readouterr().err
    assert main(["bench", "train", "--gpus", "2", "--model", "llama-tiny", "--variants", "nosuch"]) == 2
    assert "variants: unknown ['nosuch']" in capsys.readouterr().err
