"""Faults: resume and SIGTERM in 2 processes (gloo, real `accelerate launch`), a killed rank, a non-finite
loss, an unreachable W&B, and secrets kept out of every file a run writes.

Each 2-process launch costs ~20 s on 2 cores.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch
from safetensors.torch import load_file

from scale.train import run
from scale.training.checkpoint import list_checkpoints
from scale.training.commit import NonFiniteError
from scale.training.metrics import read_jsonl
from scale.utils.signals import EXIT_PREEMPTED
from tests.conftest import TINY_DATA, tiny_cfg
from tests.criteria import POISON_TYPE
from tests.launching import ROOT, TINY, accelerate_cmd

# 20 rows over 2 ranks, micro-batch 2, GA 2: per rank 5 micro-batches, windows of 2, 2, 1 -> 3 optimizer
# steps per epoch. K = 4 is the 1st window of the 2nd epoch.
JOB = ["--config", str(TINY), f"data.path={TINY_DATA}", "data.max_train_examples=20", "train.micro_batch_size=2",
       "train.gradient_accumulation_steps=2", "train.max_steps=8", "train.log_every=1", "train.eval_every=4",
       "lora.dropout=0.1", "log.trackers=[]"]
K = 4
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def _launch(out, *extra, wait=True):
    out.mkdir(parents=True, exist_ok=True)
    log = open(out.with_name(out.name + ".log"), "a")
    proc = subprocess.Popen(accelerate_cmd("cpu_ddp.yaml") + JOB + [f"output_dir={out}", *extra], env=ENV, cwd=ROOT,
                            stdout=log, stderr=subprocess.STDOUT)
    if wait:
        proc.wait(timeout=300)
    return proc


def _log(out):
    return out.with_name(out.name + ".log").read_text(errors="replace")


def _adapter(out):
    return load_file(out / "adapter" / "adapter_model.safetensors")


def _losses(out):
    return {r["step"]: r["train/loss"] for r in read_jsonl(out / "metrics.jsonl") if "train/loss" in r}


def _bit_equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp") / "ref"
    proc = _launch(out, f"train.save_every={K}")
    assert proc.returncode == 0, _log(out)[-3000:]
    return out


@pytest.mark.launch
def test_rank_that_cannot_see_the_checkpoint_stops_every_rank(reference, tmp_path):
    """Multi-node without shared storage, simulated: rank 1's files are missing -> a clear error at start."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(reference / "checkpoints" / f"step_{K:06d}", ckpt)
    (ckpt / "random_states_1.pkl").unlink()
    out = tmp_path / "out"
    proc = _launch(out, f"train.resume_from={ckpt}")
    log = _log(out)
    assert proc.returncode != 0
    # Every rank stops with it; rank 0 reports it once (the launcher's summary shows it as the root cause).
    assert log.count(f"CheckpointError: rank 1 on {os.uname().nodename} cannot read checkpoint {ckpt}: missing "
                     f"['{ckpt}/random_states_1.pkl']. Without shared storage set train.save_on_each_node=true") == 1


@pytest.mark.launch
def test_sigterm_checkpoints_and_resume_matches(reference, tmp_path):
    out = tmp_path / "preempted"
    at = random.Random().randint(1, 2 * K - 2)  # signal once this step has been logged
    proc = _launch(out, wait=False)
    deadline = time.time() + 240
    while proc.poll() is None and time.time() < deadline:
        steps = [r["step"] for r in read_jsonl(out / "metrics.jsonl") if "train/loss" in r] \
            if (out / "metrics.jsonl").exists() else []
        if steps and steps[-1] >= at:
            proc.send_signal(signal.SIGTERM)  # to the launcher, which forwards it to both ranks
            break
        time.sleep(0.02)
    proc.wait(timeout=120)
    log = _log(out)
    # The launcher itself dies of the signal (exit 1); both ranks caught it and rank 0 reports the code.
    assert proc.returncode != 0 and log.count("scale: got signal 15") == 2, log[-3000:]
    assert f"to continue; exit code {EXIT_PREEMPTED}" in log, log[-3000:]
    saved = list_checkpoints(out)
    assert len(saved) == 1, log[-3000:]
    state = json.loads((saved[0] / "trainer_state.json").read_text())
    assert state["reason"] == "preempted" and at <= state["step"] < 2 * K
    assert not (out / "adapter").exists()  # no final adapter from an unfinished run
    # Each rank wrote its own RNG state into the checkpoint. (A resume from a fixed mid-epoch checkpoint under DDP,
    # bit-exact, is tests/test_completions_launch.py's; on multi-turn chats tests/test_chat.py's.)
    assert {"random_states_0.pkl", "random_states_1.pkl"} <= {p.name for p in saved[0].iterdir()}
    proc = _launch(out, "train.resume_from=latest")
    assert proc.returncode == 0, _log(out)[-3000:]
    assert _bit_equal(_adapter(reference), _adapter(out))
    ref, got = _losses(reference), _losses(out)
    assert sorted(got) == list(range(1, 2 * K + 1)) and all(got[s] == ref[s] for s in got)


@pytest.mark.launch
def test_resume_before_a_window_one_rank_has_no_batch_for_is_bit_exact(tmp_path):
    """13 items at global batch 4 (2 processes x micro-batch 1 x GA 2): each epoch's last window holds one
    micro-batch, on rank 0; rank 1 repeats its previous batch as a zero-weight stand-in. Resumed from the step-3
    checkpoint, right before that window, on rows and pairs, under DDP and ZeRO-3, all in one launch
    (tests/resume_launch.py): the losses, gradient norms and adapter are the uninterrupted run's, bit for bit. (Rank
    1 raised "a rank got no batch in an epoch": the resumed loader had skipped the batch it repeats.)"""
    from tests.launching import free_port, read_run
    from tests.resume_launch import CASES

    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "configs" / "accelerate" / "cpu_ddp.yaml"), "--main_process_port", str(free_port()),
           "-m", "tests.resume_launch", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env={**ENV, "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false"},
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600, check=False)
    assert proc.returncode == 0, [line for line in proc.stdout.splitlines() if "Error" in line][-5:] or proc.stdout[-3000:]
    for name in CASES:
        case = tmp_path / name.replace(" ", "_")
        saved = json.loads((case / "ref" / "checkpoints" / "step_000003" / "trainer_state.json").read_text())
        assert (saved["epoch"], saved["windows_in_epoch"], saved["mode"]) == (0, 3, name.split()[1])
        ref, got = read_run(case / "ref"), read_run(case / "resumed")
        assert ref["steps"] == [1, 2, 3, 4, 5, 6] and got["steps"] == [4, 5, 6], name
        assert got["loss"] == ref["loss"][3:] and got["grad_norm"] == ref["grad_norm"][3:], name  # identical
        assert _bit_equal(ref["weights"], got["weights"]), name


@pytest.mark.launch
def test_sigterm_exit_code_without_launcher(tmp_path):
    """`scale-train` run directly (one process, as under srun): SIGTERM -> checkpoint, exit code 75."""
    out = tmp_path / "direct"
    cmd = [sys.executable, "-m", "scale.train", *JOB, f"output_dir={out}", "train.max_steps=100000",
           "train.eval_every=0"]
    proc = subprocess.Popen(cmd, env=ENV, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not (
            (out / "metrics.jsonl").exists() and any("train/loss" in r for r in read_jsonl(out / "metrics.jsonl"))):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_PREEMPTED, err[-2000:]
    [ckpt] = list_checkpoints(out)
    assert json.loads((ckpt / "trainer_state.json").read_text())["reason"] == "preempted"


@pytest.mark.launch
def test_sigkill_of_one_rank_fails_the_job_fast(tmp_path):
    out = tmp_path / "killed"
    proc = _launch(out, "train.max_steps=100000", "train.eval_every=0", wait=False)
    deadline = time.time() + 240
    while time.time() < deadline and not (
            (out / "metrics.jsonl").exists() and any("train/loss" in r for r in read_jsonl(out / "metrics.jsonl"))):
        time.sleep(0.1)
    ranks = {int(p.environ().get("RANK", -1)): p for p in psutil.Process(proc.pid).children(recursive=True)
             if "scale.train" in " ".join(p.cmdline())}
    assert set(ranks) == {0, 1}
    t0 = time.monotonic()
    ranks[1].send_signal(signal.SIGKILL)
    code = proc.wait(timeout=120)
    elapsed = time.monotonic() - t0
    print(f"launcher exited {code} {elapsed:.1f} s after SIGKILL of rank 1")
    assert code != 0 and elapsed < 60, (code, elapsed)
    assert not ranks[0].is_running() or ranks[0].status() == psutil.STATUS_ZOMBIE


def _poisoned_data(tmp_path, poison_row):
    rows = [json.loads(line) for line in TINY_DATA.read_text().splitlines()]
    for i, r in enumerate(rows):
        r["kind"] = POISON_TYPE if i == poison_row else 0
    path = tmp_path / "poisoned.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# Train split: 40 rows, micro-batch 4, GA 2 -> 5 windows per epoch; 6 steps cover the whole first epoch.
NONFINITE = ["data.type_column=kind", "loss.criterion=tests.criteria:poison", "loss.criterion_mode=input",
             "data.eval_size=16", "data.max_train_examples=40", "train.micro_batch_size=4", "train.max_steps=6",
             "train.save_every=1",
             "train.log_every=1", "train.save_total_limit=null", "train.eval_every=0"]


def _train_row(tmp_path, tokenizer, position=20):
    """``(data-file row, optimizer step)``: the row the first epoch trains on at ``position`` of its order and
    the step that sees it. The order is accelerate's seedable sampler: ``randperm`` seeded with seed + epoch."""
    from scale.data import build_splits

    cfg = tiny_cfg(tmp_path, *NONFINITE, f"data.path={_poisoned_data(tmp_path, None)}")
    train = build_splits(cfg.data, cfg.loss, tokenizer, cfg.data.path, cfg.train.seed).train
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(cfg.train.seed)).tolist()
    per_window = cfg.train.micro_batch_size * cfg.train.gradient_accumulation_steps
    return train[order[position]].row, position // per_window + 1


@pytest.mark.parametrize("criterion, norm", [("poison", "nan"), ("poison_value", "")])
def test_nonfinite_loss_stops_naming_step_and_row(tmp_path, tokenizer, criterion, norm):
    poison_row, step = _train_row(tmp_path, tokenizer)
    data = _poisoned_data(tmp_path, poison_row)
    with pytest.raises(NonFiniteError) as e:
        run(tiny_cfg(tmp_path, *NONFINITE, f"data.path={data}", f"loss.criterion=tests.criteria:{criterion}"))
    msg = str(e.value)
    norm = norm or msg.split("gradient norm ")[1].split(";")[0]  # finite: whatever it was
    assert norm == "nan" or float(norm) > 0
    rows = json.loads(msg.split("hold data-file rows ")[1].split("]")[0] + "]")
    assert poison_row in rows and len(rows) == 4  # the rows of the micro-batch that holds it
    assert msg == (f"non-finite loss at optimizer step {step} (epoch 0, window {step - 1} of the epoch): gradient "
                   f"norm {norm}; micro-batches with a non-finite loss on this rank hold data-file rows {rows}. "
                   f"Nothing was saved after the last good step; fix the data or lower optim.lr, or set "
                   f"train.on_nonfinite=skip to drop such steps.")
    # Every checkpoint is from before the bad step and holds finite weights.
    saved = list_checkpoints(tmp_path)
    assert [p.name for p in saved] == [f"step_{s:06d}" for s in range(1, step)]
    assert all(torch.isfinite(t).all() for p in saved for t in load_file(p / "adapter_model.safetensors").values())


def test_nonfinite_error_from_the_window_vote_is_the_log_steps_error(tmp_path, tokenizer):
    """Without a log, an evaluation or a checkpoint after the bad step, its verdict comes with the next window's vote
    (scale.training.commit.StepCommit), not from a read of its own: the same error, naming the same step and rows."""
    poison_row, step = _train_row(tmp_path, tokenizer)
    data = _poisoned_data(tmp_path, poison_row)
    messages = []
    for name, every in (("log_steps", ["train.log_every=1"]), ("vote", ["train.log_every=100", "train.save_every=0"])):
        with pytest.raises(NonFiniteError) as e:
            run(tiny_cfg(tmp_path / name, *NONFINITE, f"data.path={data}", *every))
        messages.append(str(e.value))
    assert messages[0] == messages[1] and f"at optimizer step {step} (epoch 0" in messages[0] and step < 6
    assert not list_checkpoints(tmp_path / "vote")


def test_nonfinite_skip_drops_the_step(tmp_path, tokenizer, caplog):
    data = _poisoned_data(tmp_path, _train_row(tmp_path, tokenizer)[0])
    caplog.set_level(logging.WARNING)
    run(tiny_cfg(tmp_path, *NONFINITE, f"data.path={data}", "train.on_nonfinite=skip", "train.save_every=0"))
    logged = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "train/lr" in r]
    skipped = [r.getMessage() for r in caplog.records if "skipping optimizer step" in r.getMessage()]
    # The row is seen once per pass over the train split (steps 1-5 are epoch 0, step 6 starts epoch 1).
    assert 1 <= logged[-1]["train/skipped_steps"] == len(skipped) <= 2
    bad_steps = [int(m.split("skipping optimizer step ")[1].split(" ")[0]) for m in skipped]
    # log_every=1: a skipped step's line has no train/loss (no token was counted); every other one is finite.
    assert [r["step"] for r in logged if "train/loss" not in r] == bad_steps
    assert all(math.isfinite(r["train/loss"]) for r in logged if "train/loss" in r)
    assert all(torch.isfinite(t).all() for t in _adapter(tmp_path).values())


@pytest.mark.launch
def test_nonfinite_skip_under_ddp_decided_alike_by_the_vote_and_at_log_steps(tmp_path, tokenizer):
    """Under DDP a row whose loss is NaN but whose gradients are finite (``poison_value``) sits on one rank: only
    that rank's flag is 1, and a rank that skipped alone would fork the replicas. With ``log_every=8`` every step but
    the last is decided by the next window's vote (the flag rides in its gathered table), with ``log_every=1`` by an
    all-reduce at each log step: the same steps are skipped, the adapters are equal bit for bit and the ranks agree
    (train.check_invariants)."""
    from scale.data import build_splits

    cfg = tiny_cfg(tmp_path, "data.max_train_examples=20")
    row = build_splits(cfg.data, cfg.loss, tokenizer, cfg.data.path, cfg.train.seed).train[0].row
    data = _poisoned_data(tmp_path, row)
    skipped, adapters = {}, {}
    for every in (8, 1):
        out = tmp_path / f"log_every_{every}"
        proc = _launch(out, f"data.path={data}", "data.type_column=kind", "loss.criterion=tests.criteria:poison_value",
                       "loss.criterion_mode=input", "train.on_nonfinite=skip", f"train.log_every={every}",
                       "train.eval_every=0", "train.check_invariants=true", "train.save_every=0")
        assert proc.returncode == 0, _log(out)[-3000:]
        rows = read_jsonl(out / "metrics.jsonl")
        assert [r["check/ranks_agree"] for r in rows if "check/ranks_agree" in r] == [True]
        logged = [r for r in rows if "train/lr" in r]
        assert logged[-1]["step"] == 8
        # The main process names each skipped step (accelerate's logger), whichever rank holds the row.
        named = [int(m.split(" ")[0]) for m in _log(out).split("skipping optimizer step ")[1:]]
        skipped[every] = (logged[-1]["train/skipped_steps"], sorted(set(named)), len(named))
        adapters[every] = _adapter(out)
    # The row is trained once per epoch (3 windows): steps 1-3, 4-6, 7-8 hold it 2 or 3 times (measured: 3, 5, 7).
    count, steps, names = skipped[8]
    assert 2 <= count == len(steps) == names <= 3, skipped
    assert skipped[1] == skipped[8]
    assert adapters[1].keys() == adapters[8].keys()
    assert all(torch.equal(adapters[1][k], adapters[8][k]) for k in adapters[8])


@pytest.mark.slow
def test_unreachable_wandb_costs_one_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_API_KEY", "0123456789abcdef0123456789abcdef01234567")
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "3")
    caplog.set_level(logging.WARNING)
    final = run(tiny_cfg(tmp_path, "log.trackers=[wandb]", "train.max_steps=4"))
    warnings = [r.getMessage() for r in caplog.records if "trackers ['wandb'] failed" in r.getMessage()]
    assert len(warnings) == 1 and "training goes on, metrics stay in" in warnings[0]
    steps = [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl") if "eval/accuracy" in r]
    assert steps == [0, 4] and final["eval/examples"] == 32


@pytest.mark.slow
def test_secrets_stay_out_of_every_file(tmp_path, monkeypatch, capfd):
    key = "fedcba9876543210fedcba9876543210fedcba98"
    token = "hf_" + "Zq" * 16
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_API_KEY", key)
    monkeypatch.setenv("HF_TOKEN", token)
    run(tiny_cfg(tmp_path, "log.trackers=[wandb]", "train.max_steps=2", f"log.run_name=run-{token}",
                 "train.save_every=2"))
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.suffix == ".wandb" for p in files)  # the offline W&B run is among the files searched
    for p in files:
        raw = p.read_bytes()
        assert key.encode() not in raw and token.encode() not in raw, p
    assert "run-<redacted>" in (tmp_path / "config.yaml").read_text()
    out, err = capfd.readouterr()
    assert key not in out + err and token not in out + err
