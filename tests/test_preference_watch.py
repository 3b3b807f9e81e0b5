"""What users watch in a preference run: ``samples.jsonl`` (the policy's answer beside chosen and rejected, with the
pair's policy and reference logps and rewards) and ``scale.report``'s reward, accuracy and logps figures.

- A pair's sample against independent computations: the prompt/chosen/rejected split of the tokens, the completion
  equal to a direct greedy ``model.generate``, the logps equal to a float64 log-softmax of each side run alone
  (unpadded), the reference's to the model with its adapter disabled, the rewards to ``beta x`` their difference.
- A tiny DPO run (in process): ``samples.jsonl`` at every evaluation (step 0, ``train.eval_every``, the end) with the
  data file's texts, and its ``metrics.jsonl`` drawn by ``scale.report``: each plotted line holds exactly the values
  the run logged, and the summary's reward columns are its first and last evaluations.
- A preference run's start-up lines count pairs and show one whole pair, chosen then rejected.
"""

from __future__ import annotations

import json

import pytest
import torch
from accelerate import Accelerator

from scale import report as R
from scale.objectives.preference import PreferenceObjective
from scale.training.parts.log import pair_scorer
from scale.training.samples import Generation, generate_samples, pick_samples, start_samples_file, write_samples
from tests.conftest import tiny_cfg
from tests.test_preference import TEXT_PAIRS, _enc, _model, _pairs

EPS64 = torch.finfo(torch.float64).eps
EPS32 = torch.finfo(torch.float32).eps


def side_logp(model: torch.nn.Module, ids: list[int], tail: int) -> float:
    """Summed log-probability of the last ``tail`` tokens of one unpadded row, float64 log-softmax of full logits."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].double()
    logp = torch.log_softmax(logits[len(ids) - tail - 1:len(ids) - 1], -1)
    return float(logp.gather(-1, torch.tensor(ids[len(ids) - tail:])[:, None]).sum())


@pytest.mark.parametrize("objective", ["dpo", "simpo"])
def test_pair_sample_holds_answer_chosen_rejected_logps_and_rewards(tmp_path, tokenizer, objective):
    model = _model(tokenizer, adapter_seed=1).eval()  # float64, random LoRA B: the policy differs from the base
    examples = _pairs(tmp_path, tokenizer, TEXT_PAIRS[:2])
    samples = pick_samples(examples, 5, pairs=True)
    eos = tokenizer.eos_token_id
    assert len(samples) == 2 and [s.row for s in samples] == [0, 1]
    for s, pair in zip(samples, TEXT_PAIRS):
        assert s.prompt_ids == _enc(tokenizer, pair["prompt"])
        assert s.reference_ids == _enc(tokenizer, pair["chosen"]) + [eos]
        assert s.rejected_ids == _enc(tokenizer, pair["rejected"]) + [eos]
    beta = 0.1 if objective == "dpo" else 2.0
    spec = PreferenceObjective(name=objective, beta=beta)
    gen = Generation(samples, tokenizer, [eos], 64, False, tmp_path / "samples.jsonl",
                     score=pair_scorer(spec, tokenizer.pad_token_id, "left", "cpu"))
    acc = Accelerator(cpu=True)
    start_samples_file(gen.path, True, None)
    write_samples(acc, gen.path, 7, generate_samples(acc, model, gen))
    lines = [json.loads(x) for x in gen.path.read_text(encoding="utf-8").splitlines()]
    assert [(r["step"], r["row"]) for r in lines] == [(7, 0), (7, 1)]
    for r, s, pair in zip(lines, samples, TEXT_PAIRS):
        assert set(r) == {"step", "row", "prompt", "completion", "chosen", "rejected", "exact", "logps", "rewards",
                          "tokens"}
        assert (r["prompt"], r["chosen"], r["rejected"]) == (pair["prompt"], pair["chosen"].strip(),
                                                             pair["rejected"].strip())
        budget = max(len(s.reference_ids), len(s.rejected_ids))  # the longer side's tokens
        ids = torch.tensor([s.prompt_ids])
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=budget,
                             do_sample=False, eos_token_id=[eos], pad_token_id=tokenizer.pad_token_id)
        direct = tokenizer.decode(out[0, len(s.prompt_ids):], skip_special_tokens=True).strip()
        assert r["completion"] == direct and r["exact"] == (direct == r["chosen"])
        nc, nr = len(s.reference_ids), len(s.rejected_ids)
        assert r["tokens"] == {"chosen": nc, "rejected": nr}
        policy = {"chosen": side_logp(model, s.prompt_ids + s.reference_ids, nc),
                  "rejected": side_logp(model, s.prompt_ids + s.rejected_ids, nr)}
        # float64 end to end: the padded pair batch and the rows run alone differ by round-off of the same sums
        # (masked attention over < 64 positions, a log-softmax over V = 49,152): 64 eps64 x (1 + |value|) x sqrt(V)
        # bounds it with a wide margin.
        tol = lambda v: 64 * EPS64 * (1 + abs(v)) * 49152 ** 0.5  # noqa: E731
        for side in ("chosen", "rejected"):
            assert abs(r["logps"]["policy"][side] - policy[side]) <= tol(policy[side])
        if objective == "dpo":
            with model.disable_adapter():
                ref = {"chosen": side_logp(model, s.prompt_ids + s.reference_ids, nc),
                       "rejected": side_logp(model, s.prompt_ids + s.rejected_ids, nr)}
            want = {k: beta * (policy[k] - ref[k]) for k in ref}
            for side in ("chosen", "rejected"):
                assert abs(r["logps"]["reference"][side] - ref[side]) <= tol(ref[side])
                assert abs(policy[side] - ref[side]) > 1e-3  # the adapter changes the answer's probability
        else:  # SimPO: reference-free, rewards on per-token logps
            assert "reference" not in r["logps"]
            want = {"chosen": beta * policy["chosen"] / nc, "rejected": beta * policy["rejected"] / nr}
        for side in ("chosen", "rejected"):
            assert abs(r["rewards"][side] - want[side]) <= beta * 2 * tol(policy[side])
        assert r["rewards"]["margin"] == r["rewards"]["chosen"] - r["rewards"]["rejected"]


# ----------------------------------------------------------------------------------------- a tiny DPO run

ROWS = [{"prompt": f"Q: question number {i} about things?", "chosen": " A good answer" + " yes" * (i % 5),
         "rejected": " Bad" + " no" * (i % 7)} for i in range(40)]


@pytest.fixture(scope="module")
def dpo_run(tmp_path_factory):
    """A tiny DPO job: 40 text pairs, 8 held out, 4 steps of 4 pairs at lr 1e-2, evaluations at steps 0, 2, 4, each
    generating 2 held-out pairs; W&B offline."""
    from scale.train import run

    tmp = tmp_path_factory.mktemp("dpo_run")
    (tmp / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS), encoding="utf-8")
    out = tmp / "run"
    run(tiny_cfg(out, f"data.path={tmp / 'pairs.jsonl'}", "data.format=preference", "loss.objective=dpo",
                 "data.eval_size=8", "train.max_steps=4", "train.micro_batch_size=4",
                 "train.gradient_accumulation_steps=1", "train.eval_every=2", "train.log_every=1", "optim.lr=1e-2",
                 "log.peak_flops=false", "eval.generate_samples=2", "eval.max_new_tokens=8", "log.trackers=[wandb]"))
    return out


def test_dpo_run_writes_samples_at_every_evaluation(dpo_run):
    lines = [json.loads(x) for x in (dpo_run / "samples.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [r["step"] for r in lines] == [0, 0, 2, 2, 4, 4]
    rows = [r["row"] for r in lines[:2]]
    assert [r["row"] for r in lines] == rows * 3  # the same held-out pairs at every evaluation
    for r in lines:
        data = ROWS[r["row"]]
        assert (r["prompt"], r["chosen"], r["rejected"]) == (data["prompt"], data["chosen"].strip(),
                                                             data["rejected"].strip())
        assert isinstance(r["completion"], str) and r["exact"] == (r["completion"] == r["chosen"])
        lp, rewards = r["logps"], r["rewards"]
        for side in ("chosen", "rejected"):
            # rewards = beta (policy - reference), beta 0.1, from fp32 logps of ~50 nats: the rounding of the
            # difference of two fp32 values, 2 eps32 x |logp|, scaled by beta
            assert abs(rewards[side] - 0.1 * (lp["policy"][side] - lp["reference"][side])) <= \
                0.1 * 4 * EPS32 * abs(lp["policy"][side])
            assert lp["policy"][side] < 0 and lp["reference"][side] < 0
    step0, end = lines[:2], lines[4:]
    for r in step0:  # a fresh adapter (LoRA B = 0) is the base model: the policy is the reference
        assert r["logps"]["policy"] == r["logps"]["reference"] and r["rewards"]["margin"] == 0.0
    for a, b in zip(step0, end):  # the reference does not move; the policy does
        assert a["logps"]["reference"] == b["logps"]["reference"]
        assert b["logps"]["policy"] != a["logps"]["policy"]
    metrics = [json.loads(x) for x in (dpo_run / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    gen = {r["step"]: r["eval/gen_samples"] for r in metrics if "eval/gen_samples" in r}
    assert gen == {0: 2, 2: 2, 4: 2}


def test_dpo_run_samples_are_a_wandb_table(dpo_run):
    """Each evaluation's pair samples are the W&B table ``eval/samples`` at its step (offline run), row for row
    samples.jsonl's: the answer beside chosen and rejected, and the margin."""
    from tests.wandb_records import read_run

    (run_dir,) = sorted((dpo_run / "wandb").glob("offline-run-*"))
    history = read_run(run_dir)["history"]
    lines = [json.loads(x) for x in (dpo_run / "samples.jsonl").read_text(encoding="utf-8").splitlines()]
    for step in (0, 2, 4):
        table = history[step]
        assert table["eval/samples/_type"] == "table-file" and table["eval/samples/nrows"] == 2
        data = json.loads((run_dir / "files" / table["eval/samples/path"]).read_text())
        assert data["columns"] == ["step", "row", "prompt", "completion", "chosen", "rejected", "exact", "margin"]
        assert data["data"] == [[r["step"], r["row"], r["prompt"], r["completion"], r["chosen"], r["rejected"],
                                 r["exact"], r["rewards"]["margin"]] for r in lines if r["step"] == step]


def test_report_of_a_dpo_run_draws_what_it_logged(dpo_run, tmp_path):
    from matplotlib.figure import Figure

    rows = [json.loads(x) for x in (dpo_run / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    pngs, summary = R.report([dpo_run], tmp_path / "out")
    names = {p.name for p in pngs}
    assert {"rewards.png", "reward_accuracy.png", "logps.png", "loss.png"} <= names
    assert not names & {"accuracy.png", "target_nll.png", "exact_match.png"}  # keys a DPO run does not log
    for png in ("rewards.png", "reward_accuracy.png", "logps.png"):
        assert (tmp_path / "out" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    logged = {key: [(r["step"], r[key]) for r in rows if key in r] for r in rows for key in r}
    for filename, _, panels in R.PREFERENCE_FIGURES:
        for panel in panels:
            ax = Figure().subplots()
            R.draw_panel(ax, panel, {"run": rows}, {})
            drawn = {line.get_label(): list(zip(line.get_xdata(), line.get_ydata())) for line in ax.lines}
            want = {f"run {label}": logged[key] for key, label in panel.keys}
            assert drawn == want, (filename, panel.ylabel)
            markers = [line.get_marker() for line in ax.lines if line.get_label().startswith("run eval")]
            assert len(set(markers)) == len(markers)  # held-out chosen and rejected: told apart by their marker
            evals = [len(logged[key]) for key, _ in panel.keys if key.startswith("eval/")]
            assert evals and all(n == 3 for n in evals)  # steps 0, 2 and 4
            assert all(len(logged[key]) == 4 for key, _ in panel.keys if key.startswith("train/"))  # log_every 1
    head, _, row = summary.splitlines()
    assert head.startswith("| run | steps | final train/loss | eval/loss | eval/rewards/accuracies "
                           "| eval/rewards/margins | median tokens/s |")  # (+ peak memory where logged)
    cells = [c.strip() for c in row.strip("|").split("|")]
    for cell, key in zip(cells[4:6], ("eval/rewards/accuracies", "eval/rewards/margins")):
        assert cell == f"{logged[key][0][1]:.4f} → {logged[key][-1][1]:.4f}"
    assert logged["eval/rewards/margins"][0][1] == 0.0 and logged["eval/rewards/margins"][-1][1] > 0


@pytest.mark.launch
@pytest.mark.parametrize("mode", ["ddp 2x(2,2)", "zero3 2x(2,2)"])
def test_pair_samples_equal_one_process(tmp_path, mode):
    """samples.jsonl of a 2-process DPO run (DDP: rank r generates pairs r, r + 2, ... and the records are gathered;
    ZeRO-3: every rank generates and scores every pair in lock-step on partitioned weights) equals the single
    device's: the same pairs and greedy answers, logps and rewards within 1e-5 (the runs' weights agree to 1e-5,
    tests/test_preference_launch.py)."""
    from tests.launching import ROOT, modes, run_in_process, run_mode

    table = modes()
    job = [f"data.path={ROOT / 'configs' / 'data' / 'tiny_pairs.jsonl'}", "loss.objective=dpo", "loss.beta=0.5",
           "data.eval_size=4", "eval.generate_samples=3", "eval.max_new_tokens=4"]
    run_in_process([*job, *table["single 1x(2,4)"][1]], tmp_path / "one")
    run_mode(table[mode][0], [*job, *table[mode][1]], tmp_path / "two")
    one, two = ([json.loads(x) for x in (tmp_path / d / "samples.jsonl").read_text(encoding="utf-8").splitlines()]
                for d in ("one", "two"))
    assert [r["step"] for r in one] == [0, 0, 0, 6, 6, 6]
    text = ("step", "row", "prompt", "completion", "chosen", "rejected", "exact", "tokens")
    assert [{k: r[k] for k in text} for r in one] == [{k: r[k] for k in text} for r in two]
    for a, b in zip(one, two):
        for who in ("policy", "reference"):
            for side in ("chosen", "rejected"):
                x, y = a["logps"][who][side], b["logps"][who][side]
                assert abs(x - y) <= 1e-5 * max(1.0, abs(x)), (who, side, x, y)
        for k in ("chosen", "rejected", "margin"):
            assert abs(a["rewards"][k] - b["rewards"][k]) <= 1e-5 * max(1.0, abs(a["rewards"][k]))


def test_dpo_start_up_lines_count_pairs_and_show_both_sides(tmp_path, caplog):
    """A preference run's start-up and evaluation lines count pairs (the data's unit), not the 2 rows each becomes,
    and the example shown is one whole pair: the chosen side, then the rejected side of the same prompt."""
    import logging
    import re

    from scale.train import run

    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS), encoding="utf-8")
    with caplog.at_level(logging.INFO):
        run(tiny_cfg(tmp_path / "run", f"data.path={tmp_path / 'pairs.jsonl'}", "data.format=preference",
                     "loss.objective=dpo", "data.eval_size=8", "train.max_steps=1", "train.micro_batch_size=4",
                     "train.gradient_accumulation_steps=1", "log.peak_flops=false", "eval.generate_samples=0"))
    messages = [r.getMessage() for r in caplog.records]
    assert any("; pairs: train=32 eval=8 format=preference;" in m for m in messages)
    assert sum("evaluating 8 held-out pairs" in m for m in messages) == 2  # step 0 and the end
    shown = next(m for m in messages if "a train pair as trained" in m)
    sides = re.findall(r"\((chosen|rejected)\)\n(.*?)\[\[(.*?)\]\]", shown, flags=re.S)
    assert [s[0] for s in sides] == ["chosen", "rejected"]
    (_, prompt_c, tail_c), (_, prompt_r, tail_r) = sides
    assert prompt_c == prompt_r
    row = next(r for r in ROWS if r["prompt"] in prompt_c)
    assert tail_c.startswith(row["chosen"]) and tail_r.startswith(row["rejected"])
