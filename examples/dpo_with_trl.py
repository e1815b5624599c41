"""DPO with TRL's DPOTrainer, its loss computed by ``onepass.ops.linear_dpo_loss``.

    python examples/dpo_with_trl.py

(a toy-sized model on a CPU, llama-1b's shape on a GPU). TRL (1.16) computes each token's
log-prob with a chunked LM head of its own (``model(..., fused_lm_head=True)``) and then the DPO
loss from them; ``OnepassDPOTrainer`` below keeps everything else of DPOTrainer (data, collator,
reference model, optimizer, logging) and replaces ``compute_loss``: it takes the last hidden
states of the policy and of the reference model and runs the LM heads and the loss in one
``linear_dpo_loss`` (the policy's logits made and dropped chunk by chunk, their gradient written
in the same pass). Both models are called as the trainer prepared them (wrapped by DDP, say), so
the wrapper's hooks run; a forward hook on the backbone hands over its output. The model may be
``onepass.optimize``d or not.

What it takes: a ``ref_model`` (not PEFT's adapter-off reference, nor
``precompute_ref_log_probs``), one ``loss_type`` of ``onepass.ops.preference.DPO_LOSS_TYPES``,
the default ``f_divergence_type``, no ``ld_alpha``, ``use_weighting`` or MoE aux loss, and an LM
head without logit scaling or soft-capping (Llama, Qwen, Mistral: yes; Gemma 2, Granite: no);
the rest is refused. It logs TRL's ``rewards/*`` and ``logps/*`` metrics (not its entropy, token
accuracy or mean logits, which need per-token outputs). The same recipe, a ``compute_loss`` that
calls the op on hidden states, fits TRL's other trainers and onepass's other losses
(``linear_kto_loss``, ``linear_grpo_loss``, ...).
"""

import copy
import tempfile
from collections import defaultdict

import torch
import transformers
import trl

import onepass
from onepass.models.configs import build
from onepass.ops.preference import DPO_LOSS_TYPES


class OnepassDPOTrainer(trl.DPOTrainer):
    """DPOTrainer whose loss is ``onepass.ops.linear_dpo_loss`` on the models' last hidden states."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        a = self.args
        needs = {
            "a ref_model": self.ref_model is not None,
            f"one loss_type of {DPO_LOSS_TYPES}": len(a.loss_type) == 1 and a.loss_type[0] in DPO_LOSS_TYPES,
            "f_divergence_type='reverse_kl'": a.f_divergence_type == "reverse_kl",
            "no ld_alpha, use_weighting or aux loss": a.ld_alpha is None and not a.use_weighting
            and not self.aux_loss_enabled,
        }
        missing = [need for need, ok in needs.items() if not ok]
        if missing:
            raise ValueError(f"{type(self).__name__} needs {', '.join(missing)}")
        self.onepass_metrics = {"train": defaultdict(list), "eval": defaultdict(list)}

    def _last_hidden_states(self, model, inputs) -> torch.Tensor:
        """The backbone's output [B, S, H], from a call of ``model`` itself: a wrapper's forward
        (DDP's gradient sync) runs. One position's logits are made, the rest never."""
        captured = []
        backbone = self.accelerator.unwrap_model(model).get_decoder()
        hook = backbone.register_forward_hook(lambda _module, _args, out: captured.append(out.last_hidden_state))
        try:
            model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], use_cache=False,
                  logits_to_keep=1)
        finally:
            hook.remove()
        return captured[-1]

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:  # the logits for compute_metrics: TRL's own path makes them
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        # TRL's alignment: position t predicts token t + 1, scored where the completion is
        labels = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, -100)[:, 1:]
        hidden = self._last_hidden_states(model, inputs)[:, :-1]
        with torch.no_grad():
            ref_hidden = self._last_hidden_states(self.ref_model, inputs)[:, :-1]
        head = self.accelerator.unwrap_model(model).get_output_embeddings()
        ref_head = self.accelerator.unwrap_model(self.ref_model).get_output_embeddings()
        loss_type = self.loss_types[0]
        loss, metrics = onepass.ops.linear_dpo_loss(
            hidden, head.weight, labels, head.bias, ref_hidden, ref_head.weight, ref_head.bias, beta=self.beta,
            loss_type=loss_type, discopop_tau=self.args.discopop_tau,
            # TRL 1.16 reads label_smoothing in these two only ("sigmoid" ignores it; onepass's would apply it)
            label_smoothing=self.label_smoothing if loss_type in ("robust", "exo_pair") else 0.0)
        chosen_logps, rejected_logps, *_, chosen_rewards, rejected_rewards = metrics
        logged = self.onepass_metrics["train" if model.training else "eval"]
        gather = self.accelerator.gather
        logged["rewards/chosen"].append(gather(chosen_rewards).mean().item())
        logged["rewards/rejected"].append(gather(rejected_rewards).mean().item())
        logged["rewards/accuracies"].append(gather((chosen_rewards > rejected_rewards).float()).mean().item())
        logged["rewards/margins"].append(gather(chosen_rewards - rejected_rewards).mean().item())
        logged["logps/chosen"].append(gather(chosen_logps).mean().item())
        logged["logps/rejected"].append(gather(rejected_logps).mean().item())
        return loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        prefix = "eval_" if mode == "eval" else ""  # as DPOTrainer names its evaluation metrics
        logs.update({prefix + key: sum(v) / len(v) for key, v in self.onepass_metrics[mode].items()})
        self.onepass_metrics[mode].clear()
        super().log(logs, start_time)


def tokenizer_of(words: int) -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer built in memory (your model's own in real use: AutoTokenizer.from_pretrained)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, "<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="</s>")


if __name__ == "__main__":
    import datasets

    device = "cuda" if torch.cuda.is_available() else "cpu"
    name, dtype = ("llama-1b", torch.bfloat16) if device == "cuda" else ("llama-tiny", torch.float32)
    PAIRS, STEPS = 4, 2

    torch.manual_seed(0)
    model = build(name, device=device, dtype=dtype).train()
    ref_model = copy.deepcopy(model).eval()
    onepass.optimize(model)  # optional: fused layers under the fused loss
    onepass.optimize(ref_model)

    # Preference pairs as text: a prompt, the chosen and the rejected completion (TRL tokenizes them)
    def words(n: int) -> str:
        return " ".join(f"w{i}" for i in torch.randint(2, 200, (n,)).tolist())

    data = datasets.Dataset.from_dict({"prompt": [words(3) for _ in range(PAIRS)],
                                       "chosen": [" " + words(4) for _ in range(PAIRS)],
                                       "rejected": [" " + words(2) for _ in range(PAIRS)]})
    datasets.disable_progress_bars()
    with tempfile.TemporaryDirectory() as out_dir:
        config = trl.DPOConfig(out_dir, per_device_train_batch_size=PAIRS // STEPS, max_steps=STEPS,
                               learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[],
                               disable_tqdm=True, bf16=device == "cuda", use_cpu=device == "cpu")
        trainer = OnepassDPOTrainer(model=model, ref_model=ref_model, args=config, train_dataset=data,
                                    processing_class=tokenizer_of(200))
        trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    print(f"{name} on {device}, DPO through linear_dpo_loss: losses " + ", ".join(f"{h['loss']:.4f}" for h in logs)
          + f"; rewards/margins {logs[-1]['rewards/margins']:.4f}")
