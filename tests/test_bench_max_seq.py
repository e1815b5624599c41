"""``onepass bench train --max-seq``: the longest-sequence search with fake trials, and its entries
and tables with a fake launcher (tests/test_bench_train_distributed.py's)."""

from __future__ import annotations

import json

import pytest
from test_bench_train_distributed import fake_launch

from onepass.bench import max_seq as ms


@pytest.mark.parametrize("limit, longest, shortest_failed, tried", [
    (6000, 5120, 6144, [4096, 8192, 6144, 5120]),
    (10**6, 131072, None, [4096, 8192, 16384, 32768, 65536, 131072]),
    (100000, 65536, 131072, [4096, 8192, 16384, 32768, 65536, 131072]),
    (2500, 2048, 3072, [4096, 2048, 3072]),
    (500, None, 1024, [4096, 2048, 1024]),
    (8192, 8192, 9216, [4096, 8192, 16384, 12288, 10240, 9216]),
])
def test_search_doubles_then_bisects_to_the_quantum(limit, longest, shortest_failed, tried):
    seen = []

    def trial(seq):
        seen.append(seq)
        return seq <= limit

    assert ms.search_max_seq(trial, start=4096, quantum=1024, max_trials=6) == (longest, shortest_failed)
    assert seen == tried


def test_max_seq_counts_out_of_memory_as_too_long_and_stops_on_other_failures(monkeypatch):
    calls = []
    monkeypatch.setattr(ms, "launch", fake_launch(7000, calls))
    entry = ms.max_seq("llama-8b", 4, "onepass", False, log=lambda line: None)
    assert (entry["longest"], entry["shortest_failed"], entry["error"]) == (6144, 7168, None)
    assert [t["seq"] for t in entry["trials"]] == [4096, 8192, 6144, 7168]
    assert [t["ok"] for t in entry["trials"]] == [True, False, True, False]
    assert {(c["batch"], c["warmup"], c["timed"], c["checkpoint"]) for c in calls} == {(1, 1, 1, False)}

    calls.clear()
    monkeypatch.setattr(ms, "launch", fake_launch(7000, calls, error="ImportError: liger_kernel is not importable"))
    entry = ms.max_seq("llama-8b", 4, "broken", True, log=lambda line: None)
    assert entry["error"] == "ImportError: liger_kernel is not importable" and len(calls) == 1
    assert entry["longest"] is None and calls[0]["checkpoint"] is True
    entry = ms.max_seq("llama-8b", 4, "liger", False, log=lambda line: None)  # a pass first: a failure is "too long"
    assert (entry["longest"], entry["shortest_failed"], entry["error"]) == (6144, 7168, None)


def test_run_max_seq_merges_entries_across_runs(monkeypatch, tmp_path, four_gpus):
    """One table a checkpointing setting; a variant's entry from a later run replaces its own."""
    monkeypatch.setattr(ms, "launch", fake_launch(7000, []))
    quiet = {"log": lambda line: None}
    ms.run_max_seq("llama-8b", 4, ("liger", "onepass"), (False,), tmp_path, **quiet)
    monkeypatch.setattr(ms, "launch", fake_launch(9000, []))
    ms.run_max_seq("llama-8b", 4, ("onepass",), (False, True), tmp_path, **quiet)
    folder = tmp_path / "h100-80gb-hbm3"
    summary = json.loads((folder / "train-llama-8b-4gpu-max-seq.json").read_text())
    assert [(e["variant"], e["longest"]) for e in summary["entries"]] == [("liger", 6144), ("onepass", 8192)]
    text = (folder / "train-llama-8b-4gpu-max-seq.md").read_text()
    assert "checkpointing off" in text
    assert "| onepass | 8192 | 9216 | 1.33x | 4096: 4.1, 8192: 8.2, 16384: OOM, 12288: OOM, 10240: OOM, " in text
    assert "| liger | 6144 | 7168 | 1.00x | 4096: 4.1, 8192: OOM, 6144: 6.1, 7168: OOM |" in text
    with_ac = json.loads((folder / "train-llama-8b-4gpu-max-seq-ac.json").read_text())
    assert [(e["variant"], e["checkpoint"], e["longest"]) for e in with_ac["entries"]] == [("onepass", True, 8192)]
    assert "| onepass | 8192 | 9216 | — |" in (folder / "train-llama-8b-4gpu-max-seq-ac.md").read_text()
