"""Train an optimized model with Hugging Face's Trainer, TRL's SFTTrainer or accelerate.

    python examples/train_with_trainer.py                    # transformers.Trainer
    python examples/train_with_trainer.py --with sft         # TRL's SFTTrainer
    python examples/train_with_trainer.py --with accelerate  # a loop of your own, prepared by accelerate
    accelerate launch --use_fsdp --fsdp_version 2 examples/train_with_trainer.py   # GPUs, sharded (FSDP2)

(a toy-sized model on a CPU, llama-1b's shape on a GPU). One rule for all: optimize the model
first, then hand it over (``Trainer(model=...)``, ``SFTTrainer(model=...)``,
``accelerator.prepare(model, ...)``); the trainer then wraps or shards the optimized model
(``optimize`` refuses a model already sharded).

Gradient accumulation: the micro-batches of a step hold different numbers of target tokens
(padding and prompts are -100), and the step's loss is their summed loss over the total count.
Trainer counts it and passes it to the model as ``num_items_in_batch``, which the optimized
model's fused loss divides by, as HF's loss does; a loop of your own passes it too (below).
In training with labels the optimized model returns ``logits=None`` (the [tokens, vocab] logits
are never built); in evaluation it runs HF's forward and returns them.
"""

import argparse
import tempfile

import torch
import transformers

import onepass
from onepass.models.configs import build

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--with", dest="trainer", choices=("trainer", "sft", "accelerate"), default="trainer")
choice = parser.parse_known_args()[0].trainer  # known arguments only: the test suite runs this under pytest's

device = "cuda" if torch.cuda.is_available() else "cpu"
name, dtype = ("llama-1b", torch.bfloat16) if device == "cuda" else ("llama-tiny", torch.float32)
MICRO, ACCUMULATE, STEPS, SEQ = 2, 2, 2, 8  # rows a micro-batch, micro-batches a step, steps, longest row

torch.manual_seed(0)
model = build(name, device=device, dtype=dtype).train()
onepass.optimize(model)  # first; then the trainer gets the model

# Token rows of random lengths, as a tokenizer gives them; the first two tokens are a prompt, not learned.
rows = []
for _ in range(MICRO * ACCUMULATE * STEPS):
    ids = torch.randint(1, model.config.vocab_size, (int(torch.randint(3, SEQ + 1, ())),))
    rows.append({"input_ids": ids, "labels": torch.cat([torch.full((2,), -100), ids[2:]])})


def padded(batch: list[dict]) -> dict:
    """Right-padded to the longest row (pad token 0, label -100), with the attention mask."""
    shape = (len(batch), max(len(r["input_ids"]) for r in batch))
    out = {"input_ids": torch.zeros(shape, dtype=torch.long), "labels": torch.full(shape, -100),
           "attention_mask": torch.zeros(shape, dtype=torch.long)}
    for i, r in enumerate(batch):
        n = len(r["input_ids"])
        out["input_ids"][i, :n], out["labels"][i, :n], out["attention_mask"][i, :n] = r["input_ids"], r["labels"], 1
    return out


settings = dict(per_device_train_batch_size=MICRO, gradient_accumulation_steps=ACCUMULATE, max_steps=STEPS,
                learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True,
                use_cpu=device == "cpu")
with tempfile.TemporaryDirectory() as out_dir:
    if choice == "trainer":
        trainer = transformers.Trainer(model=model, args=transformers.TrainingArguments(out_dir, **settings),
                                       train_dataset=rows, data_collator=padded)
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]

    elif choice == "sft":
        # SFTTrainer runs its own chunked LM head and loss (TRL >= 1.x: add_fused_lm_head); onepass fuses
        # the rest of the model. It takes tokenized rows as they are; its collator pads them.
        import datasets
        import trl
        from tokenizers import Tokenizer, models

        # your model's tokenizer in real use (AutoTokenizer.from_pretrained); SFTTrainer reads its pad token
        vocab = {"<pad>": 0, **{f"<{i}>": i for i in range(1, model.config.vocab_size)}}
        tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, "<pad>")),
                                                         pad_token="<pad>")
        datasets.disable_progress_bars()
        data = datasets.Dataset.from_list([{k: v.tolist() for k, v in r.items()} for r in rows])
        # bf16 (TRL's default) autocasts; the CPU runs fp32 here
        config = trl.SFTConfig(out_dir, bf16=device == "cuda", **settings)
        trainer = trl.SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer)
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]

    else:
        from accelerate import Accelerator

        accelerator = Accelerator(gradient_accumulation_steps=ACCUMULATE, cpu=device == "cpu")
        loader = torch.utils.data.DataLoader(rows, batch_size=MICRO, collate_fn=padded)
        model, optimizer, loader = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3), loader)
        batches, losses = iter(loader), []
        for _ in range(STEPS):
            window = [next(batches) for _ in range(ACCUMULATE)]
            # the targets of the whole step on every process (labels shift by one): Trainer's num_items_in_batch
            items = accelerator.gather(sum((b["labels"][:, 1:] != -100).sum() for b in window)).sum()
            loss_sum = 0.0
            for batch in window:
                with accelerator.accumulate(model):
                    loss = model(**batch, num_items_in_batch=items).loss  # summed, over the step's count
                    # backward divides by the accumulation steps, and DDP / FSDP average over processes
                    accelerator.backward(loss * ACCUMULATE * accelerator.num_processes)
                    optimizer.step()
                    optimizer.zero_grad()
                loss_sum += loss.item()
            losses.append(loss_sum)

print(f"{name} on {device}, {choice}: losses " + ", ".join(f"{x:.4f}" for x in losses))
