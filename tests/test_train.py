"""End to end on the tiny job: outputs, metrics, adapter reload, and no [B, T, V] logits in training."""

from __future__ import annotations

import pytest
import yaml

from scale.train import run
from scale.training.metrics import read_jsonl
from tests.bounds import TINY_JOB_REL  # two fp32 paths of the tiny job (tests/bounds.py)
from tests.conftest import tiny_cfg


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny")
    final = run(tiny_cfg(out, "optim.lr=5e-3"))
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return out, final


def test_outputs_and_metrics(tiny_run):
    out, final = tiny_run
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["train"]["max_steps"] == 12 and saved["optim"]["lr"] == 5e-3 and saved["output_dir"] == str(out)
    rows = read_jsonl(out / "metrics.jsonl")
    train = [r for r in rows if "train/loss" in r]
    evals = [r for r in rows if "eval/loss" in r]
    assert [r["step"] for r in train] == [2, 4, 6, 8, 10, 12]
    assert [r["step"] for r in evals] == [0, 6, 12]
    for r in train:
        assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "train/peak_mem_gib",
                "train/data_s", "train/compute_s", "train/pad_fraction"} <= r.keys()
        assert 0 < r["train/mfu"] < 1                                   # against the GEMM peak measured at start
        assert r["train/peak_mem_gib"] > 0.1 and 0 <= r["train/data_s"] < r["train/compute_s"]
        assert r["train/tokens_per_s"] > 0 and r["train/grad_norm"] > 0
    for r in evals:
        assert {"eval/loss", "eval/target_nll", "eval/accuracy"} <= r.keys() and r["eval/examples"] == 32
    assert train[-1]["train/loss"] < train[0]["train/loss"]            # it learns
    assert evals[-1]["eval/loss"] < evals[0]["eval/loss"]
    assert evals[-1]["eval/accuracy"] == final["eval/accuracy"]
    # LR: warmup 2 steps then cosine to 10% of peak at the last step (logged LR is the one each step used).
    assert train[0]["train/lr"] == pytest.approx(5e-3) and train[-1]["train/lr"] == pytest.approx(5e-4)


def test_adapter_reloads_and_reproduces_final_eval(tiny_run, tokenizer):
    from accelerate import Accelerator
    from peft import PeftModel
    from torch.utils.data import DataLoader

    from scale.config.load import load_config
    from scale.data import Collator, build_splits
    from scale.modeling.build import load_base
    from scale.objectives.tail import LossSpec
    from scale.training.evaluate import evaluate

    out, final = tiny_run
    cfg = load_config(out / "config.yaml")
    base = load_base(cfg.model, len(tokenizer), cfg.train.seed)
    model = PeftModel.from_pretrained(base, out / "adapter")
    splits = build_splits(cfg.data, cfg.loss, tokenizer, cfg.data.path, cfg.train.seed)
    # Other batch size and the other padding side than the run used: the numbers must not move.
    dl = DataLoader(splits.eval, batch_size=7, collate_fn=Collator(tokenizer.pad_token_id, "right"))
    spec = LossSpec.from_config(cfg)
    spec.padding_side = "right"
    again = evaluate(Accelerator(cpu=True), model, dl, spec)
    assert again["eval/accuracy"] == final["eval/accuracy"]
    assert again["eval/loss"] == pytest.approx(final["eval/loss"], rel=TINY_JOB_REL)
    assert again["eval/target_nll"] == pytest.approx(final["eval/target_nll"], rel=TINY_JOB_REL)


def test_no_full_logits_in_a_training_step(tmp_path, monkeypatch):
    """Hook every LM-head call: it must never see all T positions of a batch."""
    import scale.modeling.build as modeling

    seen = []
    original = modeling.add_lora

    def hooked(model, *args, **kwargs):
        head = model.get_output_embeddings()
        head.register_forward_hook(lambda m, inp, out: seen.append((inp[0].shape[1], out.shape)))
        return original(model, *args, **kwargs)

    monkeypatch.setattr(modeling, "add_lora", hooked)
    import scale.training.evaluate
    import scale.loss
    import scale.training.parts.model

    T_seen = []
    real_forward_tail = scale.loss.tail.forward_tail

    def spy(model, batch, *a, **k):
        T_seen.append(batch["input_ids"].shape[1])
        return real_forward_tail(model, batch, *a, **k)

    monkeypatch.setattr(scale.loss.tail, "forward_tail", spy)   # training (loss_step)
    monkeypatch.setattr(scale.training.evaluate, "forward_tail", spy)   # evaluation
    monkeypatch.setattr(scale.training.parts.model, "build_model", lambda *a, **k: modeling.build_model(*a, **k))
    # eval.generate_samples=0: model.generate's own forwards keep one position ([1, 1, V]) but skip forward_tail
    run(tiny_cfg(tmp_path, "train.max_steps=2", "train.save_adapter=false", "eval.generate_samples=0"))
    assert len(seen) == len(T_seen) > 0
    for (kept, shape), T in zip(seen, T_seen):
        assert kept == 2 and shape[1] == 2 and T > 2, (kept, shape, T)   # [B, N=2, V], never [B, T, V]
