"""Where a decode step's time goes: kernel by kernel, against its floor (issue #32).

    python benchmarks/decode_breakdown.py                       # llama-1b, qwen2-1.5b, llama-8b; batch 1, 8
    python benchmarks/decode_breakdown.py --model llama-8b --batch 1 --cache 512 --out breakdown.json
    python benchmarks/decode_breakdown.py --pdl-rounds 2              # the step with PDL off and on, instead

For each model (built as ``onepass bench generate`` builds it: random bf16 weights, then
``onepass.optimize``) and batch size, a ``onepass.Decoder`` is warmed up, then:

- wall time of a step: (a call with 1 + N new tokens - a call with 1) / N, the call timed by
  ``do_bench`` without the profiler (the prompt is ``--cache`` random tokens);
- the same two calls under torch.profiler (CUDA activity): per step, the GPU ops (kernels,
  copies, fills) and their summed time, by difference of the two calls; the gap = wall time
  - kernel time (the GPU idle between kernels); the span of the profiled GPU work;
- a table by kernel name: launches and us per step, us per launch, category (linear, attention,
  kv cache/rope, norm, other); the linear kernels split into the layers' and the LM head's
  (a name launched a multiple of num_layers times a step is the layers'), each with the
  bandwidth = bytes of the weights it reads / its time;
- one layer's kernels in launch order (mean over layers and steps), where the step's kernel
  sequence repeats per layer; its linear launches (qkv, o, gate_up, down in Llama/Qwen2 order)
  with their weight bytes and bandwidth;
- the floor: ``bench.generate.step_floor_ms`` (every weight a step reads and the KV cache so far,
  once, at the copy bandwidth measured in this run), and per category its own floor (linear weights,
  KV cache, norm weights; nothing for the rest) and the share of the step it costs above it;
- the fixed cost of a launch in a graph: as many tiny kernels as the step has, replayed as
  one CUDA graph; and as many tiny Triton kernels launched as programmatic dependents (PDL), as
  onepass's decode kernels are (``ONEPASS_PDL=0`` turns that off, for a run to compare).

With PDL a kernel's programs start while the kernel before still runs and wait for it, so the
profiler's kernel times include that wait: their sum can pass the wall time (a negative gap).

``--pdl-rounds N`` times each model and batch instead: N rounds of (PDL off, PDL on), each a
fresh ``onepass.Decoder`` whose step graph is captured with the setting (``dispatch._PDL_OFF``,
which ``ONEPASS_PDL=0`` sets), a step being N replays of the captured step from the prompt's
end (the Decoder's position reset before each run), by ``do_bench``; prints each round's
minimum, then each setting's best minimum and median against the floor.

``--launch-costs`` measures instead what one persistent kernel a layer would save: a phase boundary
as a kernel launch (empty kernels in a graph, as programmatic dependents and plain) against a
grid-wide barrier in one launch (``launch_costs``), at one and two programs an SM.

Kernels of a CUDA graph replay are traced by CUPTI when the profiler has run once before
the capture (done first). Where the trace shows fewer kernels a step than layers anyway, the
step is profiled eagerly (``Decoder(cuda_graph=False)``, same kernels), which the output says.
Text to stdout, everything to ``--out`` (JSON). Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import re
import statistics
from collections import defaultdict

import torch
import triton
import triton.language as tl
from torch.autograd import DeviceType
from triton.testing import do_bench

import onepass
from onepass.bench.generate import step_bytes, step_floor_ms
from onepass.bench.harness import environment, measure_ceilings
from onepass.models.configs import CONFIGS, build
from onepass.ops import dispatch
from onepass.ops.dispatch import launch_next_kernel, wait_for_previous_kernel

CATEGORIES = [  # first match wins (kernel names lower-cased)
    ("linear", r"decode_linear|gemv|gemm|nvjet|cutlass|xmma|splitk|cublas"),
    ("attention", r"attention|attn|flash|fmha|decode_split|decode_merge"),
    ("kv cache/rope", r"append_kv|rope|rotary|kv_cache"),
    ("norm", r"norm|rms"),
]


def category(name: str) -> str:
    return next((c for c, pattern in CATEGORIES if re.search(pattern, name.lower())), "other")


def gpu_ops(call) -> list[tuple[str, float, float]]:
    """(name, start us, duration us) of the GPU ops of ``call()``, in launch order."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    ops = [(e.name, e.time_range.start, e.time_range.elapsed_us()) for e in prof.events()
           if e.device_type == DeviceType.CUDA]
    return sorted(ops, key=lambda op: op[1])


def span_us(ops) -> float:
    return max(s + d for _, s, d in ops) - min(s for _, s, _ in ops) if ops else 0.0


def launch_floor_us(kernels: int) -> float:
    """One graph of ``kernels`` one-element adds, replayed: what as many launches cost with no work."""
    x = torch.zeros(1, device="cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        x.add_(1)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(kernels):
            x.add_(1)
    return do_bench(graph.replay, warmup=25, rep=200, return_mode="median") * 1e3


@triton.jit
def _increment_kernel(x_ptr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    tl.store(x_ptr, tl.load(x_ptr) + 1)


def dependent_launch_floor_us(kernels: int) -> float:
    """``launch_floor_us`` for one-element Triton kernels launched as programmatic dependents, as
    onepass's decode kernels are (``dispatch.dependent_launch``): what PDL leaves of a launch's cost."""
    x = torch.zeros(1, device="cuda")
    pdl = dispatch.dependent_launch(x)
    dispatch.launch(_increment_kernel, (1,), x, PDL=pdl)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(kernels):
            dispatch.launch(_increment_kernel, (1,), x, PDL=pdl)
    return do_bench(graph.replay, warmup=25, rep=200, return_mode="median") * 1e3


@triton.jit
def _grid_barrier_kernel(count_ptr, slots_ptr, errors_ptr, n_barriers, n_programs, SPIN_LOAD: tl.constexpr):
    """``n_barriers`` grid-wide barriers in one launch of ``n_programs`` resident programs, as one
    persistent kernel a layer would separate its phases (q/k/v, attention, o, gate/up, down). Each
    round a program stores the round into its slot, arrives (release), waits until every program has
    (acquire), then reads its neighbour's slot: a stale value counts an error. Two slots a program, by
    round parity, so a program already in the next round cannot overwrite a slot still to be read.
    ``SPIN_LOAD``: wait on volatile loads of the count, then one acquiring atomic (else atomics only).
    A wait gives up after 2**22 polls (an error, never a hang)."""
    pid = tl.program_id(0)
    errors = 0
    for i in range(n_barriers):
        slot = (i % 2) * n_programs
        tl.store(slots_ptr + slot + pid, i)
        tl.atomic_add(count_ptr, 1, sem="release")
        target = (i + 1) * n_programs
        polls = 0
        if SPIN_LOAD:
            seen = tl.load(count_ptr, volatile=True)
            while (seen < target) & (polls < 4194304):
                seen = tl.load(count_ptr, volatile=True)
                polls += 1
            seen = tl.atomic_add(count_ptr, 0, sem="acquire")
        else:
            seen = tl.atomic_add(count_ptr, 0, sem="acquire")
            while (seen < target) & (polls < 4194304):
                seen = tl.atomic_add(count_ptr, 0, sem="acquire")
                polls += 1
        stale = tl.load(slots_ptr + slot + (pid + 1) % n_programs) != i
        errors += (stale | (seen < target)).to(tl.int32)
    tl.store(errors_ptr + pid, errors)


@triton.jit
def _phase_kernel(slots_ptr, errors_ptr, phase, n_programs, PDL: tl.constexpr):
    """One phase of a chain of launches, doing what a barrier's round does: each program reads its
    neighbour's slot as the launch before stored it (a stale value counts an error), then stores
    the phase into its own."""
    wait_for_previous_kernel(PDL)
    pid = tl.program_id(0)
    if phase > 0:
        seen = tl.load(slots_ptr + ((phase - 1) % 2) * n_programs + (pid + 1) % n_programs)
        tl.store(errors_ptr + pid, tl.load(errors_ptr + pid) + (seen != phase - 1).to(tl.int32))
    tl.store(slots_ptr + (phase % 2) * n_programs + pid, phase)
    launch_next_kernel(PDL)


def launch_costs(programs: int, rounds: int = 512, log=print) -> dict:
    """What separating two phases of a decode layer costs, a phase each: a kernel boundary (a chain of
    ``rounds`` launches of ``programs`` programs in one graph, as programmatic dependents as onepass's
    decode kernels launch, and plain) against a grid-wide barrier inside one persistent kernel of as
    many programs (``rounds`` barriers; the count zeroed in the graph before it). Each phase stores a
    value a program and reads its neighbour's from the phase before, as a layer's phases hand on
    their outputs. Each the slope between ``rounds`` phases and one, so the graph's own launch cancels."""
    count = torch.zeros(1, dtype=torch.int32, device="cuda")
    slots = torch.full((2 * programs,), -1, dtype=torch.int32, device="cuda")
    errors = torch.zeros(programs, dtype=torch.int32, device="cuda")
    pdl = dispatch.dependent_launch(slots)

    def chain(n, dependent):
        return lambda: [dispatch.launch(_phase_kernel, (programs,), slots, errors, i, programs, PDL=dependent)
                        for i in range(n)]

    def barriers(n, spin_load):
        def record():
            count.zero_()
            dispatch.launch(_grid_barrier_kernel, (programs,), count, slots, errors, n, programs,
                            SPIN_LOAD=spin_load, num_warps=1)
        return record

    def graph_us(record):
        record()  # compiles outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            record()
        return do_bench(graph.replay, warmup=25, rep=300, return_mode="median") * 1e3

    us, stale = {}, {}
    for name, make in (("dependent launches", lambda n: chain(n, pdl)), ("plain launches", lambda n: chain(n, False)),
                       ("grid barriers, spin on atomics", lambda n: barriers(n, False)),
                       ("grid barriers, spin on loads", lambda n: barriers(n, True))):
        errors.zero_()
        us[name] = (graph_us(make(rounds)) - graph_us(make(1))) / (rounds - 1)
        stale[name] = int(errors.sum())
        log(f"{programs} programs, {name}: {us[name]:.2f} us a phase ({stale[name]} stale reads or timed-out waits)")
    return {"programs": programs, "rounds": rounds, "us": us, "errors": stale}


def layer_linear_groups(model) -> list[tuple[str, int]]:
    """(name, weight bytes) of a decoder layer's linear launches once fused (q+k+v, o, gate+up,
    down), in call order; [] if the layer is not of that shape."""
    layer = model.get_decoder().layers[0]
    size = {n: sum(p.numel() * p.element_size() for p in m.parameters())
            for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}
    groups = [("qkv", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]), ("o", ["self_attn.o_proj"]),
              ("gate_up", ["mlp.gate_proj", "mlp.up_proj"]), ("down", ["mlp.down_proj"])]
    if sorted(size) != sorted(n for _, names in groups for n in names):
        return []
    return [(g, sum(size[n] for n in names)) for g, names in groups]


def one_layer(steady: list, per_step: int, layers: int, per_layer: int) -> list[tuple[str, float]] | None:
    """One layer's GPU ops in order, (name, mean us over layers and steps), from ``steady``:
    whole steps of ``per_step`` ops each (any rotation). None where no layer-periodic run is found."""
    names = [n for n, _, _ in steady[:per_step]]
    run = (layers - 1) * per_layer

    def periodic(o):
        return all(names[(o + i) % per_step] == names[(o + i + per_layer) % per_step] for i in range(run))

    if not per_layer or per_layer * layers > per_step:
        return None
    valid = [o for o in range(per_step) if periodic(o)]
    if not valid:
        return None
    start = next(o for o in valid if (o - 1) % per_step not in valid) if len(valid) < per_step else valid[0]
    steps = len(steady) // per_step
    rows = []
    for q in range(per_layer):
        times = [steady[s * per_step + (start + i * per_layer + q) % per_step][2]
                 for s in range(steps) for i in range(layers)]
        rows.append((names[(start + q) % per_step], sum(times) / len(times)))
    return rows


def breakdown(model, name: str, batch: int, cache: int, steps: int, copy_gbps: float, log=print) -> dict:
    config = model.config.get_text_config()
    layers = config.num_hidden_layers
    ids = torch.randint(0, config.vocab_size, (batch, cache), device=model.device)
    decoder = onepass.Decoder(model, batch_size=batch, max_len=cache + steps + 1, eos_token_id=[])
    decoder.generate(ids, 8)  # eager warm-up steps, then the capture
    mode = "CUDA graph replay" if decoder.graph_off is None else f"eager ({decoder.graph_off})"
    wall_ms = (do_bench(lambda: decoder.generate(ids, steps + 1), warmup=1, rep=1500, return_mode="median")
               - do_bench(lambda: decoder.generate(ids, 1), warmup=1, rep=1500, return_mode="median")) / steps

    def profile(d):
        one, many = gpu_ops(lambda: d.generate(ids, 1)), gpu_ops(lambda: d.generate(ids, steps + 1))
        return one, many, (len(many) - len(one)) / steps

    one, many, per_step = profile(decoder)
    if per_step < layers and decoder.graph_off is None:
        mode = "eager (the graph replay's kernels were not traced: fewer GPU ops a step than layers)"
        del decoder
        torch.cuda.empty_cache()
        decoder = onepass.Decoder(model, batch_size=batch, max_len=cache + steps + 1, eos_token_id=[],
                                  cuda_graph=False)
        decoder.generate(ids, 8)
        one, many, per_step = profile(decoder)
    graph_traced = mode.startswith("CUDA graph")
    per_name = defaultdict(lambda: [0, 0.0])
    for sign, ops in ((1, many), (-1, one)):
        for n, _, d in ops:
            per_name[n][0] += sign
            per_name[n][1] += sign * d
    kernels = {n: {"category": category(n), "count": c / steps, "us": t / steps}
               for n, (c, t) in per_name.items() if c > 0}
    kernel_us = sum(k["us"] for k in kernels.values())
    gpu_span_us = (span_us(many) - span_us(one)) / steps if graph_traced else None

    # the floor and each category's own share of it
    floor_ms = step_floor_ms(model, batch, cache, steps, copy_gbps)
    kv_bytes = floor_ms * copy_gbps * 1e6 - step_bytes(model, batch)
    head = model.get_output_embeddings().weight
    head_bytes = head.numel() * head.element_size()
    layer_linear_bytes = sum(p.numel() * p.element_size() for m in model.get_decoder().layers.modules()
                             if isinstance(m, torch.nn.Linear) for p in m.parameters())
    norm_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "norm" in n)
    own_bytes = {"linear": layer_linear_bytes + head_bytes, "attention": kv_bytes, "norm": norm_bytes}
    step_us = wall_ms * 1e3
    cats = {}
    for c in [c for c, _ in CATEGORIES] + ["other"]:
        us = sum(k["us"] for k in kernels.values() if k["category"] == c)
        floor_us = own_bytes.get(c, 0) / copy_gbps / 1e3
        cats[c] = {"us": us, "floor_us": floor_us, "above_floor_frac_of_step": (us - floor_us) / step_us}
    gap_us = step_us - kernel_us
    cats["gap (GPU idle)"] = {"us": gap_us, "floor_us": 0.0, "above_floor_frac_of_step": gap_us / step_us}

    # the linear kernels: the layers' (launched a multiple of num_layers times) and the LM head's
    linear = {"layers": {"bytes": layer_linear_bytes, "names": [], "us": 0.0},
              "LM head": {"bytes": head_bytes, "names": [], "us": 0.0}}
    for n, k in kernels.items():
        if k["category"] == "linear":
            group = linear["layers" if round(k["count"]) % layers == 0 else "LM head"]
            group["names"].append(n)
            group["us"] += k["us"]
    for group in linear.values():
        group["GBps"] = group["bytes"] / group["us"] / 1e3 if group["us"] else None

    # one layer, launch by launch (the steps' ops after the 1-token call's count are whole steps)
    steady = many[len(one):len(one) + (steps - 1) * round(per_step)]
    per_layer = sum(round(k["count"]) // layers for k in kernels.values())
    layer = one_layer(steady, round(per_step), layers, per_layer) if per_step == round(per_step) else None
    layer_rows = [{"name": n, "us": us, "category": category(n)} for n, us in layer or []]
    launches = [row for row in layer_rows if row["category"] == "linear"]
    groups = layer_linear_groups(model)
    if len(launches) == len(groups):  # one launch per group: their weights, in call order
        for row, (g, size) in zip(launches, groups):
            row.update(weights=g, bytes=size, GBps=size / row["us"] / 1e3)
    result = {"model": name, "batch": batch, "cache": cache, "steps": steps, "profiled": mode,
              "wall_ms": wall_ms, "kernel_us": kernel_us, "gap_us": gap_us, "gpu_span_us": gpu_span_us,
              "gpu_ops_per_step": per_step, "launch_floor_us": launch_floor_us(round(per_step)),
              "dependent_launch_floor_us": dependent_launch_floor_us(round(per_step)),
              "floor_ms": floor_ms, "floor_frac": floor_ms / wall_ms, "categories": cats, "linear": linear,
              "kernels": dict(sorted(kernels.items(), key=lambda item: -item[1]["us"])), "one_layer": layer_rows}
    log(report(result, copy_gbps))
    return result


def replayed_step_us(model, batch: int, cache: int, steps: int, pdl: bool) -> tuple[float, float]:
    """(min, median) us of a decode step: ``steps`` replays of the Decoder's captured step from
    position ``cache``, timed by ``do_bench``."""
    dispatch._PDL_OFF = not pdl
    config = model.config.get_text_config()
    ids = torch.randint(0, config.vocab_size, (batch, cache), device=model.device)
    decoder = onepass.Decoder(model, batch_size=batch, max_len=cache + steps + 8, eos_token_id=[])
    decoder.generate(ids, 8)  # the prompt in the cache, eager warm-up steps, then the capture
    graph = decoder._graphs[False]

    def steps_from_the_prompt():
        decoder._index.fill_(cache)
        decoder._position.fill_(cache)
        for _ in range(steps):
            graph.replay()

    times = do_bench(steps_from_the_prompt, warmup=2, rep=800, return_mode="all")
    return min(times) / steps * 1e3, statistics.median(times) / steps * 1e3


def pdl_comparison(model, name: str, batch: int, cache: int, steps: int, rounds: int, copy_gbps: float,
                   log=print) -> dict:
    """``rounds`` rounds of (PDL off, PDL on), each a fresh Decoder captured with the setting."""
    floor_us = step_floor_ms(model, batch, cache, steps, copy_gbps) * 1e3
    pdl_off = dispatch._PDL_OFF  # the process's setting, restored after
    times = {False: [], True: []}
    for _ in range(rounds):
        for pdl in (False, True):
            times[pdl].append(replayed_step_us(model, batch, cache, steps, pdl))
            gc.collect()
            torch.cuda.empty_cache()
    dispatch._PDL_OFF = pdl_off
    by_round = "  ".join(f"{off[0]:.0f}/{on[0]:.0f}" for off, on in zip(times[False], times[True]))
    best = {pdl: min(t[0] for t in times[pdl]) for pdl in times}
    median = {pdl: statistics.median(t[1] for t in times[pdl]) for pdl in times}
    log(f"{name} batch {batch}: step us (min), PDL off/on by round: {by_round}; best off {best[False]:.1f} "
        f"({100 * floor_us / best[False]:.0f}% of floor), on {best[True]:.1f} ({100 * floor_us / best[True]:.0f}%); "
        f"median off {median[False]:.1f}, on {median[True]:.1f}; floor {floor_us:.1f}")
    return {"model": name, "batch": batch, "cache": cache, "steps": steps, "floor_us": floor_us,
            "pdl_off_us": times[False], "pdl_on_us": times[True]}


def report(r: dict, copy_gbps: float) -> str:
    step_us = r["wall_ms"] * 1e3
    lines = [f"== {r['model']}, batch {r['batch']}, cache {r['cache']} + {r['steps']} steps; profiled: {r['profiled']}",
             f"step (wall time, no profiler) {step_us:8.1f} us   floor {r['floor_ms'] * 1e3:8.1f} us "
             f"({100 * r['floor_frac']:.0f}% of floor); the categories' own floors sum to "
             f"{sum(v['floor_us'] for v in r['categories'].values()):.1f} us (not in them: an untied model's input "
             "embedding, of which a step reads one row)",
             f"GPU ops a step {r['gpu_ops_per_step']:.1f}, their sum {r['kernel_us']:.1f} us; gap (wall - sum) "
             f"{r['gap_us']:.1f} us = {r['gap_us'] / max(r['gpu_ops_per_step'], 1):.2f} us per op"
             + (f"; profiled GPU span {r['gpu_span_us']:.1f} us" if r["gpu_span_us"] is not None else ""),
             f"as many one-element kernels in one graph: {r['launch_floor_us']:.1f} us "
             f"({100 * r['launch_floor_us'] / step_us:.0f}% of the step); as many Triton ones launched as "
             f"programmatic dependents: {r['dependent_launch_floor_us']:.1f} us", "",
             f"{'category':<16}{'us/step':>10}{'own floor':>11}{'above floor, % of step':>24}"]
    for c, v in r["categories"].items():
        lines.append(f"{c:<16}{v['us']:10.1f}{v['floor_us']:11.1f}{100 * v['above_floor_frac_of_step']:23.1f}%")
    lines += ["", f"{'linear':<10}{'MB':>8}{'us/step':>10}{'GB/s':>8}{'% copy':>8}  kernels"]
    for g, v in r["linear"].items():
        gbps = v["GBps"] or 0.0
        lines.append(f"{g:<10}{v['bytes'] / 1e6:8.1f}{v['us']:10.1f}{gbps:8.0f}{100 * gbps / copy_gbps:7.0f}%  "
                     + ", ".join(n[:60] for n in v["names"]))
    lines += ["", f"{'kernel':<70}{'category':>14}{'n/step':>8}{'us/step':>9}{'us each':>9}"]
    for n, k in r["kernels"].items():
        lines.append(f"{n[:70]:<70}{k['category']:>14}{k['count']:8.1f}{k['us']:9.1f}{k['us'] / k['count']:9.2f}")
    if r["one_layer"]:
        lines += ["", "one layer, in launch order (mean over layers and steps):"]
        for row in r["one_layer"]:
            extra = (f"  {row['weights']}: {row['bytes'] / 1e6:.1f} MB, {row['GBps']:.0f} GB/s "
                     f"({100 * row['GBps'] / copy_gbps:.0f}% copy)" if "weights" in row else "")
            lines.append(f"  {row['name'][:70]:<70}{row['us']:8.2f} us{extra}")
    else:
        lines += ["", "one layer: no per-layer repetition found in the step's kernel sequence"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", action="append", choices=sorted(CONFIGS),
                        help="a built-in model (repeatable; default: llama-1b, qwen2-1.5b, llama-8b)")
    parser.add_argument("--batch", type=int, action="append", help="a batch size (repeatable; default: 1 and 8)")
    parser.add_argument("--cache", type=int, default=512, help="prompt tokens in the cache before the steps")
    parser.add_argument("--steps", type=int, default=64, help="decode steps timed and profiled")
    parser.add_argument("--pdl-rounds", type=int, default=0,
                        help="instead of the breakdown: this many rounds of the step with PDL off and on")
    parser.add_argument("--launch-costs", action="store_true",
                        help="instead of the breakdown: a phase boundary as a launch against a grid barrier")
    parser.add_argument("--out", help="JSON file for the results")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("decode_breakdown needs a CUDA GPU")
    if args.launch_costs:
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        print(f"{torch.cuda.get_device_name()}: torch {torch.__version__}, triton {triton.__version__}", flush=True)
        summary = {"launch_costs": [launch_costs(p) for p in (sms, 2 * sms)]}
        if args.out:
            with open(args.out, "w") as f:
                json.dump(summary, f, indent=1)
        return summary
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]):
        pass  # CUPTI up before any capture, so that graph replays' kernels are traced
    ceilings = measure_ceilings()
    env = environment(ceilings)
    print(f"{env['gpu']}: copy {ceilings.copy_gbps:.0f} GB/s; torch {env['torch']}, triton {env['triton']}", flush=True)
    results = []
    log = functools.partial(print, flush=True)
    for name in args.model or ["llama-1b", "qwen2-1.5b", "llama-8b"]:
        torch.manual_seed(0)
        model = onepass.optimize(build(name, device="cuda"))
        for batch in args.batch or [1, 8]:
            results.append(pdl_comparison(model, name, batch, args.cache, args.steps, args.pdl_rounds,
                                          ceilings.copy_gbps, log) if args.pdl_rounds
                           else breakdown(model, name, batch, args.cache, args.steps, ceilings.copy_gbps, log))
            gc.collect()
            torch.cuda.empty_cache()
        del model
        gc.collect()
        torch.cuda.empty_cache()
    summary = {"env": env, "results": results}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
    return summary


if __name__ == "__main__":
    main()
