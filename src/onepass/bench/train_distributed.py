"""``onepass bench train --gpus N``: a training step under FSDP2, one process per GPU of one host.

    run_distributed(model="llama-3b", gpus=2, batch=2, seq=2048)

The recipe as a new user writes it: the model built on the meta device in fp32, patched
there (``onepass.optimize``, Liger's patch), sharded (``shard``: ``fully_shard`` on each
decoder layer, then the root, ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``),
``to_empty`` on the rank's GPU and a seeded random init of its shards (``init_weights``: the
8B model never exists whole on one GPU), torch's ``AdamW(fused=True)``. Variants: eager
Hugging Face (sdpa attention), ``torch.compile`` of each decoder layer (torchtitan's way),
Liger, onepass, onepass + ``torch.compile`` of each layer. A step: forward with labels (and
``use_cache=False``), backward, optimizer step, ``zero_grad``, on the rank's own ``batch`` x
``seq`` random tokens.

As in ``onepass.bench.train``, each variant of each round runs in a fresh process group
(``torchrun --standalone --nproc_per_node N -m onepass.bench.train_distributed SPEC``), in
``ROUNDS`` rounds alternately in order and in reverse, a figure the mean of the rounds'
medians. Heat: first, one torchrun process runs ``HEAT_S`` of bf16 matmuls on every GPU at
once, then its rank 0 measures the copy bandwidth and bf16 matmul rate of one (hot) GPU.
Steps are timed between CUDA events on each rank, a step's time the slowest rank's
(all_reduce MAX), the row's the median of ``TIMED_STEPS`` after ``WARMUP_STEPS``; tokens/s
per GPU = batch x seq / that median; MFU = the step's model matmul FLOPs per GPU
(``step_floor``'s count, without what checkpointing recomputes) / (median x measured
rate); peak = the highest rank's ``max_memory_allocated`` over the timed steps.

This module holds the recipe (``shard``, ``init_weights``), the per-rank process (the
torchrun entry point: the heat job, or one ``train`` job, which ``onepass.bench.max_seq``'s
trials run too), the parent's ``launch`` and the benchmark (``run_distributed``). Without a
CUDA GPU it all runs on CPU processes over gloo in fp32: a smoke test (-tiny models,
perf_counter times, no peak memory).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from onepass.bench.train import Result, combine_rounds, heat, liger_patch, onepass_note, sample_gpu, step_floor

VARIANTS = ("eager", "torch.compile", "liger", "onepass", "onepass+torch.compile")
WARMUP_STEPS = 3
TIMED_STEPS = 8
HEAT_S = 20.0  # seconds of bf16 matmuls on every GPU before the first variant
ROUNDS = 2
VARIANT_TIMEOUT_S = 420.0  # one variant's process, torch.compile's first graphs included
RESULT_TAG, ENV_TAG, TRACE_TAG = "onepass-result ", "onepass-env ", "[onepass rank "


@dataclass
class DistResult(Result):
    mfu: float | None = None  # the step's model matmul FLOPs per GPU / (step time x measured matmul rate)
    reserved_gib: float | None = None  # the highest rank's max_memory_reserved


def log_line(text: str) -> None:
    """A progress line, stamped and flushed (a run cut off still shows what it measured)."""
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


# ------------------------------------------------------------------------- the recipe


def shard(model: torch.nn.Module, *, reshard_after_forward: bool = True, head_unit: bool = False,
          compile_blocks: bool = False, checkpoint: bool = False, mp: bool = True) -> torch.nn.Module:
    """Shard a Hugging Face causal LM with FSDP2 (``fully_shard``) as a new user does; returns it.

    Each decoder layer of ``model.model.layers`` becomes a unit, first wrapped by torch's
    ``checkpoint_wrapper`` (``checkpoint``: its activations recomputed in backward), then
    ``torch.compile``-d (``compile_blocks``), torchtitan's order, the result replacing the
    layer in the list; with ``head_unit`` the LM head is a unit of its own (an untied head
    only); then the root. ``mp``: ``MixedPrecisionPolicy(param_dtype=bf16,
    reduce_dtype=fp32)``, else FSDP's default (the weights' dtype throughout). Needs a
    process group; patch the model (``onepass.optimize``, Liger) first. On a meta-device
    model, follow with ``model.to_empty(device=...)`` and ``init_weights``.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if head_unit and model.get_input_embeddings().weight is model.get_output_embeddings().weight:
        raise ValueError("head_unit: the LM head shares its weight with the input embedding; it stays in the root unit")
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mp
              else MixedPrecisionPolicy())
    layers = model.model.layers
    for i, layer in enumerate(layers):
        if checkpoint:
            layer = checkpoint_wrapper(layer, preserve_rng_state=False)
        if compile_blocks:
            layer = torch.compile(layer)
        fully_shard(layer, mp_policy=policy, reshard_after_forward=reshard_after_forward)
        layers[i] = layer
    if head_unit:
        fully_shard(model.lm_head, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    return fully_shard(model, mp_policy=policy, reshard_after_forward=reshard_after_forward)


@torch.no_grad()
def init_weights(model: torch.nn.Module, seed: int) -> None:
    """Random weights on the shards a rank holds (after ``to_empty``): normal(0, 0.02) for
    matrices (linears, embeddings), 1 for norm weights, 0 for biases; and the non-persistent
    buffers that ``to_empty`` left undefined (rotary ``inv_freq``) rebuilt from the config."""
    from torch.distributed.tensor import DTensor

    g = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        if name.endswith("bias"):
            local.zero_()
        elif p.ndim == 1:
            local.fill_(1.0)
        else:
            local.normal_(0.0, 0.02, generator=g)
    for module in model.modules():
        if hasattr(module, "inv_freq"):
            for name, buffer in type(module)(module.config).named_buffers(recurse=False):  # a fresh one, on the CPU
                getattr(module, name).copy_(buffer)


def _patch(variant: str, model: torch.nn.Module) -> None:
    """Patch ``model`` (on meta) for ``variant``; the per-layer compile comes in ``shard``."""
    if variant.startswith("onepass"):
        import onepass

        onepass.optimize(model)
    elif variant.startswith("liger"):
        patch = liger_patch()
        if patch is None:
            raise ImportError("liger_kernel is not importable here")
        patch(model=model)


# ------------------------------------------------------------ inside each rank's process


def _steps(step: Callable[[], torch.Tensor], n: int, cuda: bool) -> tuple[list[float], torch.Tensor]:
    """Milliseconds of ``n`` steps back to back (CUDA events, else perf_counter), the last loss."""
    marks = []
    for _ in range(n):
        start = torch.cuda.Event(enable_timing=True) if cuda else time.perf_counter()
        if cuda:
            start.record()
        loss = step()
        end = torch.cuda.Event(enable_timing=True) if cuda else time.perf_counter()
        if cuda:
            end.record()
        marks.append((start, end))
    if cuda:
        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in marks], loss
    return [1e3 * (e - s) for s, e in marks], loss


def _train(spec: dict, device: torch.device) -> DistResult:
    """One variant on this rank: build on meta, patch, shard, materialise, warm up, time."""
    import torch.distributed as dist

    from onepass.models.configs import build

    variant, cuda, rank = spec["variant"], device.type == "cuda", dist.get_rank()
    model = build(spec["model"], "meta", torch.float32).train()
    _patch(variant, model)
    shard(model, head_unit=spec.get("head_unit", False), compile_blocks=variant.endswith("torch.compile"),
          checkpoint=spec.get("checkpoint", False), mp=spec.get("mp", cuda))
    model.to_empty(device=device)
    init_weights(model, seed=rank)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    g = torch.Generator(device=device).manual_seed(1000 + rank)
    ids = torch.randint(0, model.config.vocab_size, (spec["batch"], spec["seq"]), device=device, generator=g)

    def step():  # no KV cache: HF's would keep every layer's keys and values past checkpointing
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    _steps(step, spec.get("warmup", WARMUP_STEPS), cuda)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    stop_sampling = sample_gpu() if cuda and rank == 0 else None
    times, loss = _steps(step, spec.get("timed", TIMED_STEPS), cuda)
    result = DistResult(variant, loss=loss.item())  # rank 0's loss
    if stop_sampling:
        result.sm_mhz, result.watts = stop_sampling()
    peaks = [torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()] if cuda else [0, 0]
    slowest = torch.tensor(times + peaks, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # each step's slowest rank, the highest peaks
    *times, peak, reserved = slowest.tolist()
    result.step_ms = statistics.median(times)
    result.tokens_per_s = spec["batch"] * spec["seq"] / (result.step_ms / 1e3)
    if cuda:
        result.peak_gib, result.reserved_gib = peak / 2**30, reserved / 2**30
    notes = [onepass_note(model)] if variant.startswith("onepass") else []
    if variant.endswith("torch.compile"):  # dynamo stops compiling a code object after its recompile limit
        from torch._dynamo.utils import counters

        notes.append(f"dynamo graphs: {counters['stats']['unique_graphs']} for {len(model.model.layers)} layers")
    result.note = "; ".join(notes) or None
    return result


def _describe(device: torch.device, ceilings: bool) -> dict:
    """The environment the results record; with ``ceilings``, this GPU's copy bandwidth and
    bf16 matmul rate (on a CPU, a rough fp32 matmul rate: a smoke run)."""
    import platform

    import torch.distributed as dist
    import triton

    env = {"gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "gpus": dist.get_world_size(),
           "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if ceilings and device.type == "cuda":
        from onepass.bench.harness import measure_ceilings

        measured = measure_ceilings()
        env.update(copy_GBps=round(measured.copy_gbps, 1), matmul_bf16_TFLOPs=round(measured.matmul_tflops, 1))
    elif ceilings:
        a, t = torch.randn(512, 512), time.perf_counter()
        for _ in range(10):
            a @ a
        env.update(copy_GBps=None, matmul_bf16_TFLOPs=10 * 2 * 512**3 / (time.perf_counter() - t) / 1e12)
    return env


def error_text(e: BaseException) -> str:
    """A failed row's error: the exception in 300 characters, keeping the word that memory
    ran out (the end of NCCL's long messages says so), which ``onepass.bench.max_seq`` reads."""
    text = f"{type(e).__name__}: {e}"
    if "out of memory" in text.lower() and "out of memory" not in text[:300].lower():
        return text[:280] + " ... out of memory"
    return text[:300]


def _rank_main(spec: dict) -> None:
    """One rank of a torchrun process: the heat job (heat every GPU; rank 0 measures the
    ceilings) or one variant's ``_train``. Rank 0 prints the environment and the row as tagged
    lines (the row once every rank is done); a rank that fails prints its row with the error,
    its traceback on stderr, and exits at once with code 1 (torchrun then ends the others,
    waiting in a collective)."""
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    rank = dist.get_rank()
    try:
        result = DistResult(spec["job"])
        if spec["job"] == "heat" and cuda:
            dist.barrier()
            heat(spec["seconds"])
        if rank == 0:  # first: a trial that fails still tells which GPU it ran on
            print(ENV_TAG + json.dumps(_describe(device, ceilings=spec["job"] == "heat")), flush=True)
        if spec["job"] == "train":
            result = _train(spec, device)
        dist.barrier()  # every rank done: the row stands, whatever the teardown does
    except BaseException as e:
        row = DistResult(spec.get("variant", spec["job"]), error=error_text(e))
        print(RESULT_TAG + json.dumps(asdict(row)), flush=True)
        for line in traceback.format_exc().splitlines()[-25:]:
            print(f"{TRACE_TAG}{rank}] {line}", file=sys.stderr, flush=True)
        os._exit(1)
    if rank == 0:
        print(RESULT_TAG + json.dumps(asdict(result)), flush=True)
    sys.stderr.flush()
    os._exit(0)  # no process-group teardown: gloo's aborted now and then ("terminate called"), after the work


# --------------------------------------------------------------------- the parent's side


def _end(pid: int) -> None:
    """SIGKILL torchrun (``pid``) and its ranks, each leading a process group (with its compile workers);
    torchrun stopped first, so that no rank it starts after the list is read escapes it."""
    try:
        os.killpg(pid, signal.SIGSTOP)
    except (ProcessLookupError, PermissionError):
        pass
    ranks = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):  # the threads' children
        try:
            ranks += [int(p) for p in task.read_text().split()]
        except OSError:
            pass
    for leader in [pid, *ranks]:
        try:
            os.killpg(leader, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


@contextlib.contextmanager
def _handling(handler, *signums):
    """Within: ``handler`` for ``signums`` (main thread only: elsewhere Python cannot set one), then the
    handlers before (a handler not set from Python reads None: left as it is)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, handler) for signum in signums}
    try:
        yield
    finally:
        for signum, before in previous.items():
            if before is not None:
                signal.signal(signum, before)


def _exit(signum, frame):
    raise SystemExit(128 + signum)


def _ending_on_sigterm():
    """Within: SIGTERM raises SystemExit (143), as Ctrl-C raises KeyboardInterrupt, so ``launch`` ends
    torchrun's process group before this process exits (the default SIGTERM exits at once)."""
    return _handling(_exit, signal.SIGTERM)


def _signals_ignored():
    return _handling(signal.SIG_IGN, signal.SIGINT, signal.SIGTERM)


def _tagged(out: str, tag: str) -> list[dict]:
    """The JSON objects that follow ``tag`` in ``out``: ranks failing at once write their rows into
    one pipe, where one rank's line can run into another's."""
    decoder, found = json.JSONDecoder(), []
    for chunk in out.split(tag)[1:]:
        try:
            found.append(decoder.raw_decode(chunk)[0])
        except ValueError:
            pass
    return found


def launch(gpus: int, spec: dict, timeout_s: float,
           log: Callable[[str], None] = log_line) -> tuple[DistResult, dict | None]:
    """Run ``spec`` in a fresh torchrun process group of ``gpus`` processes: its row (failed
    where a rank failed, the process died or ran past ``timeout_s``: then the end of a failed
    rank's traceback is logged) and the environment its rank 0 reported."""
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[2])  # the folder holding this onepass package
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}",
           "-m", "onepass.bench.train_distributed", json.dumps(spec)]
    timed_out = False
    proc = None
    with _ending_on_sigterm():
        try:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                    start_new_session=True)
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _end(proc.pid)
            out, err = proc.communicate()
            timed_out = True
        except BaseException:  # Ctrl-C or SIGTERM: the ranks, in their own session, would run on (and hold GPUs)
            if proc is not None:
                with _signals_ignored():  # (a second Ctrl-C must not cut the cleanup short)
                    _end(proc.pid)
                    proc.wait()
            raise
    rows = [DistResult(**row) for row in _tagged(out, RESULT_TAG)]
    envs = _tagged(out, ENV_TAG)
    row = next((r for r in rows if r.error), rows[0] if rows else None)  # a success: printed once all ranks were done
    if row is None:
        why = (f"timed out after {timeout_s:.0f} s" if timed_out else
               f"torchrun exited with code {proc.returncode}: " + " ".join(err.strip().splitlines()[-2:]))
        row = DistResult(spec.get("variant", spec["job"]), error=why[:300])
    traces = [line for line in err.splitlines() if line.startswith(TRACE_TAG)]
    first = traces[0].split("]")[0] + "]" if traces else ""  # one rank's: the first to print
    for line in [line for line in traces if line.startswith(first)][-12:] if row.error else []:
        log(f"    {line}")
    return row, envs[0] if envs else None


def check_run(model: str, gpus: int, variants: tuple[str, ...]) -> None:
    """Raise ``ValueError`` for a model, variant or GPU count this machine cannot run, before anything runs."""
    from onepass.models.configs import CONFIGS

    if model not in CONFIGS:
        raise ValueError(f"model: unknown name {model!r}; expected one of {sorted(CONFIGS)}")
    if set(variants) - set(VARIANTS):
        raise ValueError(f"variants: unknown {sorted(set(variants) - set(VARIANTS))}; "
                         f"expected some of {list(VARIANTS)}")
    if torch.cuda.is_available() and torch.cuda.device_count() < gpus:
        raise ValueError(f"gpus: {gpus} asked, {torch.cuda.device_count()} CUDA GPUs here")
    if not torch.cuda.is_available() and "-tiny" not in model:
        raise ValueError("no CUDA GPU: CPU processes over gloo run a smoke test, with a -tiny model only, "
                         f"not {model!r}")


def save_summary(summary: dict, out_dir: str | Path, stem: str, markdown: str, log) -> None:
    """Write ``summary`` to ``<out_dir>/<gpu>/<stem>.json`` and ``markdown`` beside it as ``<stem>.md``."""
    from onepass.bench.harness import gpu_folder

    folder = Path(out_dir) / gpu_folder(summary["env"]["gpu"])
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{stem}.json").write_text(json.dumps(summary, indent=2) + "\n")
    (folder / f"{stem}.md").write_text(markdown)
    log(f"wrote {folder / stem}.json and {stem}.md")


def run_distributed(model: str = "llama-3b", gpus: int = 2, batch: int = 2, seq: int = 2048,
                    variants: tuple[str, ...] | None = None, out_dir: str | Path = "benchmarks/results", *,
                    checkpoint: bool = False, head_unit: bool = False, rounds: int = ROUNDS,
                    heat_s: float | None = None, warmup: int = WARMUP_STEPS, timed: int = TIMED_STEPS,
                    timeout_s: float = VARIANT_TIMEOUT_S, log: Callable[[str], None] = log_line) -> dict:
    """Time a training step of ``model`` under FSDP2 on ``gpus`` GPUs, variant by variant; write
    ``<out_dir>/<gpu>/train-<model>-<gpus>gpu[-ac].{json,md}`` after each round."""
    from onepass.models.configs import build

    variants = tuple(variants or VARIANTS)
    check_run(model, gpus, variants)
    heat_s = (HEAT_S if torch.cuda.is_available() else 0.0) if heat_s is None else heat_s
    log(f"heating {gpus} GPUs for {heat_s:.0f} s, then the copy bandwidth and bf16 matmul rate of one ...")
    heated, env = launch(gpus, {"job": "heat", "seconds": heat_s}, timeout_s, log)
    if heated.error or env is None:
        raise RuntimeError(f"the heat process failed: {heated.error}")
    env["command"] = " ".join(sys.argv)
    rate = env["matmul_bf16_TFLOPs"] * 1e12
    log(f"{gpus} x {env['gpu']}: copy {env['copy_GBps'] or 0:.0f} GB/s, matmul {rate / 1e12:.1f} TFLOP/s")
    probe = build(model, "meta", torch.bfloat16)
    n_params, (flops, _) = sum(p.numel() for p in probe.parameters()), step_floor(probe, batch, seq)
    base = {"job": "train", "model": model, "batch": batch, "seq": seq, "checkpoint": checkpoint,
            "head_unit": head_unit, "warmup": warmup, "timed": timed}
    by_variant: dict[str, list[Result]] = {v: [] for v in variants}
    for i in range(rounds):
        log(f"round {i + 1} of {rounds}: {model}, {gpus} GPUs, batch {batch} x {seq} a GPU"
            + (", activation checkpointing" if checkpoint else ""))
        for variant in variants if i % 2 == 0 else variants[::-1]:
            row, _ = launch(gpus, {**base, "variant": variant}, timeout_s, log)
            by_variant[variant].append(row)
            peak = f"{row.peak_gib:5.1f} GiB" if row.peak_gib is not None else "—"
            log(f"  {variant:<22} " + (f"failed: {row.error}" if row.error else
                                       f"{row.tokens_per_s / 1e3:7.2f}k tokens/s/GPU  {row.step_ms:8.1f} ms/step  MFU "
                                       f"{100 * flops / (row.step_ms / 1e3) / rate:4.1f}%  peak {peak}  "
                                       f"loss {row.loss:.3f}"))
        results = []  # the rounds so far, written after each: a run cut off keeps what it measured
        for variant in variants:
            row = DistResult(**asdict(combine_rounds(by_variant[variant])))
            if row.error is None:
                row.reserved_gib = max(r.reserved_gib or 0.0 for r in by_variant[variant]) or None
                row.mfu = flops / (row.step_ms / 1e3) / rate
            results.append(asdict(row))
        summary = {"env": env, "model": model, "gpus": gpus, "batch": batch, "seq": seq, "params": n_params,
                   "rounds": i + 1, "checkpoint": checkpoint, "head_unit": head_unit,
                   "matmul_tflop_per_gpu_step": flops / 1e12, "results": results}
        save_summary(summary, out_dir, f"train-{model}-{gpus}gpu" + "-ac" * checkpoint, to_markdown(summary), log)
    return summary


def to_markdown(summary: dict) -> str:
    env, rows = summary["env"], {r["variant"]: r for r in summary["results"]}
    liger, compiled = rows.get("liger", {}), rows.get("torch.compile", {})

    def ratio(r, ref, key):
        return f"{r[key] / ref[key]:.2f}x" if ref.get(key) and r.get(key) else "—"

    lines = [f"# train step under FSDP2: {summary['model']}, {summary['gpus']} GPUs, batch {summary['batch']} x "
             f"{summary['seq']} a GPU" + (", activation checkpointing" if summary["checkpoint"] else ""), "",
             f"{summary['gpus']} x {env['gpu']}; torch {env['torch']}, triton {env['triton']}, {env['date']}; bf16 "
             f"matmul {env['matmul_bf16_TFLOPs']:.0f} TFLOP/s on one GPU (measured in this run); fp32 sharded weights, "
             "bf16 compute, fp32 reduce, torch AdamW(fused=True).", "", f"Command: `{env['command']}`", "",
             "| variant | tokens/s per GPU | ms/step | MFU % | peak GiB | vs Liger tokens/s | vs Liger memory | "
             "vs torch.compile tokens/s | SM MHz, W | loss | note |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary["results"]:
        if r["error"]:
            lines.append(f"| {r['variant']} | failed: {r['error'][:100]} | | | | | | | | | |")
            continue
        gpu = f"{r['sm_mhz']:.0f}, {r['watts']:.0f}" if r["sm_mhz"] is not None else "—"
        peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "—"
        lines.append(f"| {r['variant']} | {r['tokens_per_s'] / 1e3:.2f}k | {r['step_ms']:.1f} | {100 * r['mfu']:.1f} | "
                     f"{peak} | {ratio(r, liger, 'tokens_per_s')} | {ratio(r, liger, 'peak_gib')} | "
                     f"{ratio(r, compiled, 'tokens_per_s')} | {gpu} | {r['loss']:.3f} | {r['note'] or ''} |")
    lines += ["", "Targets: onepass >= 1.1x Liger's tokens/s per GPU at <= 0.9x its peak memory; onepass + "
              "torch.compile >= torch.compile (which compiles each decoder layer). A step's time is the slowest "
              f"rank's; each figure the mean of {summary['rounds']} rounds' medians, the variants in order, then in "
              "reverse, each in a fresh torchrun process (see onepass.bench.train_distributed). Peak: the highest "
              "rank's max_memory_allocated."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # one rank of a torchrun process (see launch)
    _rank_main(json.loads(sys.argv[1]))
