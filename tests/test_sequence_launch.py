"""Sequence parallelism on 2 CPU processes (gloo) through the real ``accelerate launch``: DeepSpeed Ulysses, ZeRO-2,
every row shared by both ranks, against one device in this process.

The job (tests/launching.py ``LATE_TAILS``) makes every row exactly 16 tokens, so every tail prediction lies on the
second rank's shard: the first rank trains on an exact zero in every micro-batch. A gradient scale that averaged
the two ranks (or summed them twice) moves every gradient norm by 2x, and an evaluation that let a rank attend
within its own shard only (the eval-mode path accelerate registers, ``disable_in_eval=True``) moves the eval loss:
either fails here. Two launches (~20 s each); the full rows (ZeRO-2/3 on the completions, chats and late-tail jobs)
are ``python benchmarks/parity.py --modes ulysses``.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.launching import CHECKED, LATE_TAILS, assert_invariants, modes, rel_dev, run_in_process, run_mode, weight_dev

TOL = 1e-5
MODE = "ulysses sp2 zero2 2x(4,2)"


def _evals(out) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k.startswith("eval/") and isinstance(v, (int, float))}
            for r in rows if "eval/loss" in r]


@pytest.mark.launch
def test_every_tail_on_one_shard_matches_one_device_and_resumes_bit_exact(tmp_path):
    from scale.config.load import load_config
    from scale.data import build_splits
    from scale.data.sequence import shard_rows
    from scale.modeling.build import load_tokenizer
    from tests.launching import JOB, TINY

    # The premise: every train and eval row is 16 tokens and its tail predictions sit on shard 1 of 2.
    cfg = load_config(TINY, [*JOB, *LATE_TAILS])
    splits = build_splits(cfg.data, cfg.loss, load_tokenizer(cfg.model), cfg.data.path, cfg.train.seed)
    rows = [[e] for e in list(splits.train) + list(splits.eval)]
    assert {len(r[0].input_ids) for r in rows} == {16}
    assert shard_rows(rows, 0, 2, 0)["tail_mask"].sum() == 0 and shard_rows(rows, 1, 2, 0)["tail_mask"].sum() == 2 * len(rows)

    extra = [*LATE_TAILS, "train.save_every=3", *CHECKED]
    one = run_in_process([*extra, "train.micro_batch_size=8", "train.gradient_accumulation_steps=1"], tmp_path / "one")
    cmds, overrides = modes()[MODE]
    got = run_mode(cmds, [*extra, *overrides], tmp_path / "sp")
    assert got["steps"] == one["steps"] == [1, 2, 3, 4, 5, 6]
    assert rel_dev(one["loss"], got["loss"]) < TOL
    assert rel_dev(one["grad_norm"], got["grad_norm"]) < TOL    # a 2x gradient scale would be 1.0 here
    assert weight_dev(one["weights"], got["weights"]) < TOL
    assert_invariants(got["checks"], MODE, step=6)  # base unchanged, both ranks hold the same LoRA weights
    # Evaluation at steps 0 and 6 on sharded rows: one device's figures; each eval row counted once.
    for a, b in zip(_evals(tmp_path / "one"), _evals(tmp_path / "sp"), strict=True):
        assert a.keys() == b.keys() and a["eval/examples"] == b["eval/examples"] == 32
        assert a["eval/accuracy"] == b["eval/accuracy"]
        for k in ("eval/loss", "eval/target_nll"):
            assert abs(a[k] / b[k] - 1) < TOL, (k, a[k], b[k])
    assert len(one["samples"]) == 8 and got["samples"] == one["samples"]  # generation unsharded: the same text
    head = (tmp_path / "sp" / "config.yaml").read_text().splitlines()[0]
    assert "2 process(es) = data_parallel_size 1 x sequence_parallel_size 2; global_batch_size 8" in head

    # Resume from the step-3 checkpoint (DeepSpeed's files, every rank's RNG): steps 4-6 and the adapter bit-identical.
    ckpt = tmp_path / "sp" / "checkpoints" / "step_000003"
    again = run_mode(cmds, [*extra, *overrides, f"train.resume_from={ckpt}"], tmp_path / "resumed")
    assert again["steps"] == [4, 5, 6] and again["loss"] == got["loss"][3:]
    assert again["weights"].keys() == got["weights"].keys()
    assert all(torch.equal(again["weights"][k], got["weights"][k]) for k in got["weights"])


@pytest.mark.launch
def test_eager_attention_under_sequence_parallelism_is_one_line_through_the_launcher(tmp_path):
    """`train.sequence_parallel_size=2 model.attn_implementation=eager` on 2 processes: refused before the
    Accelerator is built (accelerate's own check there raised a ValueError traceback on every rank). Through
    `scale-train --accelerate-config cpu_zero2` (accelerate launch underneath): exit 2, exactly one error line, the
    last, no traceback; through plain `accelerate launch` (torch elastic exits 1): the message only as the summary's
    root cause, no rank's traceback."""
    import os
    import subprocess
    import sys

    from tests.launching import JOB, ROOT, TINY, accelerate_cmd
    from tests.test_sequence import EAGER_UNDER_SP

    job = ["--config", str(TINY), *JOB, "train.sequence_parallel_size=2", "model.attn_implementation=eager"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "offline"}
    line = f"scale-train: error: ConfigError: {EAGER_UNDER_SP}"
    ours = subprocess.run([sys.executable, "-m", "scale.cli", "--accelerate-config", "cpu_zero2", *job,
                           f"output_dir={tmp_path / 'a'}"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600, env=env)
    lines = [x for x in (ours.stdout + ours.stderr).splitlines() if x.strip()]
    assert ours.returncode == 2, lines[-20:]
    assert [x for x in lines if "error:" in x.lower()] == [line] and lines[-1] == line
    assert "Traceback" not in ours.stdout + ours.stderr and not (tmp_path / "a").exists()

    plain = subprocess.run([*accelerate_cmd("cpu_zero2.yaml"), *job, f"output_dir={tmp_path / 'b'}"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=600, env=env)
    text = plain.stdout + plain.stderr
    assert plain.returncode == 1 and "ValueError" not in text  # torch elastic turns the job's 2 into 1
    assert [x for x in text.splitlines() if EAGER_UNDER_SP in x] == [f"  traceback : {line}"]
