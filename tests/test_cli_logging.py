"""Third-party warnings once per run (on rank 0), DeepSpeed's logger quiet in runs without DeepSpeed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

SCRIPT = r"""
import logging, os, sys, warnings
from scale.cli import configure_logging
configure_logging(dict(os.environ), uses_deepspeed=sys.argv[1] == "ds")
logging.getLogger("bitsandbytes.backends.cpu.ops").warning("BNB-NOTICE")
logging.getLogger("DeepSpeed").warning("DS-CHATTER")
logging.getLogger("transformers.modeling_utils").error("TF-ERROR")
logging.getLogger("scale.train").warning("OURS")
warnings.warn("LIB-WARNING", UserWarning)
"""


def _stderr(rank: str, deepspeed: bool) -> str:
    env = {**os.environ, "RANK": rank}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, "ds" if deepspeed else "no"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stderr


@pytest.mark.parametrize("rank, deepspeed, shown", [
    ("0", False, {"BNB-NOTICE", "TF-ERROR", "OURS", "LIB-WARNING"}),
    ("0", True, {"BNB-NOTICE", "DS-CHATTER", "TF-ERROR", "OURS", "LIB-WARNING"}),
    ("1", False, {"TF-ERROR", "OURS"}),
    ("1", True, {"TF-ERROR", "OURS"}),
])
def test_third_party_warnings_on_rank_0_only(rank, deepspeed, shown):
    err = _stderr(rank, deepspeed)
    every = {"BNB-NOTICE", "DS-CHATTER", "TF-ERROR", "OURS", "LIB-WARNING"}
    assert {m for m in every if m in err} == shown, err


NOTICES = r"""
import logging, os
from scale.cli import configure_logging
configure_logging(dict(os.environ), uses_deepspeed=True)
logging.getLogger("bitsandbytes.backends.cpu.ops").warning(
    "Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure you already `pip install "
    "kernels` and the kernels >= 0.11.1", "No module named 'kernels'")
logging.getLogger("DeepSpeed").warning("Setting accelerator to CPU. If you have GPU or other accelerator, we were "
                                       "unable to detect it.")
logging.getLogger("bitsandbytes.backends.cpu.ops").warning("ANOTHER-BNB-WARNING")
logging.getLogger("accelerate.checkpointing").info("Optimizer state saved in /x/optimizer.bin")
"""


def test_startup_notices_that_are_not_problems_are_plain_info_lines():
    """bitsandbytes' hub-kernel notice (whose advice, `pip install kernels`, would make it download from the hub)
    and DeepSpeed's CPU notice become INFO lines saying what they mean; other warnings stay warnings; accelerate's
    per-file checkpoint lines are dropped (the loop logs one line per checkpoint)."""
    proc = subprocess.run([sys.executable, "-c", NOTICES], cwd=ROOT, env={**os.environ, "RANK": "0"},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = [line.split(" ", 2)[2] for line in proc.stderr.splitlines() if line[:4].isdigit()]  # no timestamps
    assert lines == ["INFO bitsandbytes.backends.cpu.ops: bitsandbytes: 4-bit GEMMs use its built-in CPU kernel (the "
                     "hub kernel is not used)",
                     "INFO DeepSpeed: DeepSpeed runs on the CPU accelerator (no GPU found)",
                     "WARNING bitsandbytes.backends.cpu.ops: ANOTHER-BNB-WARNING"], proc.stderr
    assert "optimizer.bin" not in proc.stderr


def test_step_lines_and_durations():
    from scale.training.metrics import duration_text, step_line

    metrics = {"train/loss": 2.34567, "train/lr": 2e-4, "train/tokens_per_s": 1234.5, "train/grad_norm": 0.8123,
               "train/mfu": 0.391, "train/steps_per_s": 0.5}
    assert step_line(20, 100, metrics) == ("step 20/100 (20%) loss 2.3457 lr 2.00e-04 tok/s 1.23e+03 gnorm 0.812 "
                                           "mfu 0.391 eta 2m40s")
    del metrics["train/loss"], metrics["train/mfu"]  # every step skipped; no MFU
    assert step_line(100, 100, metrics) == "step 100/100 (100%) loss - lr 2.00e-04 tok/s 1.23e+03 gnorm 0.812 eta 0s"
    assert [duration_text(s) for s in (0, 37.4, 60, 259.6, 3600, 11_100)] == ["0s", "37s", "1m00s", "4m20s", "1h00m",
                                                                             "3h05m"]


class _Stream:
    def __init__(self, tty: bool) -> None:
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize("env, tty, plain", [("", True, False), ("", False, True), ("lines", True, True),
                                             ("bar", False, False), ("LINES", True, True)])
def test_plain_progress_where_stderr_is_not_a_terminal(monkeypatch, env, tty, plain):
    from scale.training.metrics import plain_progress

    monkeypatch.setenv("SCALE_PROGRESS", env)
    assert plain_progress(_Stream(tty)) is plain


def test_outputs_text_names_what_the_run_left(tmp_path):
    from scale.train import outputs_text

    for d in ("adapter", "checkpoints/step_000050", "checkpoints/step_000100", "checkpoints/step_000150.tmp"):
        (tmp_path / d).mkdir(parents=True)
    for f in ("config.yaml", "metrics.jsonl"):
        (tmp_path / f).write_text("")
    assert outputs_text(tmp_path) == (f"{tmp_path}: adapter/, checkpoints/ (2: step_000050, step_000100), "
                                      f"config.yaml, metrics.jsonl")
    for s in (200, 250):
        (tmp_path / f"checkpoints/step_{s:06d}").mkdir()
    assert "checkpoints/ (4: step_000050, ..., step_000250)" in outputs_text(tmp_path)


@pytest.mark.slow
def test_log_file_of_a_run_is_plain_lines(tmp_path):
    """A run whose output goes to a file (SLURM, nohup): no progress bar (it made 12 KB lines), one line per
    train.log_every steps, a line when each evaluation starts and ends with its figures, and a last line naming
    the output directory and what is in it (after W&B's own footer)."""
    out, log = tmp_path / "out", tmp_path / "run.log"
    with open(log, "w", encoding="utf-8") as fh:  # a file: not a terminal
        proc = subprocess.run([sys.executable, "-m", "scale.cli", "--config", "tiny_cpu", f"output_dir={out}",
                               f"data.path={ROOT / 'configs' / 'data' / 'tiny_reviews.jsonl'}", "log.trackers=[wandb]",
                               "train.save_every=6"],
                              cwd=tmp_path, stdout=fh, stderr=subprocess.STDOUT, timeout=600,
                              env={**{k: v for k, v in os.environ.items() if k != "SCALE_PROGRESS"},
                                   "PYTHONPATH": str(ROOT), "WANDB_MODE": "offline"})
    text = log.read_text(encoding="utf-8")
    assert proc.returncode == 0, text[-3000:]
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 300 and "\r" not in text, max(lines, key=len)
    assert "optimizer steps:" not in text  # the tqdm bar's description
    steps = [line.split("INFO scale.training.metrics: ")[1] for line in lines
             if "INFO scale.training.metrics: step " in line]
    assert [s.split()[1] for s in steps] == ["2/12", "4/12", "6/12", "8/12", "10/12", "12/12"]
    assert all(" loss " in s and " lr " in s and " tok/s " in s and " mfu " in s and " eta " in s for s in steps)
    for step in (0, 6, 12):  # tiny_cpu evaluates every 6 steps: a line before and one with the figures after
        assert sum(f"eval step {step}: evaluating 32 held-out rows + 4 generated answers" in line
                   for line in lines) == 1
        done = [line for line in lines if f"eval step {step} (" in line]
        assert len(done) == 1 and " loss " in done[0] and " accuracy " in done[0], done
    assert lines[-1].split(" INFO scale.train: ")[1] == (
        f"done: {out}: adapter/, checkpoints/ (2: step_000006, step_000012), config.yaml, metrics.jsonl, "
        f"samples.jsonl, wandb/, wandb_run.json")
    assert text.index("wandb: Run summary:") < text.index(lines[-1])


def test_mode_plan_lines_stay_within_a_log_line():
    """The sequence-parallel DeepSpeed plan (311 characters as one line) and the CPU QLoRA plan with its bf16 paths
    (329): split where a line would pass 300 characters, every note kept, in order."""
    from scale.training.startup import mode_plan_lines

    sp = ["sequence parallel: 2 ranks per row (DeepSpeed Ulysses, sdpa attention), 1 data-parallel",
          "checkpointing use_reentrant=False", "checkpoints: DeepSpeed's files, frozen base excluded"]
    lines = mode_plan_lines(sp, {"float32/frozen": 3227968, "float32/trainable": 34816}, [])
    assert lines == ["mode plan: sequence parallel: 2 ranks per row (DeepSpeed Ulysses, sdpa attention), 1 "
                     "data-parallel; checkpointing use_reentrant=False; checkpoints: DeepSpeed's files, frozen base "
                     "excluded", "parameter dtypes: {'float32/frozen': 3227968, 'float32/trainable': 34816}"]
    paths = ["attention_fp32_short", "adapter_inputs_cast_once", "adapter_sum_in_addmm", "head_cast_cached",
             "dequantize_to_compute_dtype"]
    lines = mode_plan_lines(["4-bit base on cpu, storage uint8"],
                            {"float32/frozen": 28346688, "uint8/frozen": 53084160, "float32/trainable": 4884480}, paths)
    assert lines == ["mode plan: 4-bit base on cpu, storage uint8",
                     "parameter dtypes: {'float32/frozen': 28346688, 'uint8/frozen': 53084160, 'float32/trainable': "
                     "4884480}; bf16 paths: " + ", ".join(paths)]
    prefix = "2026-12-02 14:00:58,690 WARNING scale.training.startup: [RANK 0] "  # the longest level name
    many = sp + [f"WARNING: train.sequence_parallel_size=2 does not divide the 3 processes of a node: some rows' ranks "
                 f"sit on two nodes and every attention call crosses the network", "4-bit base on cpu, storage uint8"]
    lines = mode_plan_lines(many, {"float32/frozen": 1}, paths)
    assert max(len(prefix + line) for line in lines) <= 300 and len(lines) == 3
    assert [line.startswith("mode plan: ") for line in lines] == [True, True, False]
    assert "; ".join(line.removeprefix("mode plan: ") for line in lines[:2]) == "; ".join(many)


def test_packing_start_up_lines_count_the_bins_the_loop_trains(tmp_path, caplog):
    """data.packing on the tiny chats: the start-up lines give the bins the rows went into, the steps of an epoch
    (ceil(bins / G), the run's length with train.num_epochs=1) and the tokens of a step from the bins: they match the
    loader's bins and the tokens the loop counted (train/tokens_per_s / train/steps_per_s per logged step)."""
    import logging
    import math

    from scale.train import fit
    from scale.training.job import setup
    from scale.training.metrics import read_jsonl
    from tests.conftest import log_file_lines, tiny_cfg

    out = tmp_path / "out"
    cfg = tiny_cfg(out, f"data.path={ROOT / 'configs' / 'data' / 'tiny_chats.jsonl'}", "data.chat_template=chatml",
                   "data.packing=true", "data.max_length=160", "data.eval_size=4", "data.max_train_examples=20",
                   "train.max_steps=null",
                   "train.num_epochs=1", "train.micro_batch_size=2", "train.gradient_accumulation_steps=2",
                   "train.log_every=1", "train.eval_every=0", "eval.generate_samples=0", "log.peak_flops=false",
                   "log.trackers=[]", "train.save_every=0", "model.gradient_checkpointing=false",
                   "train.mixed_precision=no")
    with caplog.at_level(logging.INFO):
        job = setup(cfg)
        bins = job.train_dl.dataset  # the packed rows the loader deals in (scale.data.order.PackedRows)
        tokens = [sum(len(e.input_ids) for e in bins[i]) for i in range(len(bins))]
        rows, G = sum(len(b) for b in bins.bins), 4
        fit(job)
    steps = math.ceil(len(bins) / G)
    assert rows == 20 and len(bins) < rows and job.max_steps == steps > 2
    packing = next(m for m in caplog.messages if "packing: " in m)
    assert packing == (f"[RANK 0] packing: 20 train rows into {len(bins)} bins of up to data.max_length=160 tokens "
                       f"({rows / len(bins):.2f} rows/bin, {sum(tokens) / (160 * len(bins)):.0%} full); an epoch is "
                       f"ceil({len(bins)} bins / global_batch_size 4) = {steps} optimizer step(s)")
    per_step = next(m for m in caplog.messages if "per step: " in m)
    assert f"per step: tokens~{G * sum(tokens) / len(bins):.0f} (4 bins x mean {sum(tokens) / len(bins):.1f} " \
           f"tokens, {rows / len(bins):.2f} rows/bin), tail tokens~" in per_step
    logged = [r for r in read_jsonl(out / "metrics.jsonl") if "train/tokens_per_s" in r]
    assert [r["step"] for r in logged] == list(range(1, steps + 1))  # one epoch: ceil(bins / G) steps
    seen = [r["train/tokens_per_s"] / r["train/steps_per_s"] for r in logged]  # tokens of each step
    assert math.isclose(sum(seen), sum(tokens), rel_tol=1e-9)  # every bin's tokens, once
    assert math.isclose(seen[0], G * sum(tokens) / len(bins), rel_tol=0.25)  # a full step, near the line's mean
    assert max(len(line) for line in log_file_lines(caplog.records)) <= 300
