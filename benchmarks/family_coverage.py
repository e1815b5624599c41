"""Which transformers causal-LM families ``onepass.optimize`` fuses, tried as a new user would.

For every model type in transformers' causal-LM mapping, a tiny random model is built from its
config class with small sizes, optimized, and compared with the unoptimized model in fp32: the
loss and every gradient (kernels through Triton's interpreter on a CPU). Writes a Markdown
table of the report's switches and the largest relative error to
``benchmarks/results/family_coverage.md``.

    TRITON_INTERPRET=1 python benchmarks/family_coverage.py [--jobs N] [--out PATH] [model_type ...]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import copy
import json
import os
import pathlib
import subprocess
import sys
import time
import warnings

import torch

import onepass
from onepass.testing import rel_error

SMALL = dict(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=64, max_position_embeddings=128, head_dim=8, bos_token_id=0, eos_token_id=0,
             pad_token_id=0, moe_intermediate_size=32, num_experts=4, num_local_experts=4, num_experts_per_tok=2,
             shared_expert_intermediate_size=32, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1,
             kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_group=1,
             topk_group=1, sliding_window=None, tie_word_embeddings=False)
SKIP_ARGS = ("dropout", "pdrop")
OUT = pathlib.Path(__file__).parent / "results" / "family_coverage.md"


def _config(config_class):
    import inspect

    accepted = set(inspect.signature(config_class.__init__).parameters)
    kwargs = {k: v for k, v in SMALL.items() if k in accepted or not accepted - {"self", "kwargs"}}
    config = config_class(**kwargs)
    for name in dir(config):
        if any(s in name for s in SKIP_ARGS) and isinstance(getattr(config, name, None), float):
            setattr(config, name, 0.0)
    return config


def _loss_and_grads(model, ids):
    model.train()
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def try_family(model_type: str, timeout: float = 600) -> dict:
    """``_try_family`` in a process of its own: a family that crashes or hangs fails alone."""
    start = time.time()
    try:
        done = subprocess.run([sys.executable, __file__, "--one", model_type], capture_output=True, text=True,
                              timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        row = json.loads(lines[-1]) if lines else {
            "model_type": model_type, "error": f"failed: exit {done.returncode}: {done.stderr.strip()[-100:]}"}
    except subprocess.TimeoutExpired:
        row = {"model_type": model_type, "error": f"failed: over {timeout:.0f} s"}
    row["seconds"] = time.time() - start
    return row


def _try_family(model_type: str) -> dict:
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    row = {"model_type": model_type}
    try:
        config = _config(CONFIG_MAPPING[model_type])
        torch.manual_seed(0)
        ref = AutoModelForCausalLM.from_config(config).float()
        with torch.no_grad():
            for name, p in ref.named_parameters():
                if "norm" in name:
                    p.add_(0.2 * torch.randn_like(p))
    except Exception as error:  # noqa: BLE001 - a family this script cannot build is listed as such
        row["error"] = f"not built here: {type(error).__name__}: {str(error)[:80]}"
        return row
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(1))
    try:
        ref_loss, ref_grads = _loss_and_grads(ref, ids)
    except Exception as error:  # noqa: BLE001 - the unoptimized model itself cannot train at this toy size
        row["error"] = f"not built here: its own training step fails: {type(error).__name__}: {str(error)[:80]}"
        return row
    model = copy.deepcopy(ref)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            onepass.optimize(model)
        row.update(onepass.optimize_report(model))
        loss, grads = _loss_and_grads(model, ids)
        # a gradient that is rounding noise (a router whose weights get none: HunYuan-MoE's, ~1e-10) is
        # compared at the scale of the others
        floor = 1e-6 * max(g.norm().item() for g in ref_grads.values())
        errors = [rel_error(loss, ref_loss)] + [(grads[n] - g).norm().item() / max(g.norm().item(), floor)
                                                for n, g in ref_grads.items() if n in grads]
        row["error"] = f"{max(errors):.1e}" + ("" if grads.keys() == ref_grads.keys() else " (gradients missing)")
    except Exception as error:  # noqa: BLE001
        row["error"] = ("refused: not a decoder-only causal LM (no list of decoder layers)"
                        if "no list of decoder layers" in str(error) else
                        f"failed: {type(error).__name__}: {str(error)[:100]}")
    return row


def _cell(status: str | None) -> str:
    if status is None:
        return ""
    return status.split(":", 1)[0]


def main(model_types: list[str], jobs: int, out: pathlib.Path) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_types = model_types or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    lines = ["| model_type | norm | activation | rope | attention | loss | max rel. error (loss, grads) |",
             "|---|---|---|---|---|---|---|"]
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        for row in pool.map(try_family, model_types):
            cells = [_cell(row.get(k)) for k in ("norm", "activation", "rope", "attention", "loss")]
            error = " ".join(row.get("error", "").replace("|", "/").split())  # one table cell
            lines.append(f"| {row['model_type']} | " + " | ".join(cells) + f" | {error} |")
            print(lines[-1], f"({row['seconds']:.0f} s)", flush=True)
            _write(out, lines)  # after each row: a long sweep cut short keeps what it found


def _write(out: pathlib.Path, lines: list[str]) -> None:
    import transformers

    out.write_text(f"# Family coverage\n\n`TRITON_INTERPRET=1 python benchmarks/family_coverage.py`, transformers "
                   f"{transformers.__version__}, torch {torch.__version__}, CPU (fp32, interpreter). Each causal-LM "
                   "model_type of transformers, built at toy size from its config class with default settings "
                   "(some cannot be built that way: listed as such), optimized, and its loss and every gradient "
                   "compared with the unoptimized model's; a cell is the report's state of that switch "
                   f"(`optimize_report`). The parity tests' tolerance is 2e-4. {len(lines) - 2} types.\n\n"
                   + "\n".join(lines) + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_types", nargs="*", help="model types to try (default: every causal-LM type)")
    parser.add_argument("--jobs", type=int, default=1, help="families tried at once, one process each")
    parser.add_argument("--out", type=pathlib.Path, default=OUT, help="the Markdown table written")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # (a worker: one family, its row as JSON)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(_try_family(args.one)))
    else:
        main(args.model_types, args.jobs, args.out)
