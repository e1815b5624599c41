"""The benchmark reports: each row's time, its GPU-only time, dashes for what was not measured; the train
bench's rounds and its measurement of each variant in a process of its own."""

from onepass.bench.harness import Row, to_markdown

ENV = {"gpu": "NVIDIA H200", "torch": "2.11", "triton": "3.6.0", "date": "2026-11-21 10:00 UTC",
       "command": "onepass bench ops", "copy_GBps": 4246.0, "matmul_bf16_TFLOPs": 680.0}


def test_markdown_rows_carry_the_gpu_only_time():
    rows = [Row("rms_norm", "fwd+bwd", "16384x4096 bf16", "onepass", ms=0.184, gpu_ms=0.176, gbps=3644.0,
                frac_copy=0.858, onepass_speedup=1.0),
            Row("rms_norm", "fwd+bwd", "16384x4096 bf16", "eager", ms=2.9, onepass_speedup=15.76),
            Row("rms_norm", "fwd+bwd", "16384x4096 bf16", "liger", error="ImportError: no liger")]
    text = to_markdown("norm", ENV, rows)
    assert "| rms_norm | fwd+bwd | 16384x4096 bf16 | onepass | 0.184 | 0.176 | 3644 | 85.8 | — | — | 1.00 |" in text
    assert "| eager | 2.900 | — | — | — | — | — | 15.76 |" in text
    assert "| liger | failed: ImportError: no liger | — |" in text
    assert "| ms | GPU ms | GB/s |" in text


def test_train_markdown_rows_carry_the_gpu_clock_and_the_synced_step():
    from dataclasses import asdict

    from onepass.bench.train import Result
    from onepass.bench.train import to_markdown as train_markdown

    results = [Result("liger", 62000.0, 132.1, 16.9, 0.81, 0.02, sm_mhz=1755.0, watts=690.0, synced_step_ms=135.0),
               Result("onepass", 68200.0, 120.1, 14.8, 0.89, 0.02, note="all switches on", synced_step_ms=125.0),
               Result("eager", error="OutOfMemoryError: x")]
    summary = {"env": ENV, "model": "llama-1b", "batch": 4, "seq": 2048, "results": [asdict(r) for r in results],
               "floor": {"tokens_per_s": 76400.0, "matmul_tflop": 64.6, "memory_gib": 52.0}}
    text = train_markdown(summary)
    assert "| liger | 62.0k | 132.1 | 16.9 | 81 | 1.00x | 1.00x | 135.0, 1.00x | 1755, 690 |  |" in text
    assert "| onepass | 68.2k | 120.1 | 14.8 | 89 | 1.10x | 0.88x | 125.0, 1.08x | — | all switches on |" in text
    assert "| eager | failed: OutOfMemoryError: x | | | | | | | | |" in text


def test_train_rounds_combine_into_one_row():
    from onepass.bench.train import Result, combine_rounds

    a = Result("onepass", 8192 / 0.120, 120.0, 14.8, loss=2.0, sm_mhz=1600.0, watts=690.0, synced_step_ms=125.0)
    b = Result("onepass", 8192 / 0.124, 124.0, 14.9, loss=1.9, sm_mhz=1560.0, watts=692.0, synced_step_ms=127.0)
    row = combine_rounds([a, b])
    assert row.step_ms == 122.0 and row.round_step_ms == [120.0, 124.0]
    assert abs(row.tokens_per_s - 8192 / 0.122) < 1e-6
    assert (row.peak_gib, row.loss, row.sm_mhz, row.watts, row.synced_step_ms) == (14.9, 1.9, 1580.0, 691.0, 126.0)
    assert combine_rounds([a, Result("onepass", error="OutOfMemoryError: x")]).error == "OutOfMemoryError: x"


def test_each_train_variant_is_measured_in_a_process_of_its_own(monkeypatch):
    """The row comes back from a fresh process as JSON (here a failed one: an unknown model),
    and a process that dies gives a failed row with its exit code."""
    import sys

    from onepass.bench.train import _measure_apart

    lines = []
    row = _measure_apart("eager", "no-such-model", 1, 8, 0, lines.append)
    assert row.variant == "eager" and row.tokens_per_s is None
    from onepass.models.configs import CONFIGS

    assert row.error == f"ValueError: model: unknown name 'no-such-model'; expected one of {sorted(CONFIGS)}"
    assert lines == [f"  eager                  failed: {row.error}"]
    monkeypatch.setattr(sys, "executable", "false")  # a process that prints nothing and exits 1
    assert _measure_apart("eager", "llama-tiny", 1, 8, 0, lines.append).error == (
        "the measuring process exited with code 1: ")


def test_train_floor_counts_what_trains():
    """Llama-3.2-1B at 4 x 2048: the floor of train.md (64.6 TFLOP, 52.0 GiB); with LoRA the
    frozen base has no weight gradients, optimizer state or gradient writes."""
    import torch

    from onepass.bench.train import step_floor, with_lora
    from onepass.models.configs import build

    flops, bytes_ = step_floor(build("llama-1b", "meta", torch.bfloat16), 4, 2048)
    assert round(flops / 1e12, 1) == 64.6 and round(bytes_ / 2**30, 1) == 52.0
    lora_flops, lora_bytes = step_floor(with_lora(build("llama-1b", "meta", torch.bfloat16), 16), 4, 2048)
    linear_flops = flops - 7 * 4 * 2048**2 * 32 * 64 * 16  # without attention
    assert 0.66 < (lora_flops - (flops - linear_flops)) / linear_flops < 0.68  # 4 of 6 flops a weight, + adapters
    assert lora_bytes < bytes_ - 8 * 1.2e9 * 2  # 8 of every frozen weight's 10 passes gone


def test_train_floor_of_gpt2_counts_its_conv1d_projections():
    """GPT-2's config names no kv heads nor intermediate size and its projections are Conv1D (the
    floor raised AttributeError): its matmul FLOPs are 6 a weight a token of every projection and the head."""
    import torch

    from onepass.bench.train import step_floor
    from onepass.models.configs import build

    model = build("gpt2", "meta", torch.bfloat16)
    flops, _ = step_floor(model, 1, 128)
    c = model.config
    weights = c.n_layer * 12 * c.n_embd**2 + c.vocab_size * c.n_embd  # qkv, o, fc, proj; the (tied) head once
    attention = 7 * 128**2 * c.n_embd * c.n_layer
    assert abs(flops - (6 * 128 * weights + attention)) < 1e-3 * flops


def test_only_writes_beside_the_full_results(tmp_path, monkeypatch):
    """--only X keeps each suite's full results: its rows go to <suite>-only-X, and a suite
    without a matching case writes nothing (every suite's results were rewritten, emptied)."""
    from onepass.bench import harness

    monkeypatch.setattr(harness.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(harness, "measure_ceilings", lambda: harness.Ceilings(copy_gbps=4000.0, matmul_tflops=700.0))
    monkeypatch.setattr(harness, "environment", lambda ceilings: ENV)
    monkeypatch.setattr(harness, "run_case", lambda case, ceilings, log: [
        harness.Row(case.op, case.mode, case.shape, "onepass", ms=1.0)])
    folder = tmp_path / "h200"
    folder.mkdir()
    (folder / "norm.json").write_text("the full run")
    results = harness.run_suites(["norm", "activation"], tmp_path, only="rms", log=lambda *a: None)
    assert results["activation"] == [] and not (folder / "activation.json").exists()
    assert {r.op for r in results["norm"]} == {"rms_norm", "add_rms_norm"}
    assert (folder / "norm.json").read_text() == "the full run"
    assert (folder / "norm-only-rms.json").exists() and (folder / "norm-only-rms.md").exists()


def test_decode_floor_reads_an_untied_embedding_only_for_the_batch_rows():
    """A decode step reads the LM head whole, but of an input embedding that is not the head only
    the rows it looks up: a tied model's floor counts the shared table once."""
    import torch

    from onepass.bench.generate import step_bytes
    from onepass.models.configs import build

    tied, untied = build("llama-tiny", "meta", torch.bfloat16), build("llama-tiny-untied", "meta", torch.bfloat16)
    vocab, hidden = untied.config.vocab_size, untied.config.hidden_size
    everything = sum(p.numel() * p.element_size() for p in untied.parameters())
    assert step_bytes(untied, 8) == everything - (vocab - 8) * hidden * 2
    assert step_bytes(tied, 8) == sum(p.numel() * p.element_size() for p in tied.parameters())


def test_decode_floor_reads_only_the_top_k_experts():
    """Of a mixture of experts' routed weights a step reads at least its top-k experts' (k of E
    per layer): the floor counts that share of them; the router and the rest whole."""
    import torch

    from onepass.bench.generate import step_bytes
    from onepass.models.configs import build

    model = build("qwen3-moe-8l", "meta", torch.bfloat16)
    config = model.config
    routed = sum(p.numel() * 2 for n, p in model.named_parameters() if ".experts." in n)
    assert 0 < routed < sum(p.numel() * 2 for p in model.parameters())
    untied = (config.vocab_size - 1) * config.hidden_size * 2  # the input embedding's unread rows
    everything = sum(p.numel() * 2 for p in model.parameters())
    expected = everything - routed + routed * config.num_experts_per_tok // config.num_experts - untied
    assert step_bytes(model, 1) == expected
