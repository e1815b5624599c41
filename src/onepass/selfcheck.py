"""Every op's self-check: forward and backward on fresh random inputs against the float64
reference, and its byte budget at benchmark size: what the unfused PyTorch version moves
(counted by the analyzer on meta tensors) against the fused minimum (the benchmark case's).

On a machine without a GPU the Triton kernels run through Triton's interpreter, so
``TRITON_INTERPRET=1`` must be set before Triton is imported (``onepass selfcheck`` does).
Without transformers (the ``hf`` extra) every op is still checked; the byte budgets whose
benchmark cases take their shapes from a model (adamw_step: Llama-3.2-1B's parameters) say so.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import torch

from onepass import DISTRIBUTION, ops, reference
from onepass.ops.dispatch import use_triton
from onepass.testing import TOLERANCE, rel_error


@dataclass
class Check:
    op: str
    suite: str  # the benchmark suite whose case gives the fused minimum bytes
    inputs: Callable[[str, bool], tuple]  # (device, benchmark size?) -> inputs; float ones get gradients
    run: Callable  # (ops or reference, *inputs) -> tensor or tuple of tensors
    n_grad: int = 99  # how many leading inputs get gradients (rope's tables get none)
    meta: bool = True  # the reference runs on meta tensors (not when it reads values, as decode's lengths)


def _rows(n_tensors: int, cols: int, vectors: int = 0):
    """n [rows, cols] tensors then ``vectors`` [cols] ones: 6 x 300 small, 16384 x cols at benchmark size."""
    def make(device, big):
        rows, width = (16384, cols) if big else (6, 300)
        dtype = torch.bfloat16 if big else torch.float32
        return (*(torch.randn(rows, width, device=device, dtype=dtype) for _ in range(n_tensors)),
                *(torch.randn(width, device=device, dtype=dtype) for _ in range(vectors)))
    return make


def _scores(device, big):
    shape, dtype = ((64, 4096, 4096), torch.bfloat16) if big else ((2, 5, 40, 40), torch.float32)
    return (torch.randn(shape, device=device, dtype=dtype),)


def _rope_inputs(device, big):
    b, hq, hk, s, d = (4, 32, 8, 4096, 128) if big else (2, 4, 2, 9, 16)
    dtype = torch.bfloat16 if big else torch.float32
    angles = torch.randn(s, d // 2, device=device)
    emb = torch.cat((angles, angles), dim=-1)
    return (torch.randn(b, hq, s, d, device=device, dtype=dtype), torch.randn(b, hk, s, d, device=device, dtype=dtype),
            emb.cos().to(dtype), emb.sin().to(dtype))


def _positions(device, big):
    """Position ids (from a cache's middle) and a rotary embedding's frequencies (head dim 128 or 16)."""
    (b, s, d) = (1, 4096, 128) if big else (2, 9, 16)
    return (torch.arange(b * s, device=device).reshape(b, s) + 1000,
            1.0 / 10000.0 ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))


def _logits(device, big):
    tokens, vocab, dtype = (8192, 128256, torch.bfloat16) if big else (6, 300, torch.float32)
    return torch.randn(tokens, vocab, device=device, dtype=dtype), torch.randint(0, vocab, (tokens,), device=device)


def _lm_head(device, big):
    tokens, hidden, vocab, dtype = (8192, 2048, 128256, torch.bfloat16) if big else (6, 32, 300, torch.float32)
    return (torch.randn(tokens, hidden, device=device, dtype=dtype),
            torch.randn(vocab, hidden, device=device, dtype=dtype) / hidden**0.5,
            torch.randint(0, vocab, (tokens,), device=device))


def _lora(device, big):
    """x, a frozen-size base weight, and rank-r factors (Llama-3.2-1B's q_proj, rank 16, at benchmark size)."""
    tokens, k, n, r, dtype = (8192, 2048, 2048, 16, torch.bfloat16) if big else (6, 32, 24, 4, torch.float32)
    return (torch.randn(tokens, k, device=device, dtype=dtype), torch.randn(n, k, device=device, dtype=dtype) / k**0.5,
            torch.randn(r, k, device=device, dtype=dtype) / k**0.5, torch.randn(n, r, device=device, dtype=dtype))


def _moe(device, big):
    """Tokens, router weights, expert weights, then the top-k expert ids (Qwen3-30B-A3B's layer at benchmark size)."""
    (tokens, hidden, inter, experts, top_k), dtype = (((8192, 2048, 768, 128, 8), torch.bfloat16) if big
                                                      else ((7, 32, 24, 4, 2), torch.float32))
    weights, index = torch.randn(tokens, experts, device=device).softmax(-1).topk(top_k)
    return (torch.randn(tokens, hidden, device=device, dtype=dtype), weights.to(dtype),
            torch.randn(experts, 2 * inter, hidden, device=device, dtype=dtype) / hidden**0.5,
            torch.randn(experts, hidden, inter, device=device, dtype=dtype) / inter**0.5, index)


def _qkv(device, big):
    (b, hq, hk, s, d), dtype = ((16, 32, 32, 1024, 128), torch.bfloat16) if big else ((2, 4, 2, 37, 32), torch.float32)
    return (torch.randn(b, hq, s, d, device=device, dtype=dtype),
            *(torch.randn(b, hk, s, d, device=device, dtype=dtype) for _ in range(2)))


def _kv_cache(device, big):
    (b, hq, hk, length, d), dtype = ((1, 32, 8, 4096, 128), torch.bfloat16) if big else ((2, 4, 2, 70, 32),
                                                                                       torch.float32)
    return (torch.randn(b, hq, 1, d, device=device, dtype=dtype),
            *(torch.randn(b, hk, length, d, device=device, dtype=dtype) for _ in range(2)),
            torch.tensor([length, length - 9][:b], device=device, dtype=torch.int32))


def _decode_rows(*features: int):
    """A decode step's rows and weights of ``features`` outputs (Llama-3.2-1B's at benchmark size)."""
    def make(device, big):
        (rows, hidden), dtype = ((1, 2048), torch.bfloat16) if big else ((3, 40), torch.float32)
        sizes = features if big else tuple(max(1, f // 64) for f in features)
        return (torch.randn(rows, hidden, device=device, dtype=dtype),
                *(torch.randn(n, hidden, device=device, dtype=dtype) / hidden**0.5 for n in sizes))
    return make


def _sequences(device, big):
    """Hidden states and head of a policy and of a reference model, then targets: 4 chosen then 4 rejected
    sequences of 1024 tokens at a Llama-3-8B head at benchmark size."""
    (b, s, h, v), dtype = ((8, 1024, 4096, 128256), torch.bfloat16) if big else ((4, 6, 32, 300), torch.float32)
    target = torch.randint(0, v, (b, s), device=device)
    target[:, :2] = -100  # the prompts
    return (torch.randn(b, s, h, device=device, dtype=dtype), torch.randn(v, h, device=device, dtype=dtype) / h**0.5,
            torch.randn(b, s, h, device=device, dtype=dtype), torch.randn(v, h, device=device, dtype=dtype) / h**0.5,
            target)


def _completions(device, big):
    """_sequences' tensors, the completions' mask and their advantages (GRPO)."""
    hidden, weight, ref_hidden, ref_weight, target = _sequences(device, big)
    return (hidden, weight, ref_hidden, ref_weight, target.clamp(min=0), (target >= 0).to(hidden.dtype),
            torch.randn(target.shape[0], device=device))


def _adamw(m, p, g, exp_avg, exp_avg_sq):
    """One step on copies (the op updates in place); returns the new parameter and moments."""
    p, exp_avg, exp_avg_sq = p.clone(), exp_avg.clone(), exp_avg_sq.abs()
    m.adamw_step([p], [g], [exp_avg], [exp_avg_sq], lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                 step=3)
    return p, exp_avg, exp_avg_sq


CHECKS = [
    Check("rms_norm", "norm", _rows(1, 4096, 1), lambda m, x, w: m.rms_norm(x, w)),
    Check("layer_norm", "norm", _rows(1, 4096, 2), lambda m, x, w, b: m.layer_norm(x, w, b)),
    Check("add_rms_norm", "norm", _rows(2, 4096, 1), lambda m, x, r, w: m.add_rms_norm(x, r, w)),
    Check("add_layer_norm", "norm", _rows(2, 4096, 2), lambda m, x, r, w, b: m.add_layer_norm(x, r, w, b)),
    Check("swiglu", "activation", _rows(2, 8192), lambda m, g, u: m.swiglu(g, u)),
    Check("geglu", "activation", _rows(2, 8192), lambda m, g, u: m.geglu(g, u)),
    Check("bias_gelu", "activation", _rows(1, 8192, 1), lambda m, x, b: m.bias_gelu(x, b)),
    Check("softmax", "softmax", _scores, lambda m, x: m.softmax(x, scale=0.125, causal=True)),
    Check("rope", "rope", _rope_inputs, lambda m, q, k, cos, sin: m.rope(q, k, cos, sin), n_grad=2),
    Check("rope_tables", "rope", _positions, lambda m, pos, inv_freq: m.rope_tables(pos, inv_freq, 0.5), n_grad=0),
    Check("cross_entropy", "loss", _logits, lambda m, x, t: m.cross_entropy(x, t, label_smoothing=0.1), n_grad=1),
    Check("linear_cross_entropy", "loss", _lm_head, lambda m, h, w, t: m.linear_cross_entropy(h, w, t), n_grad=2),
    Check("lora_linear", "lora", _lora, lambda m, x, w, a, b: m.lora_linear(x, w, a, b, 2.0)),
    Check("moe_experts", "moe", _moe, lambda m, x, w, gu, dn, idx: m.moe_experts(x, idx, w, gu, dn), n_grad=4,
          meta=False),
    Check("attention", "attention", _qkv, lambda m, q, k, v: m.attention(q, k, v, causal=True)),
    Check("decode_attention", "attention", _kv_cache,
          lambda m, q, k, v, lengths: m.decode_attention(q, k, v, lengths), n_grad=0, meta=False),
    Check("decode_linear", "decode_linear", _decode_rows(2048, 512, 512),
          lambda m, x, *ws: m.decode_linear(x, list(ws)), n_grad=0),
    Check("decode_gated_linear", "decode_linear", _decode_rows(8192, 8192),
          lambda m, x, g, u: m.decode_gated_linear(x, g, u), n_grad=0),
    Check("adamw_step", "optim", _rows(4, 4096), _adamw, n_grad=0),
    Check("linear_dpo_loss", "post_training", _sequences,
          lambda m, h, w, rh, rw, t: m.linear_dpo_loss(h, w, t, None, rh, rw, beta=0.5)[0], n_grad=2),
    Check("linear_orpo_loss", "post_training", _sequences,
          lambda m, h, w, rh, rw, t: m.linear_orpo_loss(h, w, t)[0], n_grad=2),
    Check("linear_simpo_loss", "post_training", _sequences,
          lambda m, h, w, rh, rw, t: m.linear_simpo_loss(h, w, t)[0], n_grad=2),
    Check("linear_cpo_loss", "post_training", _sequences,
          lambda m, h, w, rh, rw, t: m.linear_cpo_loss(h, w, t)[0], n_grad=2),
    Check("linear_kto_loss", "post_training", _sequences,
          lambda m, h, w, rh, rw, t: m.linear_kto_loss(h, w, t, torch.arange(t.shape[0]) % 2 == 0, None, rh, rw,
                                                       kl=0.2)[0], n_grad=2),
    Check("linear_grpo_loss", "post_training", _completions,
          lambda m, h, w, rh, rw, ids, mask, adv: m.linear_grpo_loss(h, w, ids, mask, adv, ref_hidden=rh,
                                                                     ref_weight=rw)[0], n_grad=2),
    Check("linear_jsd_loss", "distillation", _sequences,
          lambda m, h, w, th, tw, t: m.linear_jsd_loss(h, w, th, tw, t), n_grad=2),
]


def _outputs(result) -> list[torch.Tensor]:
    return list(result) if isinstance(result, (tuple, list)) else [result]


def check(c: Check, device: str) -> float:
    """The worst relative error over the outputs and every input gradient."""
    inputs = c.inputs(device, False)
    for t in inputs[:c.n_grad]:
        t.requires_grad_(True)
    outs = _outputs(c.run(ops, *inputs))
    grads = [torch.randn_like(o) for o in outs]
    doubles = [t.detach().double().requires_grad_(t.requires_grad) if t.is_floating_point() else t for t in inputs]
    refs = _outputs(c.run(reference, *doubles))
    if c.n_grad:
        torch.autograd.backward(outs, grads)
        torch.autograd.backward(refs, [g.double() for g in grads])
    errors = [rel_error(o, r) for o, r in zip(outs, refs)]
    errors += [rel_error(t.grad, d.grad) for t, d in zip(inputs, doubles) if t.requires_grad]
    return max(errors)


def unfused_bytes(c: Check, mode: str) -> tuple[int, int]:
    """(bytes, launches) of the reference at benchmark size, counted by the analyzer on meta tensors."""
    from onepass.analyze import analyze

    inputs = c.inputs("meta" if c.meta else "cpu", True)
    for t in inputs[:c.n_grad]:
        t.requires_grad_(mode == "train")
    totals = analyze(lambda *xs: c.run(reference, *xs), *inputs, mode=mode, meta=c.meta, quiet=True).totals()
    return totals["bytes"], totals["launches"]


def _cases(suite: str) -> list | None:
    """A benchmark suite's cases (built without a GPU), or None where building them needs
    transformers and it is not installed."""
    try:
        return importlib.import_module(f"onepass.bench.suites.{suite}").cases()
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != "transformers":
            raise
        return None


def suites_needing_transformers(suites) -> list[str]:
    """Those of the benchmark ``suites`` whose cases cannot be built here: they need transformers."""
    return [suite for suite in suites if _cases(suite) is None]


def fused_bytes(without: set[str] | None = None) -> dict[tuple[str, str], int]:
    """{(op, mode): minimum bytes} from the benchmark suites' first case of each op (built without a GPU).
    A suite whose cases need transformers, where it is missing, gives none: its name goes to ``without``."""
    budgets: dict[tuple[str, str], int] = {}
    for suite in dict.fromkeys(c.suite for c in CHECKS):
        cases = _cases(suite)
        if cases is None and without is not None:
            without.add(suite)
        for case in cases or []:
            budgets.setdefault((case.op, case.mode), case.bytes)
    return budgets


def run(device: str = "cpu", log=print) -> bool:
    """Check every op on ``device`` against its float64 reference and log the byte budgets;
    whether all passed. Refused (ValueError) where the kernels do not run: every op would
    compare its reference with itself and pass."""
    if not use_triton(torch.empty(0, device=device)):
        raise ValueError(f"selfcheck: the kernels do not run on {device} here (reference mode: ONEPASS_REFERENCE=1 "
                         "or onepass.reference_mode(); or a CPU without TRITON_INTERPRET=1 set before onepass is "
                         "imported), so nothing would be checked")
    no_transformers: set[str] = set()
    fused = fused_bytes(no_transformers)
    tol = TOLERANCE[torch.float32]
    log(f"{'op':<21} {'max rel. err':>12} {'':<6}  bytes at benchmark size, bf16: "
        "unfused PyTorch (launches) -> fused minimum")
    ok = True
    for c in CHECKS:
        err = check(c, device)
        passed = err <= tol
        ok &= passed
        budget = []
        for mode, analyzer_mode in (("fwd", "forward"), ("fwd+bwd", "train")):
            if fused.get((c.op, mode)):  # compute-bound cases (attention), graph-only ones have none
                moved, launches = unfused_bytes(c, analyzer_mode)
                budget.append(f"{mode} {moved / 1e6:,.0f} MB ({launches}) -> {fused[(c.op, mode)] / 1e6:,.0f} MB")
        if not budget and c.suite in no_transformers:
            budget = [f"no byte budget here: its benchmark case needs transformers: pip install '{DISTRIBUTION}[hf]'"]
        budget = budget or [f"no byte budget here: see its benchmark suite ({c.suite})"]
        log(f"{c.op:<21} {err:>12.2e} {'ok' if passed else 'FAILED':<6}  {'; '.join(budget)}")
    return ok
