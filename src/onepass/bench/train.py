"""``onepass bench train``: one end-to-end training step of a whole model, variant by variant.

    run(model="llama-1b", batch=4, seq=2048)

Each variant trains a fresh model (random weights, bf16, ``AdamW(fused=True)``) on the
same random tokens with labels: eager Hugging Face (sdpa attention), ``torch.compile`` of
it, Liger-Kernel's patch (when importable), ``onepass.optimize``, onepass +
``torch.compile``, and onepass with SDPA attention or without recomputation (the
activations it rebuilds in backward kept instead); a last row runs ``onepass.optimize``
with ``onepass.optim.AdamW`` (the same update, through ``onepass.ops.adamw_step``) instead
of torch's fused AdamW. After warm-up (compilation, autotuning) it times each step with
CUDA events and reports the median tokens/s and the peak memory allocated during the
timed steps (weights, gradients and optimizer state included, as ``max_memory_allocated``).

Steps are timed twice. First back to back, as a trainer runs them (Hugging Face's Trainer
keeps the loss on the device between logging steps): the host queues each step while the
GPU runs the last, and a step's time is between its events on the GPU; this is the row's
tokens/s. Then with a host sync after every step (``synced``), where the GPU idles at each
step's start until the host has queued enough work again: the gap between the two columns
is host time that a variant's Python, launches or own syncs (Liger's loss reads a count
back every step) leave the GPU waiting for.

Each variant of each round runs in a fresh Python process, so nothing one variant leaves
behind reaches the next: Liger's patch of a model instance also rebinds names in its
transformers module (``LlamaRMSNorm``, ``LlamaMLP``, ...), so that a model built after it
in the same process runs Liger's kernels, and after torch.compile and Liger had run, the next
variant held more memory allocated, which the row's peak (the highest of its rounds) carried
(the runs that showed both are in CHANGELOG.md).

A GPU's clock under this load follows its power and temperature, so a variant's time
depends on when in the run it is measured (by a few percent between the first variant and
the last; numbers in CHANGELOG.md). The run therefore heats the GPU before the first variant (``HEAT_S`` of matmuls),
measures the variants in ``ROUNDS`` rounds, in order and then in reverse order, and reports
for each the mean of its rounds' medians: a clock that drifts down as the GPU heats (at its
power cap) costs every variant about the same. Each row also shows the median SM
clock and power that nvidia-smi read during its timed steps, so that what differs between
rows besides the code is on the table.

The floor: the step's matmul FLOPs at the bf16 matmul rate measured in this run, plus its
minimum memory-bound bytes at the copy bandwidth measured in this run (see
``step_floor``); each variant is reported as a fraction of the floor's tokens/s.

``lora_rank`` (``--lora R``): LoRA fine-tuning instead. Each fresh model is wrapped by PEFT
with rank-R adapters on q/k/v/o/gate/up/down (PEFT's defaults otherwise: fp32 adapters on
the bf16 base), the base frozen; the variants are ``LORA_VARIANTS`` and the results go to
``train-lora.{json,md}``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

VARIANTS = ("eager", "torch.compile", "liger", "onepass", "onepass+torch.compile", "onepass, SDPA attention",
            "onepass, no recompute", "onepass + onepass AdamW")
# optimize() switches of the onepass variants ("no recompute": the activations that onepass
# recomputes in backward kept instead, to show what recomputing costs and saves)
ONEPASS_SWITCHES = {"onepass": {}, "onepass+torch.compile": {}, "onepass, SDPA attention": {"attention": False},
                    "onepass, no recompute": {"recompute": False}, "onepass + onepass AdamW": {}}

LORA_VARIANTS = ("eager", "torch.compile", "liger", "onepass", "onepass+torch.compile")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# Timed steps after warm-up (the compiled variants compile during warm-up).
WARMUP_STEPS = 3
TIMED_STEPS = 20
HEAT_S = 20.0  # seconds of bf16 matmuls before the first variant
ROUNDS = 2  # rounds over the variants, alternately in order and in reverse


@dataclass
class Result:
    variant: str
    tokens_per_s: float | None = None
    step_ms: float | None = None  # median, steps back to back
    peak_gib: float | None = None
    frac_floor: float | None = None
    loss: float | None = None
    error: str | None = None
    note: str | None = None
    sm_mhz: float | None = None  # median SM clock and power during the timed steps (nvidia-smi)
    watts: float | None = None
    synced_step_ms: float | None = None  # median, a host sync after every step
    round_step_ms: list[float] | None = None  # each round's median (step_ms is their mean)


def combine_rounds(rounds: list[Result]) -> Result:
    """One variant's rounds as one row: the means of the rounds' medians and readings, the
    highest peak (None where none was read: a CPU run); a failed round fails the row."""
    failed = next((r for r in rounds if r.error), None)
    if failed:
        return failed
    first = rounds[0]

    def mean(name):
        values = [getattr(r, name) for r in rounds if getattr(r, name) is not None]
        return statistics.fmean(values) if values else None

    step = mean("step_ms")
    tokens = first.tokens_per_s * first.step_ms / 1e3  # a step's tokens
    return Result(first.variant, tokens_per_s=tokens / (step / 1e3), step_ms=step,
                  peak_gib=max((r.peak_gib for r in rounds if r.peak_gib is not None), default=None),
                  loss=rounds[-1].loss, note=first.note,
                  sm_mhz=mean("sm_mhz"), watts=mean("watts"), synced_step_ms=mean("synced_step_ms"),
                  round_step_ms=[r.step_ms for r in rounds])


# -------------------------------------------------------------------- the GPU's state


def heat(seconds: float) -> None:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    end = torch.cuda.Event()
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        for _ in range(20):
            a @ a
        end.record()
        end.synchronize()


def sample_gpu() -> Callable[[], tuple[float | None, float | None]]:
    """Start reading the current GPU's SM clock (MHz) and power (W) from nvidia-smi every
    0.2 s in a thread; the returned ``stop()`` gives their medians (None without nvidia-smi)."""
    index = torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    query = ["nvidia-smi", f"--id={f'GPU-{uuid}' if uuid is not None else index}",
             "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits"]
    samples, done = [], threading.Event()

    def poll():
        while not done.wait(0.2):
            try:
                out = subprocess.run(query, capture_output=True, text=True, timeout=5, check=False).stdout
                samples.append(tuple(float(v) for v in out.split(",")))
            except (OSError, ValueError, subprocess.SubprocessError):
                return

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()

    def stop():
        done.set()
        thread.join()
        if not samples:
            return None, None
        return statistics.median(s[0] for s in samples), statistics.median(s[1] for s in samples)

    return stop


# ------------------------------------------------------------------------- the floor


def step_floor(model: torch.nn.Module, batch: int, seq: int) -> tuple[float, float]:
    """(matmul FLOPs, minimum memory-bound bytes) of one training step of ``model`` (built on
    the meta device: only shapes and which parameters train are read), bf16.

    FLOPs: per token, 6 per weight of every linear that trains (forward 2, backward 4) and
    4 per weight of a frozen one (no weight gradient; the LM head counted once even when
    tied), plus causal attention, 7 b s^2 H d per layer (forward 2, backward 5 of the full
    4 b s^2 H d, halved by the mask).

    Bytes (2 a bf16 element), what no fusion can avoid: for a parameter that trains the
    optimizer reads it, its gradient and both moments and writes it and the moments (7),
    the forward and backward read it (2) and write its gradient (1); a frozen one is only
    read twice; per layer and token the activations that must cross HBM once between
    matmuls: the two add+norm passes (4 h each way), rope (2 (q+k) each way), attention's
    q, k, v, o and their gradients (read q, k, v and write o, and as much again backward),
    the gated MLP (3 i forward, 5 i backward; GPT-2's ungated one counted the same).
    """
    from transformers.pytorch_utils import Conv1D  # (GPT-2's projections)

    config = model.config
    h, layers = config.hidden_size, config.num_hidden_layers
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads  # (GPT-2's config names none)
    d = getattr(config, "head_dim", None) or h // heads
    inter = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * h
    tokens = batch * seq
    linears = [m.weight for m in model.modules() if isinstance(m, (torch.nn.Linear, Conv1D))]
    flops = tokens * sum((6 if w.requires_grad else 4) * w.numel() for w in linears)
    flops += 7 * batch * seq * seq * heads * d * layers
    q, kv = heads * d, kv_heads * d
    per_token_layer = 2 * (4 * h) * 2 + 2 * 2 * (q + kv) + 2 * (q + 2 * kv) + 2 * q + 8 * inter
    params = list(model.parameters())
    weight_passes = sum((10 if p.requires_grad else 2) * p.numel() for p in params)
    elem = 2
    bytes_ = elem * (weight_passes + tokens * layers * per_token_layer)
    return float(flops), float(bytes_)


# ------------------------------------------------------------------------- variants


def liger_patch() -> Callable | None:
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
    except ImportError:
        return None
    return _apply_liger_kernel_to_instance


def _prepare(variant: str, model: torch.nn.Module):
    """The callable that runs the forward for ``variant`` (the model patched as needed)."""
    import onepass

    if variant == "eager":
        return model
    if variant == "torch.compile":
        return torch.compile(model)
    if variant == "liger":
        patch = liger_patch()
        if patch is None:
            raise ImportError("liger_kernel is not importable here")
        patch(model=model.get_base_model() if hasattr(model, "get_base_model") else model)
        return model
    onepass.optimize(model, **ONEPASS_SWITCHES[variant])
    return torch.compile(model) if variant == "onepass+torch.compile" else model


def onepass_note(model: torch.nn.Module) -> str:
    """What ``onepass.optimize`` left unfused or off in ``model``, for a row's note."""
    import onepass

    kinds = {name: line.split(":")[0] for name, line in onepass.optimize_report(model).items()}
    notes = [f"{kind}: " + ", ".join(name for name, k in kinds.items() if k == kind)
             for kind in ("unfused", "off") if kind in kinds.values()]
    return "; ".join(notes) or "all switches on"


def _optimizer(variant: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    """torch's fused AdamW over the parameters that train, the step every variant shares;
    onepass's AdamW (the same update) in its own row."""
    params = [p for p in model.parameters() if p.requires_grad]
    if variant.endswith("onepass AdamW"):
        from onepass.optim import AdamW

        return AdamW(params, lr=1e-4)
    return torch.optim.AdamW(params, lr=1e-4, fused=True)


def with_lora(model: torch.nn.Module, rank: int) -> torch.nn.Module:
    """``model`` wrapped by PEFT with rank-``rank`` adapters on every projection, base frozen."""
    import peft

    return peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=LORA_TARGETS))


def _step_times(step: Callable[[], torch.Tensor], synced: bool) -> list[float]:
    """Milliseconds of ``TIMED_STEPS`` steps, each between CUDA events around it; with
    ``synced`` the host waits for each step before queueing the next."""
    events = []
    for _ in range(TIMED_STEPS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        events.append((start, end))
        if synced:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def _build(model: str, lora_rank: int, device: str) -> torch.nn.Module:
    from onepass.models.configs import build

    built = build(model, device, torch.bfloat16)
    return with_lora(built, lora_rank) if lora_rank else built


def _measure(variant: str, model: str, batch: int, seq: int, lora_rank: int) -> Result:
    """One variant's row in this process: build, patch, warm up, time."""
    result = Result(variant)
    try:
        torch.manual_seed(0)
        net = _build(model, lora_rank, "cuda").train()
        g = torch.Generator(device="cuda").manual_seed(0)
        ids = torch.randint(0, net.config.vocab_size, (batch, seq), device="cuda", generator=g)
        forward = _prepare(variant, net)
        opt = _optimizer(variant, net)

        def step():
            loss = forward(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        for _ in range(WARMUP_STEPS):
            step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        stop_sampling = sample_gpu()
        result.step_ms = statistics.median(_step_times(step, synced=False))
        result.synced_step_ms = statistics.median(_step_times(step, synced=True))
        result.sm_mhz, result.watts = stop_sampling()
        loss = step()
        result.tokens_per_s = ids.numel() / (result.step_ms / 1e3)
        result.peak_gib = torch.cuda.max_memory_allocated() / 2**30
        result.loss = loss.item()
        if variant.startswith("onepass"):
            result.note = onepass_note(net)
    except Exception as e:  # one variant failing (out of memory, no Liger) is reported, not fatal
        result.error = f"{type(e).__name__}: {e}"[:300]
    return result


def _measure_apart(variant: str, model: str, batch: int, seq: int, lora_rank: int, log) -> Result:
    """``_measure`` in a fresh Python process (``python -m onepass.bench.train SPEC``), whose
    last line of output is the row as JSON; a process that dies (a crash in a kernel, say)
    gives a failed row with the end of its error output."""
    spec = json.dumps({"variant": variant, "model": model, "batch": batch, "seq": seq, "lora_rank": lora_rank})
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[2])  # the folder holding this onepass package
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-m", "onepass.bench.train", spec], capture_output=True, text=True,
                          env=env, check=False)
    lines = proc.stdout.strip().splitlines()
    try:
        result = Result(**json.loads(lines[-1]))
    except (IndexError, ValueError, TypeError):
        tail = " ".join(proc.stderr.strip().splitlines()[-3:])
        result = Result(variant, error=f"the measuring process exited with code {proc.returncode}: {tail}"[:300])
    log(f"  {variant:<22} " + (f"{result.tokens_per_s / 1e3:7.1f}k tokens/s  {result.step_ms:8.1f} ms/step  "
                               f"peak {result.peak_gib:5.1f} GiB  loss {result.loss:.3f}"
                               if result.error is None else f"failed: {result.error}"))
    return result


# ------------------------------------------------------------------------------ run


def run(model: str = "llama-1b", batch: int = 4, seq: int = 2048, out_dir: str | Path = "benchmarks/results",
        variants: tuple[str, ...] | None = None, lora_rank: int = 0, log=print) -> dict:
    """Time one training step of ``model`` per variant; write ``<out_dir>/<gpu>/train.{json,md}``
    (``train-lora.*`` with ``lora_rank``)."""
    if not torch.cuda.is_available():
        raise RuntimeError("the training benchmark needs a CUDA GPU")
    from onepass.bench.harness import environment, gpu_folder, measure_ceilings

    log("measuring the copy bandwidth and the bf16 matmul rate ...")
    ceilings = measure_ceilings()
    env = environment(ceilings)
    log(f"{env['gpu']}: copy {env['copy_GBps']:.0f} GB/s, bf16 matmul {env['matmul_bf16_TFLOPs']:.0f} TFLOP/s")

    variants = variants or (LORA_VARIANTS if lora_rank else VARIANTS)
    probe = _build(model, lora_rank, "meta")
    n_params = sum(p.numel() for p in probe.parameters())
    flops, bytes_ = step_floor(probe, batch, seq)
    del probe
    floor_s = flops / (ceilings.matmul_tflops * 1e12) + bytes_ / (ceilings.copy_gbps * 1e9)
    floor_tps = batch * seq / floor_s
    log(f"{model}, batch {batch} x {seq}: floor {floor_tps / 1e3:.1f}k tokens/s "
        f"({flops / 1e12:.1f} TFLOP, {bytes_ / 2**30:.1f} GiB memory-bound)")

    log(f"heating the GPU for {HEAT_S:.0f} s ...")
    heat(HEAT_S)
    rounds: dict[str, list[Result]] = {variant: [] for variant in variants}
    for i in range(ROUNDS):
        log(f"round {i + 1} of {ROUNDS}")
        for variant in variants if i % 2 == 0 else variants[::-1]:
            rounds[variant].append(_measure_apart(variant, model, batch, seq, lora_rank, log))
    results = [combine_rounds(rounds[variant]) for variant in variants]
    for r in results:
        if r.tokens_per_s:
            r.frac_floor = r.tokens_per_s / floor_tps

    summary = {
        "env": env, "model": model, "batch": batch, "seq": seq, "params": n_params, "rounds": ROUNDS,
        "lora_rank": lora_rank,
        "floor": {"tokens_per_s": floor_tps, "matmul_tflop": flops / 1e12, "memory_gib": bytes_ / 2**30},
        "results": [asdict(r) for r in results],
    }
    folder = Path(out_dir) / gpu_folder(env["gpu"])
    folder.mkdir(parents=True, exist_ok=True)
    name = "train-lora" if lora_rank else "train"
    (folder / f"{name}.json").write_text(json.dumps(summary, indent=2) + "\n")
    (folder / f"{name}.md").write_text(to_markdown(summary))
    log(f"wrote {folder / name}.json and {name}.md")
    return summary


def to_markdown(summary: dict) -> str:
    env, floor = summary["env"], summary["floor"]
    by_name = {r["variant"]: r for r in summary["results"]}
    liger = by_name.get("liger", {})
    rank = summary.get("lora_rank")
    what = (f"LoRA rank {rank} on every projection (PEFT, fp32 adapters, base frozen)" if rank
            else "torch's AdamW(fused=True) unless the row says otherwise")
    lines = [
        f"# train step: {summary['model']}, batch {summary['batch']} x {summary['seq']}, bf16, {what}",
        "", f"{env['gpu']}; torch {env['torch']}, triton {env['triton']}, {env['date']}; copy bandwidth "
        f"{env['copy_GBps']:.0f} GB/s, bf16 matmul {env['matmul_bf16_TFLOPs']:.0f} TFLOP/s (measured in this run).",
        "", f"Command: `{env['command']}`", "",
        f"Floor of the step: {floor['tokens_per_s'] / 1e3:.1f}k tokens/s ({floor['matmul_tflop']:.1f} TFLOP at the "
        f"matmul rate + {floor['memory_gib']:.1f} GiB at the copy bandwidth).", "",
        ("| variant | tokens/s | ms/step | peak GiB | % of floor | vs Liger tokens/s | vs Liger memory | "
         "synced: ms/step, vs Liger | SM MHz, W | note |"),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summary["results"]:
        if r["error"]:
            lines.append(f"| {r['variant']} | failed: {r['error'][:80]} | | | | | | | | |")
            continue
        gpu = f"{r['sm_mhz']:.0f}, {r['watts']:.0f}" if r.get("sm_mhz") is not None else "—"
        vs_t = f"{r['tokens_per_s'] / liger['tokens_per_s']:.2f}x" if liger.get("tokens_per_s") else "—"
        vs_m = f"{r['peak_gib'] / liger['peak_gib']:.2f}x" if liger.get("peak_gib") else "—"
        synced = f"{r['synced_step_ms']:.1f}" + (f", {liger['synced_step_ms'] / r['synced_step_ms']:.2f}x"
                                                  if liger.get("synced_step_ms") else "")
        lines.append(f"| {r['variant']} | {r['tokens_per_s'] / 1e3:.1f}k | {r['step_ms']:.1f} | {r['peak_gib']:.1f} | "
                     f"{100 * r['frac_floor']:.0f} | {vs_t} | {vs_m} | {synced} | {gpu} | {r['note'] or ''} |")
    target = ("" if rank else "Target (issue 6): onepass >= 1.1x Liger's tokens/s at <= 0.9x Liger's peak memory; "
              "onepass + torch.compile no slower than onepass. ")
    lines += ["", target + "Tokens/s: steps back to back; \"synced\": a host "
              f"sync after every step. Each figure is the mean of {summary.get('rounds', 1)} "
              "rounds' medians, the variants measured in order, then in reverse (see the module docstring of "
              "onepass.bench.train)."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # one variant, in its own process (see _measure_apart)
    print(json.dumps(asdict(_measure(**json.loads(sys.argv[1])))))
