"""A decode step with and without programmatic dependent launch (PDL), interleaved in one process.

    python benchmarks/decode_pdl.py [--model NAME ...] [--batch N ...] [--rounds 3]

For each model (random bf16 weights, then ``onepass.optimize``, as ``onepass bench generate``
builds it) and batch size: rounds of (PDL off, PDL on), each a fresh ``onepass.Decoder`` whose
step graph is captured with the setting (``dispatch._PDL_OFF``, which ``ONEPASS_PDL=0`` sets);
a step's time: N replays of its captured step from the prompt's end (the Decoder's position
reset before each run of N), by ``do_bench``. Prints every round's minimum, then each setting's
best minimum and median, with its share of the step's floor (every weight read once at the copy
bandwidth measured in the run). Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import gc
import statistics

import torch
from triton.testing import do_bench

import onepass
from onepass.bench.generate import step_floor_ms
from onepass.bench.harness import environment, measure_ceilings
from onepass.models.configs import CONFIGS, build
from onepass.ops import dispatch


def step_us(model, batch: int, cache: int, steps: int, pdl: bool) -> tuple[float, float]:
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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", action="append", choices=sorted(CONFIGS),
                        help="a built-in model (repeatable; default: llama-1b, qwen2-1.5b)")
    parser.add_argument("--batch", type=int, action="append", help="a batch size (repeatable; default: 1 and 8)")
    parser.add_argument("--cache", type=int, default=512, help="prompt tokens in the cache before the steps")
    parser.add_argument("--steps", type=int, default=64, help="decode steps timed")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of (off, on)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("decode_pdl needs a CUDA GPU")
    ceilings = measure_ceilings()
    env = environment(ceilings)
    print(f"{env['gpu']}: copy {ceilings.copy_gbps:.0f} GB/s; torch {env['torch']}, triton {env['triton']}", flush=True)
    for name in args.model or ["llama-1b", "qwen2-1.5b"]:
        torch.manual_seed(0)
        model = onepass.optimize(build(name, device="cuda"))
        for batch in args.batch or [1, 8]:
            floor_us = step_floor_ms(model, batch, args.cache, args.steps, ceilings.copy_gbps) * 1e3
            times = {False: [], True: []}
            for _ in range(args.rounds):
                for pdl in (False, True):
                    times[pdl].append(step_us(model, batch, args.cache, args.steps, pdl))
                    gc.collect()
                    torch.cuda.empty_cache()
            rounds = "  ".join(f"{off[0]:.0f}/{on[0]:.0f}" for off, on in zip(times[False], times[True]))
            best = {pdl: min(t[0] for t in times[pdl]) for pdl in times}
            median = {pdl: statistics.median(t[1] for t in times[pdl]) for pdl in times}
            print(f"{name} batch {batch}: step us (min), PDL off/on by round: {rounds}; best off {best[False]:.1f} "
                  f"({100 * floor_us / best[False]:.0f}% of floor), on {best[True]:.1f} "
                  f"({100 * floor_us / best[True]:.0f}%); median off {median[False]:.1f}, on {median[True]:.1f}; "
                  f"floor {floor_us:.1f}", flush=True)
        del model
        gc.collect()
        torch.cuda.empty_cache()
    dispatch._PDL_OFF = False


if __name__ == "__main__":
    main()
