"""Resume on another number of processes or another launch mode with the same global batch (the portable state,
scale/training/checkpoint/portable.py), and ``resume_from=latest|auto`` taking the newest checkpoint that verifies.

Unit tier: the accumulation rule, verification, the choice of checkpoint, rotation, and a checkpoint "written by 2
processes" resumed on one in this process. Launch tier: a few real cross-mode resumes (the whole matrix is
``benchmarks/resume_parity.py --across``).
"""

from __future__ import annotations

import json
import logging
import shutil
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from scale.config.validation import ConfigError
from scale.train import run
from scale.training.checkpoint import (CheckpointError, compare_configs, list_checkpoints, pick_resume, record_files,
                                       rotate, verify)
from scale.training.checkpoint import derived_seed
from scale.training.metrics import read_jsonl
from scale.training.state import STATE_FILE
from scale.training.state import resume_accumulation
from tests.conftest import log_file_lines, tiny_cfg
from tests.launching import PAIRS

# 24 rows, G = 8: 3 optimizer steps per epoch; the step-4 checkpoint is 1 window into the second epoch
JOB = ["data.max_train_examples=24", "train.micro_batch_size=2", "train.max_steps=8", "train.save_every=4",
       "train.log_every=1", "train.eval_every=0", "eval.generate_samples=0", "lora.dropout=0.0",
       "optim.name=adamw", "optim.lr=1e-3", "model.gradient_checkpointing=false", "log.peak_flops=false"]
TOL = 1e-5


def _reset():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _adapter(out):
    return load_file(out / "adapter" / "adapter_model.safetensors")


def _losses(out):
    return {r["step"]: r["train/loss"] for r in read_jsonl(out / "metrics.jsonl") if "train/loss" in r}


def _edit_state(ckpt, **fields):
    state = json.loads((ckpt / STATE_FILE).read_text())
    for key, value in fields.items():
        if key == "ga":
            state["config"]["train"]["gradient_accumulation_steps"] = value
        else:
            state[key] = value
    state["files"] = record_files(ckpt)
    (ckpt / STATE_FILE).write_text(json.dumps(state))


# ---- the global batch a resume keeps ----

def test_resume_accumulation_keeps_the_global_batch():
    # the checkpoint's own micro-batch and accumulation (the config unchanged): recomputed for the new rank count
    assert resume_accumulation(8, 2, 2, 2, 2, 1) == 4
    assert resume_accumulation(8, 2, 2, 2, 2, 4) == 1
    assert resume_accumulation(8, 2, 4, 2, 4, 2) == 2
    # values given for this run that keep G are kept; the same rank count changes nothing
    assert resume_accumulation(8, 2, 2, 4, 2, 1) == 2
    assert resume_accumulation(8, 2, 2, 2, 2, 2) == 2
    with pytest.raises(ConfigError) as e:
        resume_accumulation(8, 2, 2, 2, 3, 2, "checkpoint c")
    assert str(e.value) == (
        "checkpoint c was trained with global_batch_size=8; train.micro_batch_size=2 x "
        "train.gradient_accumulation_steps=3 x 2 data-parallel rank(s) = 12 would train other rows in every later "
        "step. Keep 8: on 2 data-parallel rank(s) set train.micro_batch_size x train.gradient_accumulation_steps to "
        "one of 1 x 4, 2 x 2, 4 x 1 (with the checkpoint's micro_batch_size=2 and gradient_accumulation_steps=2 the "
        "accumulation is computed for you)")
    with pytest.raises(ConfigError) as e:
        resume_accumulation(8, 2, 2, 2, 2, 3, "checkpoint c")
    assert str(e.value).endswith("Keep 8: 8 rows cannot be split evenly over 3 data-parallel ranks: use 1, 2, 4 or 8 "
                                 "data-parallel ranks (the divisors of 8)")
    with pytest.raises(ConfigError, match="Keep 8: 8 rows cannot be split evenly over 1 data-parallel ranks|1 x 8"):
        resume_accumulation(8, 4, 2, 3, 2, 1)  # micro-batch 3 does not divide 8


def test_batch_keys_are_warnings_when_the_global_batch_is_kept():
    saved = {"train": {"micro_batch_size": 2, "gradient_accumulation_steps": 2}, "optim": {"lr": 1e-3}}
    now = {"train": {"micro_batch_size": 2, "gradient_accumulation_steps": 4}, "optim": {"lr": 1e-3}}
    assert compare_configs(saved, now) == (["train.gradient_accumulation_steps: checkpoint 2 -> now 4"], [])
    assert compare_configs(saved, now, same_global_batch=True) == (
        [], ["train.gradient_accumulation_steps: checkpoint 2 -> now 4"])


def test_derived_seeds_differ_per_rank_and_step():
    seeds = {derived_seed(0, step, rank) for step in range(50) for rank in range(8)}
    assert len(seeds) == 400 and derived_seed(0, 3, 1) == derived_seed(0, 3, 1)


# ---- verification and the choice of checkpoint ----

@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """8 steps on one process, micro-batch 2 x GA 4 (G = 8), checkpoints at 4 and 8."""
    out = tmp_path_factory.mktemp("ref")
    run(tiny_cfg(out, *JOB, "train.gradient_accumulation_steps=4"))
    _reset()
    return out


def test_a_checkpoint_records_and_verifies_its_files(reference, tmp_path):
    ckpt = tmp_path / "c" / "checkpoints" / "step_000004"
    shutil.copytree(reference / "checkpoints" / "step_000004", ckpt)
    assert verify(ckpt) is None
    size = (ckpt / "adapter_model.safetensors").stat().st_size
    with open(ckpt / "adapter_model.safetensors", "r+b") as fh:  # same size, one byte changed
        fh.seek(size - 1)
        last = fh.read(1)
        fh.seek(size - 1)
        fh.write(bytes([last[0] ^ 1]))
    assert verify(ckpt).startswith("adapter_model.safetensors has changed since it was written (sha256 ")
    (ckpt / "adapter_model.safetensors").write_bytes(b"cut")
    assert verify(ckpt) == f"adapter_model.safetensors is 3 bytes, {size} when it was written"
    shutil.copy(reference / "checkpoints" / "step_000004" / "adapter_model.safetensors", ckpt)
    assert verify(ckpt) is None
    (ckpt / "optimizer_state.safetensors").unlink()
    assert verify(ckpt) == "optimizer_state.safetensors is missing"
    (ckpt / STATE_FILE).write_text("{")
    assert verify(ckpt).startswith("trainer_state.json cannot be read (JSONDecodeError")


def _acc():
    from accelerate import PartialState

    PartialState(cpu=True)  # accelerate's logger needs it
    return SimpleNamespace(num_processes=1, is_local_main_process=True, is_main_process=True, process_index=0)


def test_latest_skips_a_damaged_checkpoint_and_leaves_it(reference, tmp_path, caplog):
    out = tmp_path / "run"
    shutil.copytree(reference / "checkpoints", out / "checkpoints")
    newest = out / "checkpoints" / "step_000008"
    (newest / "optimizer_state.safetensors").write_bytes(b"")
    cfg = tiny_cfg(out, *JOB, "train.resume_from=latest")
    with caplog.at_level(logging.WARNING):
        assert pick_resume(_acc(), cfg) == out / "checkpoints" / "step_000004"
    assert f"skipping checkpoint {newest}: optimizer_state.safetensors is 0 bytes" in caplog.text
    assert newest.is_dir() and (newest / STATE_FILE).is_file()  # left in place
    (out / "checkpoints" / "step_000004" / "random_states_0.pkl").unlink()
    with pytest.raises(CheckpointError) as e:
        pick_resume(_acc(), cfg)
    size = (reference / "checkpoints" / "step_000008" / "optimizer_state.safetensors").stat().st_size
    assert str(e.value) == (f"train.resume_from=latest: no checkpoint in {out / 'checkpoints'} verifies (step_000008: "
                            f"optimizer_state.safetensors is 0 bytes, {size} when it was written; step_000004: "
                            f"random_states_0.pkl is missing). They are left in place: restore the damaged files, or "
                            f"start a new run in another output_dir.")


def test_an_explicit_damaged_checkpoint_names_the_file_and_the_newest_intact_one(reference, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(reference / "checkpoints", out / "checkpoints")
    newest = out / "checkpoints" / "step_000008"
    (newest / "adapter_model.safetensors").write_bytes(b"x")
    with pytest.raises(CheckpointError) as e:
        run(tiny_cfg(tmp_path / "again", *JOB, "train.gradient_accumulation_steps=4", f"train.resume_from={newest}"))
    size = (reference / "checkpoints" / "step_000008" / "adapter_model.safetensors").stat().st_size
    intact = out / "checkpoints" / "step_000004"
    assert str(e.value) == (f"checkpoint {newest} is damaged: adapter_model.safetensors is 1 bytes, {size} when it was "
                            f"written; the newest intact checkpoint is {intact} (train.resume_from={intact}, or "
                            f"latest)")
    assert not (tmp_path / "again" / "config.yaml").exists()  # refused before anything was written


def test_rotation_spares_checkpoints_of_later_steps(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6, 8):
        (root / f"step_{step:06d}").mkdir(parents=True)
        (root / f"step_{step:06d}" / STATE_FILE).write_text("{}")
    # resumed from step 4 (step 6 and 8 damaged, or an older resume_from), now at step 5 with save_total_limit=1
    (root / "step_000005").mkdir()
    (root / "step_000005" / STATE_FILE).write_text("{}")
    assert [p.name for p in rotate(tmp_path, 1, upto=5)] == ["step_000002", "step_000004"]
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000005", "step_000006", "step_000008"]


# ---- another number of processes, in this process ----

@pytest.mark.parametrize("extra", [[], ["optim.name=sgd", "optim.lr=0.5"],
                                   ["data.packing=true", "data.max_train_examples=30"], PAIRS,
                                   [*PAIRS, "data.packing=true", "data.max_train_examples=40"]],
                         ids=["adamw", "sgd", "packing", "dpo", "dpo-packing"])
def test_a_checkpoint_of_two_processes_resumes_on_one(reference, tmp_path, caplog, extra):
    """The step-4 checkpoint, rewritten as a DDP run on 2 processes would write it (micro-batch 2 x GA 2 x 2 ranks),
    resumed by the same config on one process: the accumulation becomes 4, the portable state is read, the RNG is
    re-derived (said in the log), and steps 5-8 equal the uninterrupted run's (no dropout: bit for bit). SGD has no
    per-tensor state: only its learning rate is carried. With data.packing the loader deals in bins: 8 bins per
    step, the checkpoint 2 windows into the second epoch. DPO (24 preference pairs, 8 per step, the in-step
    reference): the loader deals in pairs, so the resumed rank skips the pairs already trained and trains the rest
    once each: the same losses and adapter bit for bit; packed (40 pairs in ~20 bins of whole pairs), in bins."""
    if extra:
        reference = tmp_path / "ref"
        run(tiny_cfg(reference, *JOB, "train.gradient_accumulation_steps=4", *extra))
        _reset()
    saved = json.loads((reference / "checkpoints" / "step_000004" / STATE_FILE).read_text())
    assert saved["windows_in_epoch"] > 0  # mid-epoch: the resumed ranks skip what was trained
    ckpt = tmp_path / "ckpt"
    shutil.copytree(reference / "checkpoints" / "step_000004", ckpt)
    (ckpt / "optimizer.bin").unlink()  # a DDP checkpoint's accelerate files are not read on 1 process
    shutil.copy(ckpt / "random_states_0.pkl", ckpt / "random_states_1.pkl")
    _edit_state(ckpt, mode="ddp", world_size=2, data_parallel_size=2, ga=2)
    out = tmp_path / "out"
    with caplog.at_level(logging.INFO):
        run(tiny_cfg(out, *JOB, *extra, "train.gradient_accumulation_steps=2", f"train.resume_from={ckpt}"))
    assert "train.gradient_accumulation_steps 2 -> 4 keeps global_batch_size=8" in caplog.text
    assert f"[RANK 0] resumed from {ckpt} at step 4 (epoch 1, {saved['windows_in_epoch']} windows into it): portable state: " \
           f"written by ddp on 2 process(es), resumed as single on 1" in caplog.messages
    assert "[RANK 0] resume RNG: 2 process(es) wrote it, this run has 1: each rank's Python/NumPy/torch RNG is seeded from " \
           "(train.seed, step, rank); no dropout is active, so training draws nothing from it" in caplog.messages
    # the recomputed accumulation is logged once (above), not warned about again
    assert not [m for m in caplog.messages if "resume: train.gradient_accumulation_steps" in m]
    lines = log_file_lines(caplog.records)  # as a log file holds them (docs/outputs.md: none over 300 characters)
    assert max(len(line) for line in lines) <= 300, max(lines, key=len)
    ref, got = _adapter(reference), _adapter(out)
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)
    assert _losses(out) == {s: v for s, v in _losses(reference).items() if s > 4}
    saved = json.loads((out / "checkpoints" / "step_000008" / STATE_FILE).read_text())
    assert (saved["world_size"], saved["global_batch_size"], saved["config"]["train"]["gradient_accumulation_steps"]
            ) == (1, 8, 4)


def test_a_global_batch_that_cannot_be_kept_is_refused_before_anything_is_written(reference, tmp_path):
    ckpt = reference / "checkpoints" / "step_000004"
    with pytest.raises(ConfigError, match=r"was trained with global_batch_size=8; train.micro_batch_size=2 x "
                                          r"train.gradient_accumulation_steps=3 x 1 data-parallel rank\(s\) = 6"):
        run(tiny_cfg(tmp_path, *JOB, "train.gradient_accumulation_steps=3", f"train.resume_from={ckpt}"))
    assert not (tmp_path / "config.yaml").exists()


# ---- across launch modes: real launches (2 CPU processes, gloo) ----

ACROSS = ["train.max_steps=8", "train.save_every=4", "lora.dropout=0.0"]
ADAMW = ["optim.name=adamw", "optim.lr=1e-3"]
QLORA = ["model.quantize_4bit=true", "model.bnb_4bit_compute_dtype=float32", "model.bnb_4bit_quant_storage=float32"]


def _across(src, dst, extra, tmp_path):
    """The tiny job of tests/launching.py in mode ``src`` (8 steps, checkpoint at 4), then its step-4 checkpoint
    resumed in mode ``dst`` with the same config: steps 5-8 and the final adapter within 1e-5 of the uninterrupted
    run. ``"in-process"`` runs one process in this one (no launch)."""
    from tests.launching import modes, rel_dev, run_in_process, run_mode, weight_dev

    table = modes()
    job = [*table["single 1x(2,4)" if src == "in-process" else src][1], *ACROSS, *extra]

    def start(mode, overrides, out):
        if mode == "in-process":
            return run_in_process(overrides, out)
        return run_mode(table[mode][0], overrides, out)

    ref = start(src, job, tmp_path / "ref")
    got = start(dst, [*job, f"train.resume_from={tmp_path / 'ref' / 'checkpoints' / 'step_000004'}"], tmp_path / "res")
    assert got["steps"] == [5, 6, 7, 8]
    assert rel_dev(ref["loss"][4:], got["loss"]) <= TOL, (ref["loss"][4:], got["loss"])
    assert weight_dev(ref["weights"], got["weights"]) <= TOL
    return json.loads((tmp_path / "res" / "checkpoints" / "step_000008" / STATE_FILE).read_text())


@pytest.mark.launch
def test_ddp_on_two_processes_resumes_on_one(tmp_path):
    saved = _across("ddp 2x(2,2)", "in-process", ADAMW, tmp_path)
    assert (saved["mode"], saved["world_size"], saved["config"]["train"]["gradient_accumulation_steps"]) == (
        "single", 1, 4)


@pytest.mark.launch
def test_dpo_on_two_processes_resumes_on_one(tmp_path):
    """A DPO run (20 pairs of configs/data/tiny_pairs.jsonl, 8 per step: windows of 8, 8, 4 pairs per epoch) saved
    by DDP on 2 processes at step 4 (one window into the second epoch) resumes on one process: every later step
    trains the pairs the uninterrupted run trains, each once: its loss and its mean chosen/rejected logps (sums over
    distinct pairs of ~-50 nats: a pair missed or seen twice moves them by a pair's logp over 8) within 1e-5 of the
    uninterrupted run, and the adapter too."""
    from tests.launching import read_run

    saved = _across("ddp 2x(2,2)", "in-process", [*ADAMW, *PAIRS], tmp_path)
    assert (saved["mode"], saved["world_size"], saved["config"]["train"]["gradient_accumulation_steps"]) == (
        "single", 1, 4)
    assert read_run(tmp_path / "ref")["steps"] == list(range(1, 9))
    rows = {name: [r for r in read_jsonl(tmp_path / name / "metrics.jsonl") if "train/logps/chosen" in r]
            for name in ("ref", "res")}
    assert [r["step"] for r in rows["res"]] == [5, 6, 7, 8]
    for key in ("train/logps/chosen", "train/logps/rejected", "train/rewards/margins"):
        want, got = [r[key] for r in rows["ref"][4:]], [r[key] for r in rows["res"]]
        assert max(abs(x - y) / max(1.0, abs(x)) for x, y in zip(want, got)) <= TOL, (key, want, got)


@pytest.mark.launch
def test_one_process_qlora_resumes_under_zero3(tmp_path):
    saved = _across("in-process", "zero3 2x(2,2)", QLORA, tmp_path)  # SGD: the job's optimizer
    assert (saved["mode"], saved["world_size"], saved["config"]["train"]["gradient_accumulation_steps"]) == (
        "zero3", 2, 2)


@pytest.mark.launch
def test_zero2_resumes_under_fsdp2(tmp_path):
    saved = _across("zero2 2x(2,2)", "fsdp2 2x(2,2)", ADAMW, tmp_path)
    assert (saved["mode"], saved["world_size"]) == ("fsdp", 2)


def test_scale_plan_resume_prints_the_accumulation_that_keeps_the_global_batch(reference, capsys):
    from scale.plan import main

    ckpt = reference / "checkpoints" / "step_000004"
    assert main(["--resume", str(ckpt), "--gpus", "2", "--gpu-mem", "24"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (f"resume {ckpt} (step 4, written by single on 1 process(es)) on 2 GPU(s): global_batch_size 8 = "
                      f"micro_batch_size 2 x train.gradient_accumulation_steps=2 x 2 data-parallel rank(s); scale-train "
                      f"sets it when the config is the checkpoint's")
    assert any(line.startswith("fits in 24 GiB") for line in out)  # and each mode's memory on 2 GPUs
    # 8 GPUs: one row per rank and step; the checkpoint's micro-batch of 2 does not divide it: planned with 1 x 1
    assert main(["--resume", str(ckpt), "--gpus", "8", "--gpu-mem", "24"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        f"resume {ckpt} (step 4, written by single on 1 process(es)) on 8 GPU(s): global_batch_size 8 = "
        f"micro_batch_size 1 x train.gradient_accumulation_steps=1 x 8 data-parallel rank(s); the checkpoint's "
        f"micro_batch_size=2 does not divide the 1 rows a rank trains per step: give train.micro_batch_size=1 "
        f"train.gradient_accumulation_steps=1 to scale-train")
    assert main(["--resume", str(ckpt), "--gpus", "3"]) == 2
    assert capsys.readouterr().err == (
        f"scale-plan: error: ConfigError: checkpoint {ckpt} was trained with global_batch_size=8; "
        f"train.micro_batch_size=2 x train.gradient_accumulation_steps=4 x 3 data-parallel rank(s) = 24 would train "
        f"other rows in every later step. Keep 8: 8 rows cannot be split evenly over 3 data-parallel ranks: use 1, 2, "
        f"4 or 8 data-parallel ranks (the divisors of 8)\n")
    assert main(["--resume", str(reference), "--gpus", "1"]) == 2
    assert capsys.readouterr().err.startswith(f"scale-plan: error: PlanError: --resume {reference}: not a "
                                              f"checkpoint (FileNotFoundError")


def test_a_reseeded_resume_names_the_dropout_of_a_model_whose_config_has_it(tmp_path, caplog):
    """A model directory whose config has dropout (a Llama with attention_dropout=0.3, passed to
    F.scaled_dot_product_attention while training) trains with it under sft even with lora.dropout=0: a resume on
    another number of processes says that those masks, named, differ from the uninterrupted run's from there on."""
    import transformers

    from scale.modeling import load_tokenizer

    tokenizer = load_tokenizer(tiny_cfg(tmp_path / "t").model)
    model_dir = tmp_path / "llama-dropout"
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256, attention_dropout=0.3,
                                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                      pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    job = [*JOB, f"model.name_or_path={model_dir}", "model.tokenizer=smollm2-135m"]
    run(tiny_cfg(tmp_path / "ref", *job, "train.gradient_accumulation_steps=4"))
    _reset()
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tmp_path / "ref" / "checkpoints" / "step_000004", ckpt)
    (ckpt / "optimizer.bin").unlink()
    shutil.copy(ckpt / "random_states_0.pkl", ckpt / "random_states_1.pkl")
    _edit_state(ckpt, mode="ddp", world_size=2, data_parallel_size=2, ga=2)
    with caplog.at_level(logging.INFO):
        run(tiny_cfg(tmp_path / "out", *job, "train.gradient_accumulation_steps=2",
                     f"train.resume_from={ckpt}"))
    assert "[RANK 0] resume RNG: 2 process(es) wrote it, this run has 1: each rank's Python/NumPy/torch RNG is seeded " \
           "from (train.seed, step, rank); dropout masks (the model's attention_dropout=0.3 (2 functional rates in " \
           "layers)) differ from an uninterrupted run's from here on" in caplog.messages
