"""``onepass bench train --max-seq``: the longest sequence that trains at batch 1 under FSDP2.

    run_max_seq(model="llama-8b", gpus=4, checkpoints=(False, True))

``max_seq``: each trial a fresh torchrun process of two steps (the second with the
optimizer's state allocated) of ``onepass.bench.train_distributed``'s recipe and per-rank
``train`` job, out of memory on any rank ending it with a non-zero code: a failure
(``search_max_seq``). ``run_max_seq`` merges each entry into one table a checkpointing
setting (``max_seq_markdown``). Without a CUDA GPU it all runs on CPU processes over gloo
in fp32: a smoke test (-tiny models, no peak memory).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Callable

from onepass.bench.train_distributed import check_run, launch, log_line, save_summary

MAX_SEQ_VARIANTS = ("liger", "onepass")
TRIAL_TIMEOUT_S = 300.0  # one max-seq trial


def search_max_seq(trial: Callable[[int], bool], start: int = 4096, quantum: int = 1024,
                   max_trials: int = 6) -> tuple[int | None, int | None]:
    """(longest length that passed, shortest that failed) of ``trial``, taken as monotone:
    lengths double from ``start`` until one fails (halve while ``start`` and below fail),
    then bisect on multiples of ``quantum`` until ``quantum`` apart; ``max_trials`` at most."""
    ok = fail = None
    seq = start
    for _ in range(max_trials):
        ok, fail = (seq, fail) if trial(seq) else (ok, seq)
        if fail is None:
            seq *= 2
        elif ok is None:
            if seq <= quantum:
                break
            seq = max(quantum, seq // 2 // quantum * quantum)
        elif fail - ok <= quantum:
            break
        else:
            seq = max(ok + quantum, (ok + fail) // 2 // quantum * quantum)
    return ok, fail


def max_seq(model: str, gpus: int, variant: str, checkpoint: bool, *, start: int = 4096, quantum: int = 1024,
            max_trials: int = 6, timeout_s: float = TRIAL_TIMEOUT_S, log: Callable[[str], None] = log_line) -> dict:
    """The longest sequence of ``variant`` that trains at batch 1 on ``gpus`` GPUs, as an entry
    with each trial (two steps in a fresh torchrun process). A failure other than out of
    memory or the timeout, before any length passed, ends the search as the entry's error."""
    entry = {"variant": variant, "checkpoint": checkpoint, "longest": None, "shortest_failed": None, "error": None,
             "trials": [], "env": None, "command": " ".join(sys.argv)}

    def trial(seq: int) -> bool:
        t = time.monotonic()
        spec = {"job": "train", "model": model, "variant": variant, "batch": 1, "seq": seq, "checkpoint": checkpoint,
                "warmup": 1, "timed": 1}
        row, entry["env"] = launch(gpus, spec, timeout_s, log)
        oom = row.error is not None and "out of memory" in row.error.lower()
        entry["trials"].append({"seq": seq, "ok": row.error is None, "peak_gib": row.peak_gib, "step_ms": row.step_ms,
                                "seconds": round(time.monotonic() - t, 1), "error": row.error})
        log(f"  {variant}{', checkpointing' if checkpoint else ''}, seq {seq}: " + (
            f"trains, peak {row.peak_gib or 0:.1f} GiB, {row.step_ms / 1e3:.2f} s/step" if row.error is None
            else "out of memory" if oom else f"failed: {row.error}"))
        if row.error and not (oom or "timed out" in row.error or any(t["ok"] for t in entry["trials"])):
            raise RuntimeError(row.error)
        return row.error is None

    try:
        entry["longest"], entry["shortest_failed"] = search_max_seq(trial, start, quantum, max_trials)
    except RuntimeError as e:
        entry["error"] = str(e)
    return entry


def run_max_seq(model: str = "llama-8b", gpus: int = 4, variants: tuple[str, ...] | None = None,
                checkpoints: tuple[bool, ...] = (False, True), out_dir: str | Path = "benchmarks/results", *,
                start: int = 4096, quantum: int = 1024, max_trials: int = 6, timeout_s: float = TRIAL_TIMEOUT_S,
                log: Callable[[str], None] = log_line) -> dict:
    """``max_seq`` of each variant without and/or with activation checkpointing; each entry
    merges into ``<out_dir>/<gpu>/train-<model>-<gpus>gpu-max-seq[-ac].{json,md}`` as it ends,
    replacing one of the same variant (runs split across commands fill one table)."""
    from onepass.bench.harness import gpu_folder

    variants = tuple(variants or MAX_SEQ_VARIANTS)
    check_run(model, gpus, variants)
    summary: dict = {}
    for checkpoint in checkpoints:
        for variant in variants:
            log(f"longest sequence at batch 1: {model}, {gpus} GPUs, {variant}"
                + (", activation checkpointing" if checkpoint else ""))
            entry = max_seq(model, gpus, variant, checkpoint, start=start, quantum=quantum, max_trials=max_trials,
                            timeout_s=timeout_s, log=log)
            log(f"  {variant}: longest {entry['longest']}, shortest failed {entry['shortest_failed']}"
                + (f"; {entry['error']}" if entry["error"] else ""))
            env = entry["env"] or {"gpu": "unknown"}
            path = Path(out_dir) / gpu_folder(env["gpu"]) / f"train-{model}-{gpus}gpu-max-seq{'-ac' * checkpoint}.json"
            kept = json.loads(path.read_text())["entries"] if path.exists() else []
            kept = [e for e in kept if e["variant"] != variant]
            summary = {"env": env, "model": model, "gpus": gpus, "checkpoint": checkpoint, "entries": kept + [entry]}
            save_summary(summary, out_dir, path.stem, max_seq_markdown(summary), log)
    return summary


def max_seq_markdown(summary: dict) -> str:
    liger = next((e["longest"] for e in summary["entries"] if e["variant"] == "liger"), None)
    lines = [f"# longest trainable sequence under FSDP2, batch 1: {summary['model']}, {summary['gpus']} GPUs, "
             f"activation checkpointing {'on' if summary['checkpoint'] else 'off'}", "",
             f"{summary['gpus']} x {summary['env']['gpu']}; each trial two training steps in a fresh torchrun process "
             "(fp32 sharded weights, bf16 compute, torch AdamW(fused=True)); out of memory on any rank fails it.", "",
             "| variant | longest that trains | shortest that failed | vs Liger | trials (seq: peak GiB, or why not) | "
             "date, command |", "|---|---|---|---|---|---|"]
    for e in summary["entries"]:
        vs = f"{e['longest'] / liger:.2f}x" if liger and e["longest"] else "—"
        tried = ", ".join(f"{t['seq']}: " + ("ok" if t["ok"] and t["peak_gib"] is None else f"{t['peak_gib']:.1f}"
                                              if t["ok"] else "OOM" if "out of memory" in t["error"].lower() else
                                              "failed") for t in e["trials"])
        longest = e["longest"] if e["error"] is None else f"failed: {e['error'][:80]}"
        when = f"{e['env']['date']}, `{e['command']}`" if e["env"] else f"`{e['command']}`"
        lines.append(f"| {e['variant']} | {longest} | {e['shortest_failed'] or '—'} | {vs} | {tried} | {when} |")
    lines += ["", "Target: onepass's longest >= 1.2x Liger's without activation checkpointing."]
    return "\n".join(lines) + "\n"
