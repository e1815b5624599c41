"""The LM head and its loss: with labels in training, the head and the shifted cross-entropy
run as one ``linear_cross_entropy`` whose logits are never materialised.

The head's logits must be ``lm_head(hidden)``, optionally scaled (Granite, Cohere) and
soft-capped (Gemma 2 and 3) as the config says (``head_transform``), and the loss the causal
LM's cross-entropy; the model's probe checks the first (``onepass.models.probe``).
"""

from __future__ import annotations

import inspect
import warnings
from typing import Callable

import torch
from torch import Tensor, nn

from onepass import ops
from onepass.models import distributed, probe, tied_embedding
from onepass.models.cache import CACHE_KEYWORDS, cache_keyword, pop_cache, unfilled_cache_type
from onepass.models.patches import FUSED, UNFUSED, InstanceForward, Patches, hooked


def _fused_keywords(model_class: type) -> frozenset[str]:
    """The keywords the fused path takes: those the class's own forward names, transformers'
    attention and loss keywords (``TransformersKwargs``) and the loss's own. Any other belongs
    to a forward another library set on the instance before ``optimize`` (TRL's SFTTrainer
    passes ``fused_lm_head=True`` to the head it put there), which then runs as it is."""
    from transformers.utils.generic import TransformersKwargs

    named = [name for name, p in inspect.signature(model_class.forward).parameters.items()
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return frozenset((*named, *TransformersKwargs.__annotations__, *CACHE_KEYWORDS, "return_dict", "shift_labels",
                      "ignore_index"))


def causal_lm_forward(original: Callable, softcap: float | None, scale: float | None,
                      fused_keywords: frozenset[str], dynamic_cache: bool = True) -> Callable:
    """With labels in training: the base model, then the LM head and the shifted
    cross-entropy in one ``linear_cross_entropy`` (logits never materialised; the output's
    ``logits`` is None). Otherwise (inference, generate, no labels) the original forward
    (``original``: a function taking the model first, see ``_unbound_forward``).
    A head weight tied to the input embedding gets one gradient, the embedding's token rows
    added into the head's (``tied_embedding``), not two [V, H] gradients summed by autograd.

    No KV cache is filled unless asked for (``use_cache=True`` or a cache passed), yet
    the base model gets an (unfilled) cache: without one, HF checks the position ids for
    packed sequences, a host sync every forward (so the host cannot queue the step ahead of
    the GPU), and under torch.compile that check builds a full mask instead (a slower
    compiled step). Where HF would make that check (the cache off,
    by argument or config, position ids given and no attention mask: the padding-free
    batches of ``DataCollatorWithFlattening``, whose documents must not attend to each
    other) the base model gets no cache, as from HF. Under gradient checkpointing, whose
    layers drop any cache with a warning, the base model runs with ``use_cache=False``."""
    unfilled_cache = unfilled_cache_type()
    cache_name = cache_keyword()

    def forward(self, input_ids=None, *args, labels=None, **kwargs):
        # (positional arguments: labels may be among them; a head wrapped since optimize, e.g. by a PEFT
        # adapter, or with hooks is called as HF calls it; so is a keyword of another forward, see _fused_keywords)
        if (labels is None or not self.training or args or not fused_keywords.issuperset(kwargs)
                or not _fusable_head(self.lm_head)):
            if labels is not None:
                kwargs["labels"] = labels
            return original(self, input_ids, *args, **kwargs)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        kwargs.pop("logits_to_keep", None)
        return_dict = kwargs.pop("return_dict", None)
        num_items = kwargs.pop("num_items_in_batch", None)
        shift_labels = kwargs.pop("shift_labels", None)
        ignore_index = kwargs.pop("ignore_index", -100)
        cache = pop_cache(kwargs)
        if cache is not None:
            kwargs[cache_name] = cache
        unfilled = not kwargs.get("use_cache") and cache is None
        use_cache = kwargs.get("use_cache")
        use_cache = getattr(self.config, "use_cache", False) if use_cache is None else use_cache  # HF's default
        maybe_packed = not use_cache and kwargs.get("position_ids") is not None and kwargs.get("attention_mask") is None
        checkpointing = getattr(self.base_model, "gradient_checkpointing", False)
        if unfilled and (maybe_packed or checkpointing or not dynamic_cache):
            kwargs["use_cache"] = False
        elif unfilled:
            kwargs[cache_name] = unfilled_cache(config=self.config)
        input_ids, head_weight = tied_embedding.tie(self, input_ids, kwargs)
        out = self.base_model(input_ids, **kwargs)
        hidden = out[0] if scale is None else out[0] * scale  # (logits * scale) as the head's input scaled
        if shift_labels is None:
            shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        loss = self.lm_head(  # through the module: an FSDP2 unit gathers its weight
            hidden.reshape(-1, hidden.shape[-1]), shift_labels.reshape(-1).to(hidden.device), weight=head_weight,
            ignore_index=ignore_index, reduction="mean" if num_items is None else "sum", softcap=softcap,
            loss_dtype=torch.float32,
        )
        if num_items is not None:
            loss = loss / (num_items.to(loss.device) if torch.is_tensor(num_items) else num_items)
        result = CausalLMOutputWithPast(
            loss=loss, logits=None, hidden_states=getattr(out, "hidden_states", None),
            attentions=getattr(out, "attentions", None),
            **{cache_name: None if unfilled else getattr(out, cache_name, None)},
        )
        # as HF's tuple, (loss, logits, ...): the logits' place kept (None), the rest as to_tuple gives it
        return (loss, None, *result.to_tuple()[1:]) if return_dict is False else result

    return forward


def _fusable_head(head: nn.Module) -> bool:
    """Whether the LM head runs the fused loss: a plain ``nn.Linear`` without hooks, or one that FSDP2
    made a unit of its own with only FSDP's hooks (which gather its weight around the call, whatever
    the call computes), and in either case the head optimize patched (_patched_head)."""
    if type(head) is nn.Linear:
        return not hooked(head) and _patched_head(head)
    return (type(head).__bases__[1:] == (nn.Linear,) and not hooked() and distributed.fsdp_hooks_only(head)
            and _patched_head(head))


def _patched_head(head: nn.Module) -> bool:
    """Whether ``head`` still has the forward optimize gave it; a head put in since (``resize_token_embeddings``
    of an untied model, an assignment) has its own, so the loss runs as Hugging Face's, with a warning."""
    forward = head.__dict__.get("forward")
    if isinstance(forward, InstanceForward) and forward._make[0] is lm_head_forward:
        return True
    warnings.warn("onepass: the model's lm_head was replaced after onepass.optimize (e.g. by "
                  "resize_token_embeddings), so its loss runs unfused; onepass.undo(model) then "
                  "onepass.optimize(model) fuses it again", stacklevel=4)
    return False


def lm_head_forward() -> Callable:
    """The LM head's forward: ``nn.Linear``'s, or with ``targets`` the fused loss of its logits
    (``linear_cross_entropy``; ``weight`` stands in for the module's own where a tied input
    embedding hands it on), so that the loss runs inside the module's call."""

    def forward(self, input: Tensor, targets: Tensor | None = None, *, weight: Tensor | None = None,
                **loss_kwargs) -> Tensor:
        if targets is None:
            return nn.functional.linear(input, self.weight, self.bias)
        return ops.linear_cross_entropy(input, self.weight if weight is None else weight, targets, bias=self.bias,
                                        **loss_kwargs)

    return forward


def _unbound_forward(model: nn.Module) -> Callable:
    """The model's current forward as a function of the model: its method's function when
    bound to the model (so a deepcopy of the optimized model runs its own weights), else a
    call of whatever callable the instance holds."""
    bound = model.forward
    if getattr(bound, "__self__", None) is model:
        return bound.__func__
    return lambda _model, *args, **kwargs: bound(*args, **kwargs)


def head_transform(config) -> tuple[float | None, float | None]:
    """(softcap, scale) of the family's logits: ``final_logit_softcapping`` (Gemma 2 and 3);
    Granite's ``logits_scaling`` (logits divided by it) or Cohere's ``logit_scale`` (times it)."""
    softcap = getattr(config, "final_logit_softcapping", None)
    scale = getattr(config, "logit_scale", None)
    if getattr(config, "logits_scaling", None) is not None:
        scale = 1.0 / config.logits_scaling
    return softcap, (None if scale in (None, 1, 1.0) else float(scale))


def _head_differs(model: nn.Module, calls: dict | None, softcap: float | None, scale: float | None) -> str | None:
    """Whether the recorded logits are the head's of the recorded hidden states, scaled and
    soft-capped as ``head_transform`` says (None: yes, or nothing recorded)."""
    base, top = (calls or {}).get(id(model.base_model)), (calls or {}).get(id(model))
    if base is None or top is None:
        return None
    hidden = base.output[0]
    with torch.no_grad():
        logits = nn.functional.linear(hidden if scale is None else hidden * scale, model.lm_head.weight,
                                      model.lm_head.bias)
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
    return probe.mismatch(logits, getattr(top.output, "logits", None))


def patch_lm_loss(patches: Patches, model: nn.Module, calls: dict | None = None) -> str:
    head = getattr(model, "lm_head", None)
    if head is None:
        return f"{UNFUSED}: {type(model).__name__} has no lm_head (not a causal LM)"
    if type(head) is not nn.Linear:
        return f"{UNFUSED}: lm_head is a {type(head).__name__}, not a plain nn.Linear"
    if getattr(model, "loss_type", "ForCausalLM") not in (None, "ForCausalLM"):
        return f"{UNFUSED}: the model's loss is {model.loss_type}, not the causal LM's cross-entropy"
    if getattr(ops, "linear_cross_entropy", None) is None:
        return f"{UNFUSED}: onepass.ops.linear_cross_entropy is not in this build"
    softcap, scale = head_transform(model.config)
    why = _head_differs(model, calls, softcap, scale)
    if why is not None:
        return f"{UNFUSED}: the logits are not lm_head(hidden) with the config's scale and softcap: {why}"
    # a model with a cache of its own (MiniMax's) takes no DynamicCache: its training forward gets none
    dynamic_cache = getattr(type(model), "_supports_default_dynamic_cache", lambda: True)()
    patches.set_forward(model, causal_lm_forward, _unbound_forward(model), softcap, scale, _fused_keywords(type(model)),
                        dynamic_cache)
    patches.set_forward(head, lm_head_forward)
    status = f"{FUSED}: lm_head + cross-entropy in linear_cross_entropy when labels are given in training"
    embed = model.get_input_embeddings()
    if embed is not None and getattr(embed, "weight", None) is head.weight:
        status += "; the tied input embedding's token rows are added into the head's weight gradient"
    return status
