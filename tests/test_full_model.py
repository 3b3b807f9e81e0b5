"""A full fine-tune in one process: every weight moves, the checkpoint resumes bit-exactly, and the final
``model/`` is a plain transformers directory (sharded, fp32) that transformers loads without scale and that
scale-generate, scale-export and scale-lm-eval take as a run's merged model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from scale.train import run
from scale.training.checkpoint import CheckpointError
from scale.training.checkpoint.sharded_read import ShardReader
from scale.training.metrics import read_jsonl
from tests.bounds import TINY_JOB_REL
from tests.conftest import tiny_cfg

# 20 rows, micro-batch 2, GA 2: 5 windows per epoch; AdamW (tiny_cpu.yaml), so the resume carries its moments.
# max_shard_size 5MB: the 12.9 MB of fp32 weights (3.2M parameters) in 2 files: the 12.6 MB embedding (tied to the
# head) alone, as transformers never splits a tensor, and the rest.
JOB = ["model.finetune=full", "data.max_train_examples=20", "train.micro_batch_size=2",
       "train.gradient_accumulation_steps=2", "train.max_steps=8", "train.log_every=1", "train.eval_every=0",
       "model.gradient_checkpointing=false", "train.max_shard_size=5MB", "eval.generate_samples=0"]
K = 4


def _reset():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _weights(model_dir):
    out = {}
    for f in sorted(model_dir.glob("model*.safetensors")):
        out.update(load_file(f))
    return out


def _losses(out):
    return {r["step"]: r["train/loss"] for r in read_jsonl(out / "metrics.jsonl") if "train/loss" in r}


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """2K steps without interruption, a checkpoint at K and 2K, the invariants checked."""
    out = tmp_path_factory.mktemp("full")
    run(tiny_cfg(out, *JOB, f"train.save_every={K}", "train.check_invariants=true"))
    _reset()
    return out


def test_every_weight_moves_and_the_model_dir_holds_the_masters(full_run):
    checks = [r for r in read_jsonl(full_run / "metrics.jsonl") if "check/weights_moved" in r]
    assert checks == [{"step": 8, "check/weights_moved": True, "check/param_elements_local_fraction": 1.0,
                       "check/ranks_agree": True, "check/ranks_compared": 1}]
    model = full_run / "model"
    index = json.loads((model / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in model.glob("model-*.safetensors"))
    assert shards == sorted(set(index["weight_map"].values())) and len(shards) == 2
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json"} <= {
        p.name for p in model.iterdir()}
    config = json.loads((model / "config.json").read_text())
    assert config["use_cache"] is True and config.get("dtype", config.get("torch_dtype")) == "float32"
    # the final weights are the last checkpoint's (every weight, whole, fp32), the tied head saved once
    saved = _weights(model)
    reader = ShardReader(full_run / "checkpoints" / "step_000008")
    last = {name: reader.tensor(name) for name in reader.shapes}
    reader.close()
    assert saved.keys() == last.keys() and len(saved) == 20 and "lm_head.weight" not in saved
    assert all(saved[k].dtype == torch.float32 and torch.equal(saved[k], last[k]) for k in saved)


def test_full_checkpoint_resumes_bit_exact(full_run, tmp_path):
    run(tiny_cfg(tmp_path, *JOB, f"train.resume_from={full_run}/checkpoints/step_{K:06d}"))
    ref, got = _weights(full_run / "model"), _weights(tmp_path / "model")
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)
    ref_losses, got_losses = _losses(full_run), _losses(tmp_path)
    assert sorted(got_losses) == list(range(K + 1, 2 * K + 1))
    assert all(got_losses[s] == ref_losses[s] for s in got_losses)  # identical, not close
    reader = ShardReader(full_run / "checkpoints" / f"step_{K:06d}")
    # AdamW's exp_avg, exp_avg_sq of every weight, and its step count
    assert len(reader.shapes) == 20 and reader.whats == ["exp_avg", "exp_avg_sq"] and reader.step == K
    reader.close()


def test_a_full_checkpoint_does_not_resume_as_lora(full_run, tmp_path):
    lora = [o for o in JOB if o != "model.finetune=full"]
    with pytest.raises(CheckpointError, match=r"trained every weight \(model.finetune=full\); this run has "
                                              r"model.finetune=lora"):
        run(tiny_cfg(tmp_path, *lora, f"train.resume_from={full_run}/checkpoints/step_{K:06d}"))


def test_plain_transformers_loads_model_dir_and_evaluates_as_the_run(full_run, tmp_path):
    """Loaded in a process that never imports scale, the weights are the saved ones; evaluated here, the model
    gives the run's final evaluation (accuracy exactly, loss within the tiny job's fp32 bound)."""
    from accelerate import Accelerator
    from torch.utils.data import DataLoader
    from transformers import AutoModelForCausalLM

    from scale.config.load import load_config
    from scale.data import Collator, build_splits
    from scale.modeling.build import load_tokenizer
    from scale.objectives.tail import LossSpec
    from scale.training.evaluate import evaluate

    dump = tmp_path / "loaded.safetensors"
    code = ("import sys, torch\nfrom transformers import AutoModelForCausalLM\n"
            "from safetensors.torch import save_file\n"
            f"m = AutoModelForCausalLM.from_pretrained({str(full_run / 'model')!r})\n"
            "assert not any(k == 'scale' or k.startswith('scale.') for k in sys.modules)\n"
            "assert {p.dtype for p in m.parameters()} == {torch.float32}\n"
            f"save_file({{k: v.contiguous() for k, v in m.state_dict().items() if k != 'lm_head.weight'}}, "
            f"{str(dump)!r})\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path, timeout=300)
    saved, loaded = _weights(full_run / "model"), load_file(dump)
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)

    final = [r for r in read_jsonl(full_run / "metrics.jsonl") if "eval/loss" in r][-1]
    cfg = load_config(full_run / "config.yaml")
    tokenizer = load_tokenizer(cfg.model)
    model = AutoModelForCausalLM.from_pretrained(full_run / "model")
    splits = build_splits(cfg.data, cfg.loss, tokenizer, cfg.data.path, cfg.train.seed)
    dl = DataLoader(splits.eval, batch_size=16, collate_fn=Collator(tokenizer.pad_token_id, "left"))
    again = evaluate(Accelerator(cpu=True), model, dl, LossSpec.from_config(cfg))
    assert again["eval/accuracy"] == final["eval/accuracy"]
    assert abs(again["eval/loss"] / final["eval/loss"] - 1) <= TINY_JOB_REL, (again, final)


def test_commands_take_a_full_run(full_run, tmp_path):
    from scale.generation.export import merge_run
    from scale.generation.generator import load_for_generation
    from scale.lmeval import default_model_dir

    model, tokenizer, stops = load_for_generation(full_run)  # scale-generate RUN
    assert not hasattr(model, "peft_config") and stops == [tokenizer.eos_token_id]
    saved = _weights(full_run / "model")
    assert all(torch.equal(p, saved[n]) for n, p in model.named_parameters())
    assert merge_run(full_run) == full_run / "model"  # scale-export RUN: nothing to merge
    out = merge_run(full_run, tmp_path / "exported")  # scale-export RUN --out DIR: a copy
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in (full_run / "model").iterdir())
    assert default_model_dir(full_run) == full_run / "model"  # scale-lm-eval RUN


def test_model_dir_of_a_bf16_module_holds_and_says_float32(tmp_path, monkeypatch):
    """Under DeepSpeed bf16 the module's weights are bf16 copies and the masters fp32 partitions: model/ gets the
    masters (through DeepSpeed's safe_get_full_fp32_param, stood in for here by an fp32 copy) and a config.json that
    says float32, so from_pretrained's dtype="auto" loads them as they were trained (save_pretrained alone writes the
    module's bfloat16)."""
    from types import SimpleNamespace

    import deepspeed.utils
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    from scale.modeling.build import load_base
    from scale.training.checkpoint import save_model

    cfg = tiny_cfg(tmp_path)
    base = load_base(cfg.model, 49152, cfg.train.seed)
    masters = {id(p): p.detach().clone() for p in base.parameters()}  # fp32
    base.to(torch.bfloat16)
    monkeypatch.setattr(deepspeed.utils, "safe_get_full_fp32_param", lambda p: masters[id(p)])
    save_model(Accelerator(cpu=True), SimpleNamespace(deepspeed=True), SimpleNamespace(module=base),
               tmp_path / "model", "5GB")
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "float32"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype="auto")
    own = {n: masters[id(p)] for n, p in base.named_parameters()}
    assert all(p.dtype == torch.float32 and torch.equal(p, own[n]) for n, p in loaded.named_parameters())


def test_dpo_full_weights_with_a_precomputed_reference(tmp_path):
    """loss.reference=precomputed on full weights: the pass before training scores the pairs with the starting
    weights themselves (a full model has no adapter to switch off), so step 1's policy is its reference: rewards 0 up
    to two fp32 computations of the same log-probabilities (TINY_JOB_REL, other batches' padding), loss ln 2."""
    import math

    from tests.launching import PAIRS

    run(tiny_cfg(tmp_path, "model.finetune=full", "loss.reference=precomputed", "train.max_steps=1",
                 "train.eval_every=0", "data.max_train_examples=16", "train.save_adapter=false", *PAIRS))
    first = next(r for r in read_jsonl(tmp_path / "metrics.jsonl") if "train/loss" in r)
    for side in ("chosen", "rejected"):
        assert abs(first[f"train/rewards/{side}"]) <= 0.5 * TINY_JOB_REL * abs(first[f"train/logps/{side}"])
    assert abs(first["train/loss"] - math.log(2)) <= 0.5 * TINY_JOB_REL * (abs(first["train/logps/chosen"])
                                                                         + abs(first["train/logps/rejected"]))


@pytest.mark.parametrize("where", ["built-in", "directory"])
def test_dpo_full_weights_with_the_frozen_copy_as_reference(tmp_path, where, caplog):
    """loss.reference=model (the default of a full DPO run): a frozen copy of the starting weights, loaded again by
    the policy's own path (the built-in tiny-llama from train.seed, or a save_pretrained directory), in the step. At
    step 1 the policy is its reference and both run the same forward on the same micro-batch: the rewards are exactly
    0 and the loss is ln 2 as fp32 computes it (-log sigmoid(0) = log 2, rounded once). After the step the policy has
    moved and the reference has not: step 2's rewards are not 0. The copy never trains and is never saved."""
    import logging
    import math

    from tests.launching import PAIRS, from_directory, save_tiny_directory

    model = from_directory(save_tiny_directory(tmp_path / "base")) if where == "directory" else []
    with caplog.at_level(logging.INFO):
        run(tiny_cfg(tmp_path / "run", "model.finetune=full", *model, "train.max_steps=2", "train.eval_every=0",
                     "train.log_every=1", "data.max_train_examples=16", "train.save_adapter=false", *PAIRS))
    rows = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "train/loss" in r]
    first, second = rows[0], rows[1]
    assert first["train/rewards/chosen"] == 0.0 and first["train/rewards/rejected"] == 0.0
    assert first["train/rewards/margins"] == 0.0 and first["train/rewards/accuracies"] == 0.0
    assert abs(first["train/loss"] - math.log(2)) <= 2 ** -24 * math.log(2)  # one fp32 rounding of ln 2
    assert second["train/rewards/margins"] != 0.0
    assert "reference: model" in (tmp_path / "run" / "config.yaml").read_text()  # resolved in place, recorded
    line = next(r.getMessage() for r in caplog.records if "reference (" in r.getMessage())
    assert line.split("] ", 1)[-1].startswith("reference (loss.reference=model): a frozen copy of the starting weights, float32 forward, "
                           "3227968 of its 3227968 elements on this rank (single: whole)")


def test_grpo_full_weights_takes_its_kl_to_the_frozen_copy(tmp_path, caplog):
    """GRPO with rl.beta > 0 on full weights (before: refused, no adapter to switch off): the KL term's reference
    is the frozen copy of the starting weights. A round trained twice (rl.num_iterations=2): at step 1 the policy is
    its reference and the per-token KL exp(l_ref - l) - (l_ref - l) - 1 is exactly 0 (the same forward on the same
    rows); at step 2 the policy has moved and the reference has not."""
    import logging

    from tests.launching import GRPO

    with caplog.at_level(logging.INFO):
        run(tiny_cfg(tmp_path, "model.finetune=full", *GRPO, "train.max_steps=2", "train.eval_every=0",
                     "train.log_every=1", "train.save_adapter=false"))
    rows = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "train/loss" in r]
    assert rows[0]["train/kl"] == 0.0 and rows[1]["train/kl"] > 0
    assert any("reference (rl.beta=0.1): a frozen copy of the starting weights" in r.getMessage()
               for r in caplog.records)
