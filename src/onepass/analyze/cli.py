"""``onepass analyze``: the analyzer on a built-in model, from the command line.

    onepass analyze --model llama-1b                       # meta tensors, H100 datasheet, forward
    onepass analyze --model gpt2 --mode train --gpu A100 --out out/gpt2
    onepass analyze --model llama-1b --measure --out out/  # on a CUDA GPU: profiled side too
    onepass analyze --model path/to/config.json            # any Hugging Face causal LM: its config, no weights

The lead wires it: ``add_arguments(subparser)`` then ``run(args)``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

from onepass.analyze.gpus import GPUS


def _gpu_name(name: str) -> str:
    """A GPU name as the datasheet table spells it (``h100`` -> ``H100``); an unknown one as given,
    for argparse's choices to refuse."""
    return next((known for known in GPUS if known.lower() == name.lower()), name)


def config_path(model: str) -> str | None:
    """None for a built-in name; for a config.json (the file, or a folder holding one), its path.

    Anything else raises ``ValueError`` in one line naming what ``--model`` takes."""
    from onepass.models.configs import CONFIGS

    if model in CONFIGS:
        return None
    path = os.path.join(model, "config.json") if os.path.isdir(model) else model
    if not os.path.isfile(path):
        raise ValueError(f"--model {model}: not a built-in name ({', '.join(sorted(CONFIGS))}) nor a path to a "
                         "config.json or a folder holding one")
    return path


def build_model(model: str, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """``--model``'s causal LM in eval mode: a built-in name, or a local Hugging Face config.json
    (read with ``local_files_only``: nothing downloaded), with random weights, none on meta."""
    from onepass.models.configs import build

    path = config_path(model)
    if path is None:
        return build(model, device=device, dtype=dtype)
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        config._attn_implementation = "sdpa"  # as the built-in models: the analyzer's attention op
        with torch.device(device):
            built = AutoModelForCausalLM.from_config(config, dtype=dtype)
    except (OSError, ValueError, KeyError) as e:  # unreadable JSON, an unknown model_type, not a causal LM
        first = (str(e).strip() or type(e).__name__).splitlines()[0]
        raise ValueError(f"--model {model}: cannot build a causal LM from {path}: {first}") from e
    return built.eval()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from onepass.models.configs import CONFIGS

    parser.add_argument("--model", default="llama-1b",
                        help=f"a built-in model configuration ({', '.join(sorted(CONFIGS))}), or a path to a "
                             "Hugging Face config.json (or a folder holding one): its causal LM with no weights")
    parser.add_argument("--gpu", default="H100", type=_gpu_name, choices=list(GPUS),
                        help="datasheet ceilings for the roofline")
    parser.add_argument("--mode", default="forward", choices=["forward", "train"],
                        help="forward: one forward pass; train: forward and backward, the input ids as labels")
    parser.add_argument("--batch", type=int, default=1, help="sequences a step")
    parser.add_argument("--seq", type=int, default=None, help="tokens a row (default: 2048, or the model's maximum "
                                                                 "if less)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                        help="the model's parameters and activations")
    parser.add_argument("--out", default=None, help="directory for report.json/.md/.html, roofline.svg, trace.json, "
                                                    "or one .json, .md or .html report (default: the terminal only)")
    parser.add_argument("--measure", action="store_true",
                        help="also run real steps on the CUDA GPU (eager, onepass, torch.compile; with CUDA "
                             "graphs for a forward) and profile them")
    parser.add_argument("--top", type=int, default=12, help="rows per table in the terminal")
    parser.add_argument("--quiet", action="store_true", help="no progress counter")


def run(args: argparse.Namespace) -> int:
    from onepass.analyze import analyze
    from onepass.analyze.report import ONE_FILE_SUFFIXES

    if args.batch < 1 or (args.seq is not None and args.seq < 1) or args.top < 1:
        print("onepass analyze: --batch, --seq and --top must be positive", file=sys.stderr)
        return 2
    try:
        config_path(args.model)  # a bad --model is said before --out is made
    except ValueError as e:
        print(f"onepass analyze: {e}", file=sys.stderr)
        return 2
    one_file = args.out and os.path.splitext(args.out)[1].lower() in ONE_FILE_SUFFIXES
    folder = (os.path.dirname(args.out) or ".") if one_file else args.out
    if args.out:  # checked before the analysis, not after it
        if not one_file and os.path.exists(folder) and not os.path.isdir(folder):
            print(f"onepass analyze: --out {args.out} is a file, not a folder (or a .json, .md or .html report)",
                  file=sys.stderr)
            return 2
        if one_file and os.path.isdir(args.out):
            print(f"onepass analyze: --out {args.out} is a folder, not a report file (a folder for every report "
                  "file: name it without the suffix)", file=sys.stderr)
            return 2
        if not one_file and os.path.splitext(args.out.rstrip("/" + os.sep))[1] and not os.path.isdir(folder):
            print(f"onepass analyze: --out {args.out} is taken as a folder (one-file reports end in "
                  f"{', '.join(ONE_FILE_SUFFIXES)})", file=sys.stderr)
        try:
            os.makedirs(folder, exist_ok=True)
            tempfile.TemporaryFile(dir=folder).close()
        except OSError as e:
            print(f"onepass analyze: cannot write to --out {args.out}: {e.strerror or e}", file=sys.stderr)
            return 2
    if args.measure and not torch.cuda.is_available():
        print("onepass analyze: --measure needs a CUDA GPU", file=sys.stderr)
        return 2
    device = "cuda" if args.measure else "meta"
    if device == "cuda":
        torch.manual_seed(0)
    try:
        model = build_model(args.model, device=device, dtype=getattr(torch, args.dtype))
    except ValueError as e:
        print(f"onepass analyze: {e}", file=sys.stderr)
        return 2
    positions = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", 2048)
    seq = args.seq or min(2048, positions)
    if seq > positions:
        print(f"onepass analyze: --seq {seq} is past {args.model}'s {positions} positions", file=sys.stderr)
        return 2
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (args.batch, seq), device=device)
    kwargs = {"use_cache": False}
    if args.mode == "train":
        kwargs["labels"] = ids
    variants = None
    if args.measure:
        import copy
        import functools

        import onepass

        torch.manual_seed(0)  # the same weights as the eager model
        fused = onepass.optimize(build_model(args.model, device=device, dtype=getattr(torch, args.dtype)))
        fused.train(args.mode == "train")
        compiled = [("torch.compile", torch.compile(model)), ("onepass", fused),
                    ("onepass + torch.compile", torch.compile(fused))]
        if args.mode == "forward":  # small steps wait on the host: CUDA graphs replay its launch work away
            compiled += [("torch.compile, CUDA graphs", torch.compile(copy.deepcopy(model), mode="reduce-overhead")),
                         ("onepass + torch.compile, CUDA graphs",
                          torch.compile(copy.deepcopy(fused), mode="reduce-overhead"))]
        # each variant gets the eager step's keyword arguments (labels, use_cache)
        variants = {name: functools.partial(fn, **kwargs) for name, fn in compiled}
    report = analyze(model, ids, gpu=args.gpu, mode=args.mode, measure=args.measure, variants=variants,
                     quiet=args.quiet, title=f"{args.model} batch {args.batch} x seq {seq}",
                     trace_dir=folder, **kwargs)
    print(report.table(top=args.top))
    if args.out:
        for path in report.write(args.out):
            print(f"wrote {path}")
        stale = os.path.join(folder, "trace.json")
        if not args.measure and os.path.exists(stale):
            print(f"(left as it was: {stale}, from an earlier --measure run)")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="onepass analyze", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
