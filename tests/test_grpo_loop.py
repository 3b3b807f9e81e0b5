"""GRPO on the loop, in one process: the prompts format through the data stages and the token cache, the rounds'
prompts for any number of ranks, a tiny run that trains and logs what users watch, and a checkpoint taken in the
middle of a round (by the interval and by SIGTERM) resumed bit for bit: the same completions, rewards and weights.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from scale.config.schema import DataConfig, LossConfig
from scale.config.validation import ConfigError
from scale.data import load_rows, tokenize_rows
from scale.data.read import DataError
from scale.train import run
from scale.training.metrics import read_jsonl
from scale.training.parts.rl import ROUND_DIR, PromptRounds
from tests.conftest import ROOT, reset_accelerate, tiny_cfg

CHATML = ROOT / "configs" / "chat" / "chatml.jinja"


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


# ------------------------------------------------------------------------------------------------ the format


def test_prompts_format_text_messages_and_template(tmp_path, tokenizer):
    """Text prompts tokenize as TRL's GRPOTrainer does (no special tokens added for SmolLM2), conversations through
    the chat template with its generation prompt, data.prompt_template from the columns; every other column rides
    along in Example.extra (kept by the token cache: the split read back from it holds the same)."""
    rows = [{"prompt": "Q: 2+2?", "answer": "4", "meta": {"level": 1}},
            {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q: 3+3?"}],
             "answer": "6"}]
    cfg = DataConfig(chat_template=str(CHATML), max_length=64)
    got = load_rows(cfg, str(_write(tmp_path / "p.jsonl", rows)))
    assert got.task.name == "prompts"
    ex = tokenize_rows(got, tokenizer, cfg, LossConfig(objective="grpo"))
    assert ex[0].input_ids == tokenizer("Q: 2+2?")["input_ids"] and ex[0].tail_len == 0
    assert json.loads(ex[0].extra) == {"prompt": "Q: 2+2?", "columns": {"answer": "4", "meta": {"level": 1}}}
    chat = tokenizer.apply_chat_template(rows[1]["prompt"], chat_template=CHATML.read_text(), tokenize=False,
                                         add_generation_prompt=True)
    assert ex[1].input_ids == tokenizer(chat, add_special_tokens=False)["input_ids"]
    reviews = _write(tmp_path / "r.jsonl", [{"text": "Great fun.", "label": "positive"}])
    cfg = DataConfig(format="prompts", prompt_template="Review: {text}\nSentiment:", max_length=64)
    (e,) = tokenize_rows(load_rows(cfg, str(reviews)), tokenizer, cfg, LossConfig(objective="grpo"))
    assert tokenizer.decode(e.input_ids) == "Review: Great fun.\nSentiment:"
    assert json.loads(e.extra)["columns"] == {"text": "Great fun.", "label": "positive"}


def test_the_token_cache_keeps_the_columns(tmp_path, tokenizer):
    from scale.data.cache import load_splits

    rows = [{"prompt": f"Q: {i}?", "answer": str(i)} for i in range(12)]
    cfg = tiny_cfg(tmp_path / "out", f"data.path={_write(tmp_path / 'p.jsonl', rows)}", "loss.objective=grpo",
                   "rl.rewards=[{fn: exact_match}]", "rl.num_generations=2", "rl.max_completion_length=8",
                   "data.max_length=32", "data.eval_size=2", f"data.cache_dir={tmp_path / 'cache'}")
    built = load_splits(cfg, tokenizer, cfg.data.path)
    again = load_splits(cfg, tokenizer, cfg.data.path)  # a hit: read from the memory-mapped files
    assert [e.extra for e in again.train] == [e.extra for e in built.train]
    assert sorted(json.loads(e.extra)["columns"]["answer"] for e in [*again.train, *again.eval]) == \
        sorted(str(i) for i in range(12))


@pytest.mark.parametrize("rows, words", [
    ([{"prompt": ""}], "empty 'prompt'"),
    ([{"prompt": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]}],
     "the prompt ends with an assistant message"),
    ([{"prompt": [{"role": "robot", "content": "Q"}]}], "message 0 of 'prompt' must be"),
])
def test_bad_prompts_name_the_row(tmp_path, rows, words):
    with pytest.raises(DataError) as e:
        load_rows(DataConfig(format="prompts"), str(_write(tmp_path / "p.jsonl", [{"prompt": "ok"}] + rows)))
    assert "row 1" in str(e.value) and words in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("overrides, words", [
    (["rl.num_generations=3"], "rl.num_generations=3 does not divide the completions of a round"),
    (["rl.num_generations=1", "train.micro_batch_size=1"], "rl.num_generations=1 must be >= 2"),
    (["rl.max_completion_length=64"], ("rl.max_completion_length=64 leaves no room for a prompt in "
                                       "data.max_length=64")),
    (["rl.steps_per_generation=3", "train.gradient_accumulation_steps=2"],
     "rl.steps_per_generation=3 must be a multiple of train.gradient_accumulation_steps=2"),
    (["rl.rewards=[]"], "rl.rewards is empty"),
    (["data.format=classification"], "loss.objective=grpo samples completions of prompts"),
    (["rl.loss_type=ppo"], "rl.loss_type='ppo' is not one of"),
    (["rl.generator=sglang"], "rl.generator='sglang' is not one of"),
    (["rl.temperature=0"], "rl.temperature=0.0 must be > 0"),
    (["data.packing=true"], "data.packing=true does not apply to loss.objective=grpo"),
])
def test_bad_rl_settings_are_one_line(tmp_path, overrides, words):
    """Checked when the config is built, before any data or model loads."""
    with pytest.raises(ConfigError) as e:
        tiny_cfg(tmp_path, "loss.objective=grpo", "data.format=prompts", "rl.rewards=[{fn: exact_match}]",
                 "rl.num_generations=4", "train.micro_batch_size=8", "rl.max_completion_length=8",
                 "data.max_length=64", *overrides)
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_the_start_up_says_what_differs_from_trls_grpo_trainer(tmp_path):
    """A TRL user reads, among the start-up's 'unlike TRL' lines, how prompts are cut, how completions are seeded,
    bnpo's normaliser and the round's order; never the tail-loss line of the other objectives."""
    from scale.config.names import differences_from_trl

    cfg = tiny_cfg(tmp_path, "loss.objective=grpo", "data.format=prompts", "rl.rewards=[{fn: exact_match}]",
                   "rl.num_generations=4", "train.micro_batch_size=8", "rl.max_completion_length=8",
                   "data.max_length=64", "rl.loss_type=bnpo", "train.gradient_accumulation_steps=1",
                   "rl.steps_per_generation=2")
    text = " | ".join(differences_from_trl(cfg, 0))
    for words in (("data.max_length - rl.max_completion_length = 56 tokens loses its oldest tokens (TRL: prompts are "
                   "not cut)"), "a seed of its own", "rl.loss_type=bnpo divides by the optimizer step's tokens",
                  "dealt to its optimizer steps round-robin, the same for any number of ranks (TRL: shuffled first)"):
        assert words in text, words
    assert "trains only its tail" not in text


def test_rounds_hold_the_same_prompts_for_any_number_of_ranks():
    """Global round k is the same prompts, in the same order, whether 1 rank samples 4 or 2 ranks sample 2 each; a
    partial last round is dropped on every rank alike; another epoch is another order."""
    one = PromptRounds(10, 4, 1, 0, seed=3).epoch(0)
    two = [PromptRounds(10, 2, 2, r, seed=3).epoch(0) for r in range(2)]
    assert len(one) == 2 and all(len(x) == 2 for x in two)
    assert [two[0][k] + two[1][k] for k in range(2)] == one
    assert PromptRounds(10, 4, 1, 0, seed=3).epoch(1) != one


# ------------------------------------------------------------------------------------------------ the loop

PROMPTS = [{"prompt": f"Q: {a}+{b}=", "answer": str(a + b)} for a in range(6) for b in range(6)]
# rounds of 2 micro-batches of 8 completions (4 prompts x 4 completions): 2 optimizer steps per round, so the
# round's log-probs are stored and a checkpoint at an odd step cuts a round
JOB = ["data.format=prompts", "loss.objective=grpo", "rl.num_generations=4", "train.micro_batch_size=8",
       "train.gradient_accumulation_steps=1",
       "rl.steps_per_generation=2", "rl.max_completion_length=5", "data.max_length=32", "data.eval_size=4",
       ("rl.rewards=[{fn: exact_match, column: answer, part: first_word}, "
        "{fn: 'tests.rl_rewards:first_token_parity', weight: 0.5}]"),
       "rl.beta=0.04", "rl.epsilon_high=0.28", "train.max_steps=4",
       "train.log_every=1", "train.eval_every=0", "train.save_every=1", "train.save_total_limit=null",
       "optim.lr=5e-2", "optim.warmup_steps=0", "lora.dropout=0.1", "model.gradient_checkpointing=false",
       "eval.generate_samples=2", "log.trackers=[]"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """4 steps (2 rounds of 2 steps), a checkpoint after every step: steps 1 and 3 cut a round."""
    tmp = tmp_path_factory.mktemp("grpo_ref")
    data = _write(tmp / "prompts.jsonl", PROMPTS)
    out = tmp / "run"
    run(tiny_cfg(out, f"data.path={data}", *JOB))
    reset_accelerate()
    return out, data


def _rollouts(out):
    return [r for r in map(json.loads, (out / "samples.jsonl").read_text().splitlines()) if r["split"] == "train"]


def test_a_grpo_run_trains_and_logs_what_users_watch(reference):
    out, _ = reference
    logs = [r for r in read_jsonl(out / "metrics.jsonl") if "train/loss" in r]
    assert [r["step"] for r in logs] == [1, 2, 3, 4]
    for key in ("train/kl", "train/entropy", "train/clip_ratio/region_mean", "train/logprob_mismatch",
                "train/grad_norm"):
        assert all(torch.isfinite(torch.tensor(r[key])) for r in logs), key
    rounds = [r for r in logs if "train/reward/total/mean" in r]
    assert [r["step"] for r in rounds] == [1, 3]  # a round's metrics are logged by the step that sampled it
    for key in ("train/reward/exact_match/mean", "train/reward/first_token_parity/std", "train/advantage/std",
                "train/frac_reward_zero_std", "train/completions/mean_length", "train/completions/truncated_fraction",
                "train/rollout_tokens_per_s", "train/rollout_fraction"):
        assert key in rounds[0], key
    assert max(r["train/grad_norm"] for r in logs) > 0
    assert 0 <= logs[0]["train/logprob_mismatch"] < 1e-3  # the sampler's log-probs are the trainer's (float32)
    assert logs[1]["train/kl"] > 0  # the second step of a round: the policy moved from the reference
    rollouts = _rollouts(out)
    assert {r["step"] for r in rollouts} == {1, 3} and all(len(r) >= 9 for r in rollouts)
    evals = [r for r in read_jsonl(out / "metrics.jsonl") if "eval/reward/total/mean" in r]
    assert [r["step"] for r in evals] == [0, 4] and evals[0]["eval/prompts"] == 4
    ckpts = out / "checkpoints"
    assert (ckpts / "step_000001" / ROUND_DIR / "rank0.pt").is_file()  # cut mid-round: the round is kept
    assert not (ckpts / "step_000002" / ROUND_DIR).exists()  # between rounds: nothing to keep


def _same_run(ref, got, after):
    a, b = load_file(ref / "adapter" / "adapter_model.safetensors"), load_file(got / "adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ref_logs = {r["step"]: r for r in read_jsonl(ref / "metrics.jsonl") if "train/loss" in r}
    got_logs = {r["step"]: r for r in read_jsonl(got / "metrics.jsonl") if "train/loss" in r}
    assert sorted(got_logs) == [s for s in sorted(ref_logs) if s > after]
    for s in got_logs:
        for k in ("train/loss", "train/grad_norm", "train/kl", "train/clip_ratio/region_mean"):
            assert got_logs[s][k] == ref_logs[s][k], (s, k)  # identical, not close
    assert [r for r in _rollouts(got) if r["step"] > after] == [r for r in _rollouts(ref) if r["step"] > after]
    for s, logged in got_logs.items():
        if "train/reward/total/mean" in ref_logs[s]:
            assert {k: v for k, v in logged.items() if k.startswith("train/reward")} == \
                {k: v for k, v in ref_logs[s].items() if k.startswith("train/reward")}


def test_resume_in_the_middle_of_a_round_is_bit_exact(reference, tmp_path):
    """From the checkpoint of step 1 (half of round 1 trained): the round's stored completions, advantages and
    log-probs train step 2, round 2 samples the same completions as the uninterrupted run: the same losses, metrics,
    rollouts and weights, bit for bit."""
    out, data = reference
    run(tiny_cfg(tmp_path, f"data.path={data}", *JOB, f"train.resume_from={out}/checkpoints/step_000001"))
    _same_run(out, tmp_path, after=1)


def test_sigterm_in_the_middle_of_a_round_resumes_bit_exact(reference, tmp_path, monkeypatch):
    """A signal after step 3 (round 2 sampled, its second step not trained) writes a checkpoint that keeps the
    round; the resumed run ends where the uninterrupted one does."""
    from scale.utils.signals import Preempted, Preemption

    out, data = reference
    stop = Preemption()
    import scale.training.windows as windows_module

    votes = {"n": 0}
    real = windows_module.Vote

    def vote(*args, **kwargs):  # the signal arrives during the 3rd window's vote: the 4th (before step 4) sees it
        votes["n"] += bool(kwargs)  # this rank's entry (the gathered table is built positionally)
        if votes["n"] == 3:
            stop.signum = 15
        return real(*args, **kwargs)

    vote._fields = real._fields  # the gathered table is read by field name
    monkeypatch.setattr(windows_module, "Vote", vote)
    cfg = tiny_cfg(tmp_path, f"data.path={data}", *[j for j in JOB if not j.startswith("train.save_every")],
                   "train.save_every=0", "train.save_every_minutes=null")
    with pytest.raises(Preempted):
        run(cfg, stop)
    reset_accelerate()
    assert (tmp_path / "checkpoints" / "step_000003" / ROUND_DIR / "rank0.pt").is_file()
    monkeypatch.undo()
    run(tiny_cfg(tmp_path, f"data.path={data}", *JOB, "train.resume_from=latest"))
    _same_run(out, tmp_path, after=0)
