"""An optimized model trained through the trainers people use (Hugging Face's ``Trainer``,
TRL's ``SFTTrainer``, an accelerate loop) learns as the unoptimized one does: the same logged
losses and gradient norms, and the same parameters after a few steps.

Gradient accumulation is where a fused loss goes wrong (Liger-Kernel's issue #802): over
micro-batches with different numbers of target tokens, the step's loss is the sum over all of
them divided by their total count, which ``Trainer`` hands the model as ``num_items_in_batch``
and then trusts the model to have divided by. A loss that ignores it (a micro-batch mean, not
divided by the accumulation steps) or divides by the micro-batch's own count weighs the
micro-batches wrongly; ``test_the_comparison_sees_a_misscaled_loss`` checks that the comparison
used here would see either. The batches below are right-padded (labels -100, attention mask 0)
and start with masked "prompt" tokens, and the two micro-batches of every step count different
numbers of targets, so a per-micro-batch mean cannot match by chance.
"""

from __future__ import annotations

import functools
import math
import pathlib
import runpy
import sys
import tempfile
import warnings

import pytest
import tiny_models as tiny
import torch

import onepass
from onepass.testing import TOLERANCE, rel_error

transformers = pytest.importorskip("transformers")

EXAMPLE = pathlib.Path(__file__).parents[2] / "examples" / "train_with_trainer.py"
MICRO, ACCUMULATE, STEPS, SEQ = 2, 2, 3, 8  # rows a micro-batch, micro-batches a step, steps, tokens a row
LR = 0.5  # plain SGD: a gradient's scale shows in the parameters (AdamW's update would hide it)
PAD = 0
# fp32 kernels against PyTorch over 2 layers and 3 steps (measured: up to 6e-6; a misscaled loss: > 8e-3)
TOL = TOLERANCE[torch.float32] * 20


def _rows() -> list[dict[str, torch.Tensor]]:
    """STEPS * ACCUMULATE * MICRO rows, in training order: the first micro-batch of each step
    long (7-8 tokens), the second short (3-4), each with 1-2 masked prompt tokens."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(STEPS * ACCUMULATE * MICRO):
        long = (i // MICRO) % ACCUMULATE == 0
        length = int(torch.randint(7, 9, (), generator=g)) if long else int(torch.randint(3, 5, (), generator=g))
        prompt = 1 + i % 2
        ids = torch.full((SEQ,), PAD)
        ids[:length] = torch.randint(1, tiny.VOCAB, (length,), generator=g)
        labels = torch.full((SEQ,), -100)
        labels[prompt:length] = ids[prompt:length]
        rows.append({"input_ids": ids, "attention_mask": (torch.arange(SEQ) < length).long(), "labels": labels})
    return rows


def _micro_batches(rows: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    return [{k: torch.stack([r[k] for r in rows[i:i + MICRO]]) for k in rows[0]} for i in range(0, len(rows), MICRO)]


def _targets(batch: dict[str, torch.Tensor]) -> int:
    """The tokens a causal LM's loss counts: the labels after the first position, not -100."""
    return int(batch["labels"][:, 1:].ne(-100).sum())


def test_micro_batches_count_different_targets():
    """What makes the other tests able to fail: within every accumulation step the micro-batches
    count different numbers of targets, so a mean per micro-batch is not the step's mean."""
    counts = [_targets(b) for b in _micro_batches(_rows())]
    for step in range(STEPS):
        window = counts[step * ACCUMULATE:(step + 1) * ACCUMULATE]
        assert len(set(window)) == ACCUMULATE, counts


def _optimized(model: torch.nn.Module) -> torch.nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "partly fused" where an op is missing: test_optimize checks the report
        return onepass.optimize(model)


def _parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def _training(model: torch.nn.Module, out_dir, device: str, trainer_type=None, config_type=None, data=None,
              **config) -> dict:
    """Train ``model`` for STEPS steps with ``trainer_type`` (``Trainer``); its logged losses and
    gradient norms, what the steps changed in its parameters, and the keywords of each forward."""
    calls = []
    model.register_forward_pre_hook(lambda m, args, kwargs: calls.append(set(kwargs)), with_kwargs=True)
    initial = _parameters(model)
    args = (config_type or transformers.TrainingArguments)(
        output_dir=str(out_dir), per_device_train_batch_size=MICRO, gradient_accumulation_steps=ACCUMULATE,
        max_steps=STEPS, optim="sgd", learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.0,
        max_grad_norm=1e9,  # no clipping, but the norm is logged
        train_sampling_strategy="sequential", logging_steps=1, save_strategy="no", report_to=[],
        use_cpu=device == "cpu", disable_tqdm=True, dataloader_num_workers=0, seed=0, **config,
    )
    trainer = (trainer_type or transformers.Trainer)(model=model, args=args,
                                                     train_dataset=_rows() if data is None else data)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {
        "loss": torch.tensor([h["loss"] for h in logs]),
        "grad_norm": torch.tensor([h["grad_norm"] for h in logs]),
        "update": {n: p - initial[n] for n, p in _parameters(model).items()},
        "calls": calls,
    }


def _assert_same_training(run: dict, ref: dict) -> None:
    """The same logged losses and gradient norms, and the same change in every parameter."""
    assert len(run["loss"]) == len(ref["loss"]) == STEPS
    for key in ("loss", "grad_norm"):
        err = rel_error(run[key], ref[key])
        assert err <= TOL, f"logged {key}: {run[key].tolist()} against {ref[key].tolist()} (relative error {err:.3g})"
    assert run["update"].keys() == ref["update"].keys()
    for name, change in run["update"].items():
        err = rel_error(change, ref["update"][name])
        assert err <= TOL, f"the change in {name} after {STEPS} steps: relative error {err:.3g}"


@functools.cache
def _reference(family: str, device: str) -> dict:
    """The unoptimized model's Trainer run (shared by the tests that compare against it)."""
    with tempfile.TemporaryDirectory() as out_dir:
        run = _training(tiny.build(family).to(device), out_dir, device)
    return run


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_trainer_with_gradient_accumulation_matches_the_unoptimized_model(family, device, tmp_path):
    ref = _reference(family, device)
    run = _training(_optimized(tiny.build(family).to(device)), tmp_path, device)
    # Trainer read the patched forward's signature as HF's: it passed num_items_in_batch
    assert all({"labels", "attention_mask", "num_items_in_batch"} <= keys for keys in run["calls"]), run["calls"]
    _assert_same_training(run, ref)


def _misscaled(model: torch.nn.Module, divide_by_accumulation: bool) -> torch.nn.Module:
    """``model`` with a loss that ignores ``num_items_in_batch``: its micro-batch's own mean,
    divided by the accumulation steps or (Liger-Kernel's #802) not."""
    forward = model.forward

    @functools.wraps(forward)  # the signature Trainer reads: HF's, **kwargs included
    def misscaled_forward(*args, num_items_in_batch=None, **kwargs):
        out = forward(*args, **kwargs)
        if divide_by_accumulation:
            out.loss = out.loss / ACCUMULATE
        return out

    model.forward = misscaled_forward
    return model


@pytest.mark.parametrize("divide_by_accumulation", [False, True], ids=["ignored", "micro-batch-mean"])
def test_the_comparison_sees_a_misscaled_loss(divide_by_accumulation, tmp_path):
    """The parity check above fails for a model whose loss ignores ``num_items_in_batch``
    (plain PyTorch on the CPU: this checks the check, not the kernels)."""
    ref = _reference("llama", "cpu")
    run = _training(_misscaled(tiny.build("llama"), divide_by_accumulation), tmp_path, "cpu")
    with pytest.raises(AssertionError, match="logged loss"):
        _assert_same_training(run, ref)
    run["loss"], run["grad_norm"] = ref["loss"], ref["grad_norm"]  # and the parameters alone show it too
    with pytest.raises(AssertionError, match="the change in"):
        _assert_same_training(run, ref)


def test_accelerate_loop_with_gradient_accumulation_matches_the_unoptimized_model(device):
    """accelerate's loop: ``prepare(model, optimizer)``, ``accumulate``, and a loss divided by the
    targets of the whole accumulated batch (``num_items_in_batch``); ``accelerator.backward``
    divides by the accumulation steps, so the loss is multiplied by them first. The optimized
    model runs its ops' references here (the loop is under test; the Trainer test above checks
    the kernels on the same batches), and both runs match the Trainer's."""
    from accelerate import Accelerator

    batches = [{k: v.to(device) for k, v in b.items()} for b in _micro_batches(_rows())]

    def train(model):
        initial = _parameters(model)
        accelerator = Accelerator(gradient_accumulation_steps=ACCUMULATE, cpu=device == "cpu")
        model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))
        model.train()
        losses = []
        for step in range(STEPS):
            window = batches[step * ACCUMULATE:(step + 1) * ACCUMULATE]
            items = torch.tensor(sum(_targets(b) for b in window), device=device)
            total = 0.0
            for batch in window:
                with accelerator.accumulate(model):
                    loss = model(**batch, num_items_in_batch=items).loss
                    accelerator.backward(loss * ACCUMULATE)
                    optimizer.step()
                    optimizer.zero_grad()
                total += loss.item()
            losses.append(total)
        final = _parameters(accelerator.unwrap_model(model))
        return {"loss": torch.tensor(losses), "update": {n: p - initial[n] for n, p in final.items()}}

    ref = train(tiny.build("llama").to(device))
    with onepass.reference_mode():
        run = train(_optimized(tiny.build("llama").to(device)))
    trainer = _reference("llama", device)
    for name, got, expected in [("the unoptimized model", run, ref), ("Trainer", ref, trainer)]:
        err = rel_error(got["loss"], expected["loss"])
        assert err <= TOL, f"losses against {name}'s: {got['loss'].tolist()}, {expected['loss'].tolist()}"
        for param, change in got["update"].items():
            err = rel_error(change, expected["update"][param])
            assert err <= TOL, f"the change in {param} against {name}'s: relative error {err:.3g}"


def _tokenizer():
    """A tokenizer of the tiny vocabulary, built in memory: SFTTrainer takes its pad token."""
    from tokenizers import Tokenizer, models

    vocab = {"<pad>": PAD, **{f"<{i}>": i for i in range(1, tiny.VOCAB)}}
    return transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, "<pad>")),
                                                pad_token="<pad>")


def test_sft_trainer_matches_the_unoptimized_model(tmp_path):
    """TRL's SFTTrainer on the same rows, unpadded (its collator pads each micro-batch to its
    longest row), with its defaults but bf16 (fp32 here, for a tight comparison): gradient
    checkpointing on, and its own chunked LM head and loss (``add_fused_lm_head``, called with
    ``fused_lm_head=True``) on the optimized model's fused body. The optimized model runs its
    ops' references (the integration is under test; the Trainer test checks the kernels)."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")

    def train(model, out_dir):
        rows = [{"input_ids": r["input_ids"][r["attention_mask"].bool()].tolist(),
                 "labels": r["labels"][r["attention_mask"].bool()].tolist()} for r in _rows()]
        sft_trainer = functools.partial(trl.SFTTrainer, processing_class=_tokenizer())
        return _training(model, out_dir, "cpu", trainer_type=sft_trainer, config_type=trl.SFTConfig,
                         data=datasets.Dataset.from_list(rows), bf16=False, max_length=None)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRL on the tokenizer's pad token and the config's
        ref = train(tiny.build("llama"), tmp_path / "ref")
        with onepass.reference_mode():
            run = train(_optimized(tiny.build("llama")), tmp_path / "run")
    assert all("fused_lm_head" in keys for keys in run["calls"]), run["calls"]
    _assert_same_training(run, ref)


@pytest.mark.parametrize("way", ["sft", "accelerate"])
def test_the_example_trains_with_sft_trainer_and_accelerate(way, monkeypatch, capsys):
    """examples/train_with_trainer.py's other ways, on the ops' references (tests/test_examples.py
    runs its default way, Trainer, on the kernels)."""
    if way == "sft":
        pytest.importorskip("trl")
    monkeypatch.setattr(sys, "argv", ["train_with_trainer.py", "--with", way])
    with warnings.catch_warnings(), onepass.reference_mode():
        warnings.simplefilter("ignore")
        example = runpy.run_path(str(EXAMPLE), run_name="__main__")
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert f"{way}: losses" in last
    losses = [float(w.rstrip(",")) for w in last.split("losses")[-1].split()]
    # an untrained model's loss is near log(vocab): 11.8 for llama-1b's 128256 tokens (its shape on a GPU)
    bound = 1.5 * math.log(example["model"].config.vocab_size)
    assert len(losses) == 2 and all(0 < x < bound for x in losses), last


def test_a_forward_wrapped_before_optimize_keeps_its_own_keywords():
    import types

    model = tiny.build("llama").train()
    hf_forward = model.forward

    @functools.wraps(type(model).forward)
    def with_own_head(self, *args, fused_lm_head=False, **kwargs):
        return "the wrapper's own head" if fused_lm_head else hf_forward(*args, **kwargs)

    model.forward = types.MethodType(with_own_head, model)
    _optimized(model)
    ids = _micro_batches(_rows())[0]["input_ids"]
    with onepass.reference_mode():
        assert model(input_ids=ids, labels=ids, fused_lm_head=True) == "the wrapper's own head"


DPO_EXAMPLE = pathlib.Path(__file__).parents[2] / "examples" / "dpo_with_trl.py"


def _preference_data(pairs: int):
    """``pairs`` preference pairs as text in the example tokenizer's words: prompts and
    completions of different lengths, so the collator right-pads them."""
    datasets = pytest.importorskip("datasets")
    g = torch.Generator().manual_seed(0)

    def words(low: int, high: int) -> str:
        n = int(torch.randint(low, high + 1, (), generator=g))
        return " " + " ".join(f"w{i}" for i in torch.randint(2, 200, (n,), generator=g).tolist())

    return datasets.Dataset.from_dict({"prompt": [words(1, 4) for _ in range(pairs)],
                                       "chosen": [words(1, 5) for _ in range(pairs)],
                                       "rejected": [words(1, 5) for _ in range(pairs)]})


def _dpo_trainer(kind: str, device: str, optimize: bool = False) -> functools.partial:
    """TRL's DPOTrainer (``kind`` "trl") or the example's OnepassDPOTrainer ("onepass"), all but the
    policy and the config given: a reference model whose weights are not the policy's (a log-ratio
    taken against the wrong model shows), onepass-optimized with ``optimize``; the example's tokenizer."""
    trl = pytest.importorskip("trl")
    example = runpy.run_path(str(DPO_EXAMPLE), run_name="dpo_with_trl")  # the recipe without its training run
    ref_model = tiny.build("llama", seed=1).to(device).eval()
    return functools.partial(example["OnepassDPOTrainer"] if kind == "onepass" else trl.DPOTrainer,
                             ref_model=_optimized(ref_model) if optimize else ref_model,
                             processing_class=example["tokenizer_of"](200))


def test_dpo_through_linear_dpo_loss_trains_as_trl_dpo_trainer(device, tmp_path):
    """examples/dpo_with_trl.py's OnepassDPOTrainer trains as TRL's DPOTrainer does: over the
    same steps (two micro-batches of two right-padded pairs a step: gradient accumulation; TRL's
    defaults, gradient checkpointing included) the same logged losses, gradient norms, rewards and
    log-probs, and the same change in every parameter (plain SGD: the gradient shows)."""
    trl = pytest.importorskip("trl")
    data = _preference_data(STEPS * ACCUMULATE * MICRO)

    def train(kind: str) -> dict:
        trainers = []

        def dpo_trainer(**kwargs):
            trainers.append(_dpo_trainer(kind, device)(**kwargs))
            return trainers[-1]

        run = _training(tiny.build("llama").to(device), tmp_path / kind, device, trainer_type=dpo_trainer,
                        config_type=trl.DPOConfig, data=data, bf16=False, beta=0.5)
        logs = [h for h in trainers[0].state.log_history if "loss" in h]
        logged = [k for k in logs[0] if k.startswith(("rewards/", "logps/"))]
        run["metrics"] = {k: torch.tensor([h[k] for h in logs]) for k in logged}
        return run

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRL on the tokenizer's tokens and the deprecated gradient_checkpointing
        ref, run = train("trl"), train("onepass")
    assert ref["metrics"]["rewards/chosen"].abs().min() > 1e-3, ref["metrics"]  # the policy is not the reference
    _assert_same_training(run, ref)
    assert run["metrics"].keys() == ref["metrics"].keys() and len(ref["metrics"]) == 6, ref["metrics"].keys()
    for key, values in ref["metrics"].items():
        assert rel_error(run["metrics"][key], values) <= TOL, (key, run["metrics"][key].tolist(), values.tolist())


def test_dpo_through_linear_dpo_loss_on_optimized_models_matches_trl(device, tmp_path):
    """OnepassDPOTrainer with the policy and the reference model onepass-optimized (fused layers
    under the fused loss), on one batch of four right-padded pairs: the loss and every parameter's
    gradient are TRL's DPOTrainer's on the unoptimized models (one micro-batch: the interpreter
    runs the fused layers slowly; the test above covers the training loop)."""
    trl = pytest.importorskip("trl")
    data = _preference_data(4)

    def loss_and_grads(kind: str, optimize: bool):
        model = tiny.build("llama").to(device).train()
        config = trl.DPOConfig(str(tmp_path / kind), per_device_train_batch_size=4, bf16=False, beta=0.5,
                               report_to=[], use_cpu=device == "cpu", disable_tqdm=True)
        trainer = _dpo_trainer(kind, device, optimize)(model=_optimized(model) if optimize else model, args=config,
                                                       train_dataset=data)
        batch = next(iter(trainer.get_train_dataloader()))
        loss = trainer.compute_loss(trainer.model, batch)
        loss.backward()
        return loss.detach().cpu(), {n: p.grad.cpu() for n, p in model.named_parameters()}, batch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRL on the tokenizer's tokens and the deprecated gradient_checkpointing
        ref_loss, ref_grads, batch = loss_and_grads("trl", optimize=False)
        loss, grads, _ = loss_and_grads("onepass", optimize=True)
    # what lets it fail: padding, completions of different lengths, a policy that is not the reference
    assert batch["attention_mask"].eq(0).any() and len(set(batch["completion_mask"].sum(-1).tolist())) > 1
    assert abs(ref_loss.item() - math.log(2)) > 1e-3, ref_loss
    assert rel_error(loss, ref_loss) <= TOL, (loss.item(), ref_loss.item())
    assert grads.keys() == ref_grads.keys()
    for name, grad in ref_grads.items():
        err = rel_error(grads[name], grad)
        assert err <= TOL, f"the gradient of {name}: relative error {err:.3g}"
