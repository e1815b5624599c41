"""The onepass command: benchmarks, self-check and the fusion analyzer.

    onepass run                 the main job: the benchmark suite on a GPU; without one,
                                every op's self-check through Triton's interpreter
    onepass bench ops [...]     the op benchmarks (GPU)
    onepass bench train [...]   a whole training step of a built-in model (GPU; --gpus N: FSDP2)
    onepass bench generate [...] generation with a built-in model: HF against onepass (GPU)
    onepass bench sweep [...]   every op over a grid of model shapes, checked, then timed (GPU)
    onepass bench sweep-report  a sweep's JSON as Markdown and heatmaps (no GPU needed)
    onepass selfcheck           every op against its float64 reference, and its byte budget
    onepass analyze [...]       where a model's HBM bytes and launches go (no GPU needed)

Without transformers (the ``hf`` extra) every command runs what it can and says in one line
what needs it: the models (analyze, bench train, bench generate) are Hugging Face models.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

from onepass import DISTRIBUTION

HF_INSTALL = f"pip install '{DISTRIBUTION}[hf]'"


def has_transformers() -> bool:
    """Whether transformers can be imported (the ``hf`` extra), without importing it."""
    return importlib.util.find_spec("transformers") is not None  # None too where sys.modules hides it


def _interpret_without_gpu() -> str:
    """Pick the device; without a GPU, turn on Triton's interpreter. Triton reads the switch
    when it is first imported, so this runs before any command imports anything else."""
    import torch

    if torch.cuda.is_available():
        return "cuda"
    os.environ["TRITON_INTERPRET"] = "1"
    return "cpu"


def _release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string ("3.6.0+git" -> (3, 6))."""
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def _interpreter_problem() -> str | None:
    """Why Triton's interpreter cannot run the kernels here, or None: Triton 3.6's converts
    one-element arrays to loop bounds the way numpy 2.3 removed."""
    import numpy
    import triton

    if _release(triton.__version__) < (3, 7) and _release(numpy.__version__) >= (2, 3):
        return (f"Triton {triton.__version__}'s interpreter needs numpy < 2.3 (here {numpy.__version__}): "
                "pip install 'numpy<2.3', or Triton 3.7 or later")
    return None


def _selfcheck(_args) -> int:
    device = _interpret_without_gpu()
    problem = _interpreter_problem() if device == "cpu" else None
    if problem:
        print(f"onepass selfcheck: {problem}", file=sys.stderr)
        return 2
    from onepass import selfcheck

    where = "on the GPU" if device == "cuda" else "on the CPU through Triton's interpreter"
    try:
        print(f"onepass self-check {where}")
        return 0 if selfcheck.run(device) else 1
    except ValueError as e:
        print(f"onepass {e}", file=sys.stderr)
        return 2


def _no_gpu(command: str) -> bool:
    """Whether there is no CUDA GPU for a benchmark (said on stderr)."""
    import torch

    if torch.cuda.is_available():
        return False
    print(f"onepass {command}: benchmarks need a CUDA GPU; without one, run `onepass selfcheck`", file=sys.stderr)
    return True


def _bench_ops(args) -> int:
    if _no_gpu("bench ops"):
        return 2
    from onepass.bench.harness import SUITES, run_suites

    suites = args.suite or SUITES
    if not has_transformers():  # the suites that take their shapes from a model (optim: Llama's parameters)
        from onepass.selfcheck import suites_needing_transformers

        skipped = suites_needing_transformers(suites)
        if skipped:
            print(f"onepass bench ops: skipping {', '.join(skipped)}: needs transformers: {HF_INSTALL}",
                  file=sys.stderr)
        suites = [s for s in suites if s not in skipped]
        if not suites:
            return 2
    if not any(run_suites(suites, args.out, args.only).values()):
        print(f"onepass bench ops: no case's op name contains {args.only!r}", file=sys.stderr)
        return 2
    return 0


def _bench_sweep(args) -> int:
    if _no_gpu("bench sweep"):
        return 2
    from onepass.bench.sweep import run_sweep, write_report

    try:
        path = run_sweep(args.grid, args.only, args.out, args.max_minutes, resume=args.resume)
    except ValueError as e:
        print(f"onepass bench sweep: {e}", file=sys.stderr)
        return 2
    print("\n".join(map(str, write_report(path))))
    return 0


def _bench_sweep_report(args) -> int:
    from pathlib import Path

    if not Path(args.json).is_file():
        print(f"onepass bench sweep-report: no file {args.json}", file=sys.stderr)
        return 2
    import json

    from onepass.bench.sweep import write_report

    try:
        written = write_report(args.json, args.out, log=lambda line: print(line, file=sys.stderr))
    except (json.JSONDecodeError, KeyError, TypeError) as e:  # not JSON, or not a sweep's
        print(f"onepass bench sweep-report: {args.json} is not a sweep's JSON ({type(e).__name__}: {e})",
              file=sys.stderr)
        return 2
    print("\n".join(map(str, written)))
    return 0


def _bench_train(args) -> int:
    variants = tuple(args.variants.split(",")) if args.variants else None
    if args.gpus == 1 and not args.max_seq:
        extra = [flag for flag, on in (("--variants", variants), ("--checkpoint", args.checkpoint),
                                       ("--head-unit", args.head_unit), ("--rounds", args.rounds)) if on]
        if extra:
            print(f"onepass bench train: {extra[0]} is for the distributed mode (--gpus N > 1 or --max-seq)",
                  file=sys.stderr)
            return 2
        if _no_gpu("bench train"):
            return 2
        from onepass.bench.train import run

        run(args.model or "llama-1b", args.batch or 4, args.seq or 2048, args.out, lora_rank=args.lora)
        return 0
    if args.lora:
        print("onepass bench train: --lora runs on one GPU (without --gpus or --max-seq)", file=sys.stderr)
        return 2
    from onepass.bench.max_seq import run_max_seq
    from onepass.bench.train_distributed import ROUNDS, run_distributed

    try:
        if args.max_seq:
            run_max_seq(args.model or "llama-3b", args.gpus, variants, (args.checkpoint,), args.out,
                        start=args.seq or 4096)
        else:
            run_distributed(args.model or "llama-3b", args.gpus, args.batch or 2, args.seq or 2048, variants, args.out,
                            checkpoint=args.checkpoint, head_unit=args.head_unit, rounds=args.rounds or ROUNDS)
    except ValueError as e:  # a bad --model/--variants/--gpus for this machine, said before anything runs
        print(f"onepass bench train: {e}", file=sys.stderr)
        return 2
    return 0


def _bench_generate(args) -> int:
    if _no_gpu("bench generate"):
        return 2
    from onepass.bench.generate import run

    run(args.model, tuple(args.batch or (1, 8)), args.prompt, args.new, args.out, compile_hf=not args.no_compile)
    return 0


def _at_least(low: int):
    """An argparse type: an int >= low."""

    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {value}")
        return value

    return parse


def _analyze(args) -> int:
    from onepass.analyze.cli import run

    return run(args)


def _run(args) -> int:
    import torch

    if torch.cuda.is_available():
        return _bench_ops(argparse.Namespace(suite=None, out="benchmarks/results", only=None))
    print("no GPU here: every op's self-check instead of the benchmarks, then the analyzer on llama-1b\n")
    status = _selfcheck(args)
    print()
    if not has_transformers():
        print(f"onepass run: the analyzer on llama-1b skipped: it needs transformers: {HF_INSTALL}", file=sys.stderr)
        return status
    analyze = build_parser().parse_args(["analyze", "--model", "llama-1b", "--quiet"])
    return status or _analyze(analyze)


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's help ends with its default; an option whose default depends on others
    (None) says so in its own words, and an on/off flag (off by default) shows none."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def _command(sub, name: str, about: str, fn=None, hf: bool = False, options: bool = True) -> argparse.ArgumentParser:
    """A subcommand whose --help says what it does (``about``) and every option's default;
    ``hf``: it builds Hugging Face models, so without transformers it is refused in one line;
    ``options`` False: a command that will get no options, nor --help, here (build_parser's)."""
    parser = sub.add_parser(name, help=about, description=about, formatter_class=_Help, add_help=options)
    if fn is not None:
        parser.set_defaults(fn=fn, hf=hf)
    return parser


def build_parser(options: bool = True) -> argparse.ArgumentParser:
    """The command line; ``options`` False: the commands without their options or their own --help (whose
    choices come from modules that import torch), enough for ``onepass --help``, ``--version``, ``onepass bench
    --help`` and a missing or unknown command, answered before torch loads."""
    from onepass import __version__

    parser = argparse.ArgumentParser(prog="onepass", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"onepass {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(group, name, about, fn, hf=False):
        return _command(group, name, about, fn, hf, options)

    command(sub, "run", "the main job: on a GPU every benchmark suite (as bench ops); without one, every op's "
                        "self-check through Triton's interpreter, then the analyzer on llama-1b", _run)
    command(sub, "selfcheck", "every op's kernels against its float64 reference (forward and every gradient; "
                              "without a GPU through Triton's interpreter), and its byte budget", _selfcheck)
    bench = _command(sub, "bench", "benchmarks on a CUDA GPU, every peer side by side in one run").add_subparsers(
        dest="what", required=True)
    bench_ops = command(bench, "ops", "every op against eager PyTorch, torch.compile and Liger-Kernel (GPU); "
                                      "results as JSON and Markdown under --out/<gpu>/", _bench_ops)
    bench_sweep = command(bench, "sweep", "every op, forward and forward+backward, over a grid of real model "
                                          "shapes against eager PyTorch, torch.compile, PyTorch's fused path and "
                                          "Liger-Kernel, each cell checked against eager before it is timed (GPU); "
                                          "JSON, Markdown and heatmaps under --out/<gpu>/", _bench_sweep)
    sweep_report = command(bench, "sweep-report", "a sweep's JSON as a Markdown summary and, where matplotlib is "
                                                  "installed, heatmaps of onepass's ratio to the best peer (no GPU "
                                                  "needed)", _bench_sweep_report)
    bench_train = command(bench, "train", "a whole training step of a built-in model: eager, torch.compile, "
                                          "Liger-Kernel, onepass (GPU; --gpus N: under FSDP2)", _bench_train, hf=True)
    bench_generate = command(bench, "generate", "greedy generation with a built-in model: Hugging Face generate "
                                                "(eager; static cache + torch.compile) against onepass's Decoder "
                                                "(GPU)", _bench_generate, hf=True)
    bench.metavar = "{" + ",".join(bench.choices) + "}"  # (a missing one is named so, not by its dest)
    analyze = command(sub, "analyze", "where a model's HBM bytes and kernel launches go, and what fusing saves "
                                      "(no GPU needed; --measure profiles real steps on one)", _analyze, hf=True)
    if options:
        _add_options(bench_ops, bench_sweep, sweep_report, bench_train, bench_generate, analyze)
    return parser


def _add_options(bench_ops, bench_sweep, sweep_report, bench_train, bench_generate, analyze) -> None:
    from onepass.analyze.cli import add_arguments
    from onepass.bench.harness import SUITES
    from onepass.bench.sweep import GRID_SIZES
    from onepass.models.configs import CONFIGS

    models = sorted(CONFIGS)
    bench_ops.add_argument("--suite", action="append", choices=SUITES,
                           help="a suite to run (repeatable; default: all)")
    bench_ops.add_argument("--only", help="keep only the cases whose op name contains this (results written beside "
                                          "the full ones, as <suite>-only-<this>; default: every case)")
    bench_ops.add_argument("--out", default="benchmarks/results", help="results folder")
    bench_sweep.add_argument("--grid", choices=GRID_SIZES, default="quick",
                             help="quick: every op at two shapes (about 5 minutes on an H100); full: the whole grid "
                                  "(over an hour; bound it with --max-minutes)")
    bench_sweep.add_argument("--only", help="keep only the ops whose name contains this (results written beside the "
                                            "full ones; default: every op)")
    bench_sweep.add_argument("--out", default="benchmarks/results", help="results folder")
    bench_sweep.add_argument("--max-minutes", type=float, help="start no cell after this many minutes; the rest are "
                                                               "recorded as skipped (default: no limit)")
    bench_sweep.add_argument("--resume", action="store_true", help="keep the cells an earlier run on this GPU "
                                                                   "wrote to the same results file; measure only "
                                                                   "those its time budget skipped")
    sweep_report.add_argument("json", help="the sweep's JSON file")
    sweep_report.add_argument("--out", help="folder for the report (default: beside the JSON)")
    bench_train.add_argument("--model", choices=models, help="a built-in model configuration (default: llama-1b; "
                                                             "llama-3b with --gpus or --max-seq)")
    bench_train.add_argument("--batch", type=_at_least(1), help="sequences a step (a GPU) (default: 4; 2 with --gpus)")
    bench_train.add_argument("--seq", type=_at_least(2), help="tokens a sequence (default: 2048); with --max-seq the "
                                                              "length the search starts from (default: 4096)")
    bench_train.add_argument("--lora", type=_at_least(0), default=0, metavar="R",
                             help="LoRA fine-tuning: PEFT rank-R adapters on every projection, base frozen "
                                  "(0: full training)")
    bench_train.add_argument("--variants", help="with --gpus or --max-seq: comma-separated variants (default: "
                                                "all; with --max-seq liger,onepass)")
    bench_train.add_argument("--gpus", type=_at_least(1), default=1,
                             help="N > 1: FSDP2 over N GPUs of this host, one torchrun process per GPU "
                                  "(without a GPU: CPU processes over gloo, -tiny models, a smoke test)")
    bench_train.add_argument("--max-seq", action="store_true",
                             help="the longest sequence that trains at batch 1 (Liger and onepass by default)")
    bench_train.add_argument("--checkpoint", action="store_true", help="activation checkpointing of every layer")
    bench_train.add_argument("--head-unit", action="store_true", help="the (untied) LM head an FSDP unit of its own")
    bench_train.add_argument("--rounds", type=_at_least(1), help="rounds over the variants (default: 2)")
    bench_train.add_argument("--out", default="benchmarks/results", help="results folder")
    bench_generate.add_argument("--model", default="llama-1b", choices=models, help="a built-in model configuration")
    bench_generate.add_argument("--batch", type=_at_least(1), action="append",
                                help="a batch size (repeatable; default: 1 and 8)")
    bench_generate.add_argument("--prompt", type=_at_least(1), default=128, help="prompt tokens")
    bench_generate.add_argument("--new", type=_at_least(2), default=256, help="new tokens (the first comes from "
                                                                            "the prompt's forward, the rest timed)")
    bench_generate.add_argument("--no-compile", action="store_true",
                                help="skip HF generate with a static cache and torch.compile (its compile takes "
                                     "minutes)")
    bench_generate.add_argument("--out", default="benchmarks/results", help="results folder")
    add_arguments(analyze)


def main(argv: list[str] | None = None) -> int:
    build_parser(options=False).parse_known_args(argv)  # --help, --version, no or an unknown command: exits here
    _interpret_without_gpu()
    args = build_parser().parse_args(argv)
    command = " ".join(filter(None, (args.command, getattr(args, "what", None))))
    if args.hf and not has_transformers():
        print(f"onepass {command}: needs transformers (its models are Hugging Face models): {HF_INSTALL}",
              file=sys.stderr)
        return 2
    try:
        return args.fn(args)
    except KeyboardInterrupt:  # Ctrl-C: a line, not a traceback (what a command started, it has ended)
        print(f"onepass {command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
