"""The benchmark harness's Markdown: each row's time, its GPU-only time, and dashes for what was not measured."""

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
