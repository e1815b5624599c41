"""``onepass bench generate``: greedy generation with a built-in model, variant by variant.

    run(model="llama-1b", batches=(1, 8), prompt=128, new=256)

For each batch size, one model (random weights, bf16, sdpa attention) generates ``new``
tokens after a ``prompt``-token prompt of random tokens, never stopping early:

    HF generate                     ``model.generate``: dynamic cache, eager
    HF generate, static + compile   ``model.generate(cache_implementation="static")``, which
                                    torch.compiles the forward (transformers' fast path)
    onepass.generate                a ``onepass.Decoder`` on the same model: static cache, the
                                    step replayed as a CUDA graph
    onepass.optimize + generate     the same on ``onepass.optimize(model)``
    ... no graph                    the Decoder without its graph (what the graph saves)

Each variant runs once to warm up (compiles, captures: the "first call" column), then
``REPEATS`` times; the median call is reported, and the decode time per step: a call with ``new`` tokens minus a
call with one (the prefill and its first token), over ``new - 1`` steps.

The floor of a decode step reads every weight once and the KV cache written so far (its
mean length over the steps), at the copy bandwidth measured in the same run; an input embedding
that is not also the LM head counts only for the rows a step looks up. Results go to
``generate-<model>.json`` and ``.md`` under the GPU's folder.
"""

from __future__ import annotations

import copy
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

REPEATS = 3


@dataclass
class Row:
    batch: int
    variant: str
    warmup_s: float | None = None  # the first call with all new tokens (compiles, captures)
    call_ms: float | None = None  # median of REPEATS calls: prefill + new tokens
    step_ms: float | None = None  # one decode step
    tokens_per_s: float | None = None  # batch * new / call time
    frac_floor: float | None = None  # floor step time / step_ms
    error: str | None = None


def _median_ms(call, repeats: int = REPEATS) -> float:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _routed_share(model: torch.nn.Module) -> float:
    """Of a mixture of experts' routed weights, the share a step must read at the fewest: its
    top-k experts of a layer's E (every token of the batch routed alike); 1 without experts."""
    config = model.config.get_text_config()
    experts = next((getattr(config, k) for k in ("num_experts", "num_local_experts", "n_routed_experts")
                    if getattr(config, k, None)), None)
    top_k = getattr(config, "num_experts_per_tok", None)
    return min(top_k, experts) / experts if experts and top_k else 1.0


def step_bytes(model: torch.nn.Module, batch: int) -> int:
    """The weight bytes a decode step must read: every parameter once, but of an input embedding
    that is not also the LM head (untied) only the ``batch`` rows the step looks up, and of the
    routed experts (parameters under an ``experts`` module) only the top-k's share: a floor, exact
    at batch 1 (a larger batch's tokens may route to more experts)."""
    share = _routed_share(model)
    weights = round(sum(p.numel() * p.element_size() * (share if ".experts." in f".{n}" else 1.0)
                        for n, p in model.named_parameters()))
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    if head is None or head.weight is not embedding:
        weights -= (embedding.shape[0] - batch) * embedding[0].numel() * embedding.element_size()
    return weights


def step_floor_ms(model: torch.nn.Module, batch: int, prompt: int, new: int, copy_gbps: float) -> float:
    """A decode step's minimum time: the weights it must read (``step_bytes``), plus the K and V
    cache written so far (mean length over the steps), at the copy bandwidth."""
    weights = step_bytes(model, batch)
    config = model.config.get_text_config()
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    cache = 2 * config.num_hidden_layers * batch * heads * head_dim * (prompt + new / 2) * 2  # bf16 K and V
    return (weights + cache) / copy_gbps / 1e6


def _variants(model, batch: int, prompt: int, new: int, compile_hf: bool) -> dict:
    """{variant: (call with n new tokens)}; the model is shared, the optimized copy is not."""
    from onepass import Decoder, optimize

    def hf(**kw):
        return lambda n: model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                        pad_token_id=0, **kw)

    def decoder(m, **kw):
        d = Decoder(m, batch_size=batch, max_len=prompt + new, eos_token_id=[], **kw)
        return lambda n: d.generate(ids, n)

    ids = torch.randint(0, model.config.vocab_size, (batch, prompt), device="cuda")
    optimized = optimize(copy.deepcopy(model))
    variants = {"HF generate": hf()}
    if compile_hf:
        variants["HF generate, static + compile"] = hf(cache_implementation="static")
    variants["onepass.generate"] = decoder(model)
    variants["onepass.optimize + generate"] = decoder(optimized)
    variants["onepass.optimize + generate, no graph"] = decoder(optimized, cuda_graph=False)
    return variants


def run(model: str = "llama-1b", batches: tuple[int, ...] = (1, 8), prompt: int = 128, new: int = 256,
        out_dir: str | Path = "benchmarks/results", compile_hf: bool = True, log=print) -> dict:
    if not torch.cuda.is_available():
        raise RuntimeError("the generation benchmark needs a CUDA GPU")
    from onepass.bench.harness import environment, gpu_folder, measure_ceilings
    from onepass.models.configs import build

    log("measuring the copy bandwidth and the bf16 matmul rate ...")
    ceilings = measure_ceilings()
    env = environment(ceilings)
    torch.manual_seed(0)
    hf_model = build(model, device="cuda")
    positions = getattr(hf_model.config, "max_position_embeddings", None)
    if positions is not None and prompt + new > positions:  # (GPT-2's learned positions end there)
        raise ValueError(f"prompt {prompt} + new {new} tokens exceed {model}'s {positions} positions")
    rows, floors = [], {}
    for batch in batches:
        floor = floors[batch] = step_floor_ms(hf_model, batch, prompt, new, ceilings.copy_gbps)
        log(f"batch {batch}: floor of a decode step {floor:.3f} ms")
        rows += _run_batch(hf_model, batch, prompt, new, compile_hf, floor, log)
    summary = {"env": env, "model": model, "prompt": prompt, "new": new, "floors_ms": floors,
               "rows": [asdict(r) for r in rows]}
    folder = Path(out_dir) / gpu_folder(env["gpu"])
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"generate-{model}.json").write_text(json.dumps(summary, indent=1))
    (folder / f"generate-{model}.md").write_text(to_markdown(summary))
    log(f"written: {folder / f'generate-{model}.md'}")
    return summary


def _run_batch(hf_model, batch: int, prompt: int, new: int, compile_hf: bool, floor: float, log) -> list[Row]:
    """Every variant at one batch size. Its own function so that the batch's optimized copy, decoders
    and caches are freed on return, before the next batch builds its own."""
    rows = []
    for name, call in _variants(hf_model, batch, prompt, new, compile_hf).items():
        row = Row(batch, name)
        try:
            log(f"  {name}: warm-up ...")
            row.warmup_s = _median_ms(lambda call=call: call(new), repeats=1) / 1e3
            call(1)
            row.call_ms = _median_ms(lambda call=call: call(new))
            row.step_ms = (row.call_ms - _median_ms(lambda call=call: call(1))) / (new - 1)
            row.tokens_per_s = batch * new / (row.call_ms / 1e3)
            row.frac_floor = floor / row.step_ms
            log(f"  {name}: first call {row.warmup_s:.1f} s, then {row.call_ms:.1f} ms a call, "
                f"{row.step_ms:.3f} ms a step, {row.tokens_per_s:.0f} tokens/s, "
                f"{100 * row.frac_floor:.0f}% of the floor")
        except Exception as e:  # a variant that fails (e.g. compile) is reported, not fatal
            row.error = f"{type(e).__name__}: {e}"[:300]
            log(f"  {name}: failed: {row.error}")
        rows.append(row)
        torch.cuda.empty_cache()
    return rows


def to_markdown(summary: dict) -> str:
    env = summary["env"]
    lines = [f"# generate: {summary['model']}, prompt {summary['prompt']} + {summary['new']} new tokens, greedy, bf16",
             "", (f"{env['gpu']}; torch {env['torch']}, triton {env['triton']}, {env['date']}; copy bandwidth "
                  f"{env['copy_GBps']:.0f} GB/s (measured in this run)."), "", f"Command: `{env['command']}`", "",
             ("Floor of a decode step: every weight read once (of routed experts, the top-k's share) plus the KV "
              "cache so far (mean over the steps) at "
              "the copy bandwidth: " + ", ".join(f"batch {b}: {ms:.3f} ms" for b, ms in summary["floors_ms"].items())
              + ". A step's time: (call with all new tokens - call with one) / (new - 1)."), "",
             "| batch | variant | first call s | ms a call | ms a step | tokens/s | % of floor | its ms / onepass's |",
             "|---|---|---|---|---|---|---|---|"]
    ours = {r["batch"]: r["call_ms"] for r in summary["rows"] if r["variant"] == "onepass.optimize + generate"}
    for r in summary["rows"]:
        if r["error"]:
            lines.append(f"| {r['batch']} | {r['variant']} | failed: {r['error'][:80]} | | | | | |")
            continue
        ratio = r["call_ms"] / ours[r["batch"]] if ours.get(r["batch"]) else None
        lines.append(f"| {r['batch']} | {r['variant']} | {r['warmup_s']:.1f} | {r['call_ms']:.1f} | "
                     f"{r['step_ms']:.3f} | "
                     f"{r['tokens_per_s']:.0f} | {100 * r['frac_floor']:.0f} | "
                     + (f"{ratio:.2f}" if ratio else "—") + " |")
    return "\n".join(lines) + "\n"
