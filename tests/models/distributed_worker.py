"""Runs under ``torchrun --nproc_per_node 2`` (gloo, CPU): optimized tiny models trained under
FSDP2 and DDP, each compared with the unoptimized model run whole in this process.

    torchrun --standalone --nproc_per_node 2 tests/models/distributed_worker.py OUT.json SCENARIO ...

Rank 0 writes {scenario: {"loss_error", "grad_error" (the largest relative error of any
gradient, the full tensor gathered), ...} or {"error": message}} to OUT.json; the test reads it.
"""

from __future__ import annotations

import json
import sys
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]
from fast_interpreter import patch_language_once_per_launch  # noqa: E402
from tiny_models import build  # noqa: E402

import onepass  # noqa: E402
from onepass import ops  # noqa: E402

BATCH, SEQ = 4, 10  # the whole batch; each of the 2 ranks trains on its half


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _reference(family: str, ids: torch.Tensor):
    """Loss and gradients of the unoptimized model on the whole batch, in this process."""
    model = build(family).train()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _mine(ids: torch.Tensor) -> torch.Tensor:
    rank = dist.get_rank()
    return ids.chunk(dist.get_world_size())[rank]


def _name(wrapped: str) -> str:
    """A parameter's name without the wrappers' prefixes (checkpoint_wrapper, torch.compile)."""
    return wrapped.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def _compare(model: torch.nn.Module, loss: torch.Tensor, ref_loss: torch.Tensor, ref_grads: dict) -> dict:
    """The mean loss over ranks and every gradient against the whole model's."""
    loss = loss.detach().float().clone()
    dist.all_reduce(loss)
    errors = {_name(n): _rel(_full(p.grad), ref_grads[_name(n)]) for n, p in model.named_parameters()}
    worst = max(errors, key=errors.get)
    return {"loss_error": abs(loss.item() / dist.get_world_size() - ref_loss.item()) / abs(ref_loss.item()),
            "grad_error": errors[worst], "worst": worst, "n_grads": len(errors),
            "missing_grads": sorted(set(ref_grads) - set(errors))}


def _shard(model, *, head_unit=False, mp=None, reshard_after_forward=True, wrap=None):
    kwargs = {"reshard_after_forward": reshard_after_forward}
    if mp is not None:
        kwargs["mp_policy"] = mp
    layers = model.model.layers
    for i, layer in enumerate(layers):
        if wrap is not None:
            layer = wrap(layer)
            layers[i] = layer
        fully_shard(layer, **kwargs)
    if head_unit:
        fully_shard(model.lm_head, **kwargs)
    fully_shard(model, **kwargs)
    return model


class _CountLoss:
    """Counts ``ops.linear_cross_entropy`` calls (the fused loss) while active."""

    def __enter__(self):
        self.calls, self._original = 0, ops.linear_cross_entropy

        def counted(*args, **kwargs):
            self.calls += 1
            return self._original(*args, **kwargs)

        ops.linear_cross_entropy = counted
        return self

    def __exit__(self, *exc):
        ops.linear_cross_entropy = self._original


def fsdp(family: str, ids: torch.Tensor, *, mp=None, **shard) -> dict:
    ref_loss, ref_grads = _reference(family, ids)
    model = build(family).train()
    onepass.optimize(model)
    _shard(model, mp=mp, **shard)
    with _CountLoss() as counter:
        mine = _mine(ids)
        loss = model(input_ids=mine, labels=mine).loss
    loss.backward()
    result = _compare(model, loss, ref_loss, ref_grads)
    result["fused_loss_calls"] = counter.calls
    if mp is not None:  # bf16 compute: the unoptimized model under the same policy sets the scale
        plain = _shard(build(family).train(), mp=mp, **shard)
        plain_loss = plain(input_ids=mine, labels=mine).loss
        plain_loss.backward()
        result["plain_grad_error"] = _compare(plain, plain_loss, ref_loss, ref_grads)["grad_error"]
    return result


def hf_checkpointing(family: str, ids: torch.Tensor) -> dict:
    ref_loss, ref_grads = _reference(family, ids)
    model = build(family).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    onepass.optimize(model)
    _shard(model)
    mine = _mine(ids)
    loss = model(input_ids=mine, labels=mine).loss
    loss.backward()
    return _compare(model, loss, ref_loss, ref_grads)


def checkpoint_wrapper(family: str, ids: torch.Tensor) -> dict:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper as wrap

    return fsdp(family, ids, wrap=wrap)


def compiled_blocks(family: str, ids: torch.Tensor) -> dict:
    """torchtitan's recipe: each block compiled (fullgraph), then sharded."""
    return fsdp(family, ids, wrap=lambda layer: torch.compile(layer, fullgraph=True, backend="aot_eager"))


def _refusal(call) -> dict:
    """The message of the ValueError ``call()`` raises, or None if it raises none."""
    try:
        call()
    except ValueError as e:
        return {"refused": str(e)}
    return {"refused": None}


def optimize_after_shard(family: str, ids: torch.Tensor) -> dict:
    model = _shard(build(family).train())
    return _refusal(lambda: onepass.optimize(model))


def undo_after_shard(family: str, ids: torch.Tensor) -> dict:
    model = build(family).train()
    onepass.optimize(model)
    _shard(model)
    return _refusal(lambda: onepass.undo(model))


def checkpoint_round_trip(family: str, ids: torch.Tensor) -> dict:
    """DCP save of an optimized, sharded model and its optimizer state after a step, loaded
    into a fresh one; then the full state dict, saved by save_pretrained and loaded back."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
        set_state_dict,
    )

    def make():
        model = build(family).train()
        onepass.optimize(model)
        _shard(model, head_unit=not model.config.tie_word_embeddings)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    model, opt = make()
    mine = _mine(ids)
    model(input_ids=mine, labels=mine).loss.backward()
    opt.step()
    folder = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(folder)
    model_sd, opt_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": opt_sd}, checkpoint_id=folder[0])

    fresh, fresh_opt = make()
    fresh_model_sd, fresh_opt_sd = get_state_dict(fresh, fresh_opt)
    state = {"model": fresh_model_sd, "optim": fresh_opt_sd}
    dcp.load(state, checkpoint_id=folder[0])
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    param_error = max(_rel(_full(a), _full(b)) for a, b in zip(fresh.parameters(), model.parameters()))
    moments = [(_full(s[k]), _full(fresh_opt.state[q][k])) for p, q in zip(model.parameters(), fresh.parameters())
               for s in [opt.state[p]] for k in ("exp_avg", "exp_avg_sq")]
    moment_error = max(_rel(b, a) for a, b in moments)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    keys_match = sorted(full) == sorted(build(family).state_dict())
    out = Path(folder[0]) / "pretrained"
    if dist.get_rank() == 0:
        model.save_pretrained(out, state_dict=dict(full))  # (it empties the dict it is handed)
    dist.barrier()
    import transformers

    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)  # on every rank: it may wait for the others
    pretrained_error = max(_rel(loaded.state_dict()[k], v) for k, v in full.items()) if full else None
    # the next loss from the loaded state equals the saved model's (after the state dicts: a forward without its
    # backward leaves the root unit's parameters gathered)
    losses = [m(input_ids=mine, labels=mine).loss.item() for m in (model, fresh)]
    return {"param_error": param_error, "moment_error": moment_error, "losses": losses, "keys_match": keys_match,
            "pretrained_error": pretrained_error}


def ddp(family: str, ids: torch.Tensor, *, wrap_first: bool = False) -> dict:
    """DistributedDataParallel with two micro-batches a rank, the first under ``no_sync``; with
    ``wrap_first``, the DDP wrapper is what optimize is handed."""
    from torch.nn.parallel import DistributedDataParallel

    ref_loss, ref_grads = _reference(family, ids)
    model = build(family).train()
    if wrap_first:
        wrapped = DistributedDataParallel(model)
        onepass.optimize(wrapped)
    else:
        onepass.optimize(model)
        wrapped = DistributedDataParallel(model)
    total = 0.0
    micro = _mine(ids).chunk(2)
    with wrapped.no_sync():
        loss = wrapped(input_ids=micro[0], labels=micro[0]).loss / 2
        loss.backward()
        total += loss.detach()
    loss = wrapped(input_ids=micro[1], labels=micro[1]).loss / 2
    loss.backward()
    total += loss.detach()
    return _compare(model, total, ref_loss, ref_grads)


BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
SCENARIOS = {
    "fsdp-llama": lambda ids: fsdp("llama", ids),
    "fsdp-llama-head-unit": lambda ids: fsdp("llama", ids, head_unit=True),
    "fsdp-llama-head-unit-bf16": lambda ids: fsdp("llama", ids, head_unit=True, mp=BF16),
    "fsdp-gemma2-tied-no-reshard": lambda ids: fsdp("gemma2", ids, reshard_after_forward=False),
    "fsdp-gemma2-tied-bf16": lambda ids: fsdp("gemma2", ids, mp=BF16),
    "fsdp-llama-checkpoint-wrapper": lambda ids: checkpoint_wrapper("llama", ids),
    "fsdp-gemma2-hf-checkpointing": lambda ids: hf_checkpointing("gemma2", ids),
    "fsdp-llama-compiled-blocks": lambda ids: compiled_blocks("llama", ids),
    "fsdp-optimize-after-shard": lambda ids: optimize_after_shard("llama", ids),
    "fsdp-undo-after-shard": lambda ids: undo_after_shard("llama", ids),
    "fsdp-dcp-llama": lambda ids: checkpoint_round_trip("llama", ids),
    "fsdp-dcp-gemma2-tied": lambda ids: checkpoint_round_trip("gemma2", ids),
    "ddp-llama-no-sync": lambda ids: ddp("llama", ids),
    "ddp-gemma2-wrapped-first": lambda ids: ddp("gemma2", ids, wrap_first=True),
}


def main(out: str, names: list[str]) -> None:
    patch_language_once_per_launch()
    dist.init_process_group("gloo")
    torch.manual_seed(1234)
    ids = torch.randint(0, 256, (BATCH, SEQ))  # the same on every rank (same seed)
    results = {}
    for name in names:
        try:
            results[name] = SCENARIOS[name](ids)
        except Exception as e:  # reported per scenario, so one failure does not hide the rest
            results[name] = {"error": f"{type(e).__name__}: {e}"[:2000], "traceback": traceback.format_exc()[-3000:]}
        dist.barrier()
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] or list(SCENARIOS))
