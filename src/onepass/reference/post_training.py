"""The post-training losses (``onepass.ops.preference``, ``onepass.ops.grpo``) as plain PyTorch: each op's own
definition with the whole batch's logits (the path it takes where the kernels do not run), float64 included."""

from __future__ import annotations

from onepass.ops.dispatch import reference_mode


def _plain(name: str):
    def loss(*args, **kwargs):
        from onepass import ops  # (ops imports this package: not at import time)

        with reference_mode():
            return getattr(ops, name)(*args, **kwargs)

    loss.__name__ = loss.__qualname__ = name
    loss.__doc__ = f"``onepass.ops.{name}`` computed from the batch's full logits (its reference path)."
    return loss


linear_dpo_loss = _plain("linear_dpo_loss")
linear_orpo_loss = _plain("linear_orpo_loss")
linear_simpo_loss = _plain("linear_simpo_loss")
linear_cpo_loss = _plain("linear_cpo_loss")
linear_kto_loss = _plain("linear_kto_loss")
linear_grpo_loss = _plain("linear_grpo_loss")
