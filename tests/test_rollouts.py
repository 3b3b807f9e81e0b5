"""Rollouts (scale/generation/rollout.py, scale/training/rollouts.py): the seeded sampler draws from the tempered,
filtered softmax (a frequency test with a binomial bound), a completion depends on its own seed only (not on what
shares its batch), the sampler's log-probs are the trainer's forward's, and one round's micro-batches carry what the
GRPO objective reads.
"""

from __future__ import annotations

import math

import pytest
import torch

from scale.data.collate import Collator
from scale.generation.rollout import (Rollouts, Sampling, SeededSampler, TransformersGenerator, check_generator,
                                      completion_seed, cut_at_stop)
from scale.objectives.grpo import GrpoObjective
from scale.objectives.rewards import RewardError, build_rewards
from scale.training.rollouts import Prompt, RoundPlan, build_round, restore_round
from tests.test_grpo import _model

EPS64 = torch.finfo(torch.float64).eps


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (0, 0.8), (3, 1.0)])
def test_seeded_sampler_draws_the_filtered_softmax(top_k, top_p):
    """4000 rows, each its own seed, one step over fixed logits: each token's frequency is within 5 binomial standard
    deviations of its probability under softmax(z / T) after top-k/top-p (a false alarm: < 1e-5 per token); tokens
    the filter removes are never drawn; the recorded log-prob is the unfiltered tempered one."""
    z = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    T, n = 0.7, 4000
    sampler = SeededSampler([completion_seed(0, 0, i, 0) for i in range(n)],
                            Sampling(temperature=T, top_k=top_k, top_p=top_p), torch.device("cpu"))
    out = sampler(torch.zeros((n, 1), dtype=torch.long), z.expand(n, -1).clone())
    tokens = out.argmax(-1)
    assert torch.isinf(out).sum() == n * 5  # one finite score per row: generate's argmax is the sample
    p = torch.softmax(z[0].double() / T, -1)
    q = p.clone()
    if top_k:
        q[q.argsort(descending=True)[top_k:]] = 0
    if top_p < 1:
        order = q.argsort()
        keep = q[order].cumsum(0) > 1 - top_p  # transformers' TopPLogitsWarper keeps the smallest top set
        q[order[~keep]] = 0
    q = q / q.sum()
    counts = torch.bincount(tokens, minlength=6).double()
    for v in range(6):
        sd = math.sqrt(n * q[v] * (1 - q[v]))
        assert abs(counts[v] - n * q[v]) <= 5 * sd + 1e-9, (v, counts.tolist(), (n * q).tolist())
    want = torch.log(p)[tokens]
    assert (sampler.logps[0].double() - want).abs().max() <= 8 * torch.finfo(torch.float32).eps * 4


def test_cut_at_stop():
    assert cut_at_stop([5, 6, 2, 0, 0], {2}) == ([5, 6, 2], False)
    assert cut_at_stop([5, 6, 7], {2}) == ([5, 6, 7], True)


@pytest.fixture(scope="module")
def tiny(tokenizer):
    return _model(tokenizer, dtype=torch.float64).eval()


def _prompts(tokenizer, texts):
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def test_a_completion_depends_on_its_seed_only(tokenizer, tiny):
    """The same prompt and seed give the same completion alone, beside other prompts of other lengths (left padding)
    and at another place in the batch; another seed gives another one."""
    gen = TransformersGenerator(Sampling(temperature=1.0, max_completion_length=12, stop_ids=(tokenizer.eos_token_id,),
                                         pad_id=tokenizer.pad_token_id))
    a, b, c = _prompts(tokenizer, ["Review: fine.", "Review: the longest review of all, by far. Sentiment:", "Hi"])
    alone = gen.generate(tiny, [a], [11])
    mixed = gen.generate(tiny, [b, a, c], [5, 11, 7])
    assert mixed.completion_ids[1] == alone.completion_ids[0]
    torch.testing.assert_close(mixed.sampler_logps[1], alone.sampler_logps[0], rtol=0, atol=1e-12)
    again = gen.generate(tiny, [c, b], [7, 5])
    assert again.completion_ids == [mixed.completion_ids[2], mixed.completion_ids[0]]
    other = gen.generate(tiny, [a, a, a], [12, 13, 14])
    assert any(o != alone.completion_ids[0] for o in other.completion_ids)
    assert all(len(x) == 12 and t for x, t in zip(other.completion_ids, other.truncated) if tokenizer.eos_token_id
               not in x)


def test_sampler_logps_are_the_trainers(tokenizer, tiny):
    """The log-probs recorded while sampling equal a training forward's of the same tokens under logits / T
    (train/logprob_mismatch ~ 0 for the in-process generator): generate hands its logits processors float32
    scores, so the sampler's log-softmax is float32 over the vocabulary (tests/bounds.rel_bound(V) x |logp|) while
    the trainer's is float64. A wrong temperature is off by ~1 nat."""
    from tests.bounds import rel_bound

    T = 0.7
    gen = TransformersGenerator(Sampling(temperature=T, max_completion_length=6, stop_ids=(tokenizer.eos_token_id,),
                                         pad_id=tokenizer.pad_token_id))
    prompts = _prompts(tokenizer, ["Review: fine.", "Review: it was a long film. Sentiment:"])
    out = gen.generate(tiny, prompts, [1, 2])
    from scale.data.tasks.base import Example

    batch = Collator(tokenizer.pad_token_id)([Example(p + c, len(c)) for p, c in zip(prompts, out.completion_ids)])
    with torch.no_grad():
        logps, _ = GrpoObjective(temperature=T).forward_logps(tiny, batch)
    bound = rel_bound(len(tokenizer))
    for b, s in enumerate(out.sampler_logps):
        n = len(s)
        assert (logps[b, -n:] - s.double()).abs().max() <= bound * max(1.0, float(s.abs().max()))


def _round(tokenizer, tiny, rewards, plan, gather=lambda t: t, rank=0):
    gen = TransformersGenerator(Sampling(temperature=1.0, max_completion_length=5, stop_ids=(tokenizer.eos_token_id,),
                                         pad_id=tokenizer.pad_token_id))
    texts = ["Review: fine. Sentiment:", "Review: bad. Sentiment:"]
    prompts = [Prompt(i, 100 + i, ids, texts[i], {"answer": "positive"})
               for i, ids in enumerate(_prompts(tokenizer, texts))][:plan.prompts]
    objective = GrpoObjective(loss_type=plan.loss_type)
    return build_round(prompts, 3, plan, gen, tiny, rewards, tokenizer, Collator(tokenizer.pad_token_id),
                       gather=gather, rank=rank, old_logps=lambda b: objective.forward_logps(tiny, b)[0])


def test_a_round_holds_what_the_objective_reads(tokenizer, tiny):
    """Two prompts x 4 completions in 2 micro-batches of 4: the rows are prompt + completion with the completion as
    the tail, the truncated ones masked (mask_truncated), old log-probs stored for a round of 2 steps, dapo's
    round weight the round's kept tokens / (2 micro-batches x 1 rank), and the records name each row."""
    rewards = build_rewards([{"fn": "length", "cache": 2}], 5)
    plan = RoundPlan(num_generations=4, micro_batch_size=4, steps_per_generation=2, gradient_accumulation_steps=1,
                     loss_type="dapo", mask_truncated=True)
    rnd = _round(tokenizer, tiny, rewards, plan)
    assert len(rnd.micro) == 2 and len(rnd.records) == 8
    kept = 0
    for k, batch in enumerate(rnd.micro):
        for b in range(4):
            rec = rnd.records[4 * k + b]
            n = rec["tokens"]
            assert int(batch["tail_mask"][b].sum()) == n
            assert int(batch["loss_mask"][b].sum()) == (0 if rec["truncated"] else n)
            kept += int(batch["loss_mask"][b].sum())
        assert set(batch) >= {"old_logps", "sampler_logps", "advantages", "round_weight", "loss_mask"}
    assert float(rnd.micro[0]["round_weight"]) == kept / 2
    assert [r["row"] for r in rnd.records] == [100] * 4 + [101] * 4
    assert rnd.stats["completions/truncated_fraction"] == sum(r["truncated"] for r in rnd.records) / 8


def test_a_kept_round_restores_on_another_world_size(tokenizer, tiny):
    """A round a one-rank checkpoint kept (2 micro-batches of 4, 2 iterations: old log-probs stored) restored for 2
    ranks with the same global batch (1 micro-batch of 4 each), and that back for one rank: each rank's micro-batch
    is the one-rank round's micro-batch of the same global position, tensor for tensor (tokens, masks, advantages,
    stored log-probs, dapo's round weight), with its records."""
    rewards = build_rewards([{"fn": "length", "cache": 2}], 5)
    shape = {"num_generations": 4, "micro_batch_size": 4, "num_iterations": 2, "loss_type": "dapo",
             "mask_truncated": True}
    one = RoundPlan(steps_per_generation=2, gradient_accumulation_steps=2, **shape)
    two = RoundPlan(steps_per_generation=1, gradient_accumulation_steps=1, world_size=2, **shape)
    rnd = _round(tokenizer, tiny, rewards, one)
    assert one.needs_old_logps and two.needs_old_logps and "old_logps" in rnd.micro[0]
    collator = Collator(tokenizer.pad_token_id)

    def same(a, b):
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), key

    ranks = [restore_round([rnd.state_dict()], two, r, collator) for r in range(2)]
    for r, part in enumerate(ranks):
        assert len(part.micro) == 1 and part.records == rnd.records[4 * r:4 * r + 4]
        same(part.micro[0], rnd.micro[r])
    back = restore_round([part.state_dict() for part in ranks], one, 0, collator)
    assert len(back.micro) == 2 and back.records == rnd.records
    for a, b in zip(back.micro, rnd.micro):
        same(a, b)


def test_the_steps_of_a_round_train_the_same_completions_on_any_number_of_ranks(tokenizer, tiny):
    """A round of 2 optimizer steps (steps_per_generation 2 x accumulation 1): on one rank (micro-batches of 4) and
    re-sliced for 2 ranks (micro-batches of 2), each step trains the same 4 completions (rows and advantages), every
    other one of the round's (round-robin: RoundPlan.order), so a resume on another world size continues the round
    as it was being trained, and a fresh round on 2 ranks trains what one rank trains step for step; and a round
    whose size is not the run's is refused in one line."""
    rewards = build_rewards([{"fn": "length", "cache": 2}], 5)
    shape = {"num_generations": 4, "steps_per_generation": 2, "gradient_accumulation_steps": 1}
    one, two = RoundPlan(micro_batch_size=4, **shape), RoundPlan(micro_batch_size=2, world_size=2, **shape)
    rnd = _round(tokenizer, tiny, rewards, one)
    collator = Collator(tokenizer.pad_token_id)
    ranks = [restore_round([rnd.state_dict()], two, r, collator) for r in range(2)]

    def rows(*batches):
        return sorted((tuple(b["input_ids"][i][b["attention_mask"][i].bool()].tolist()), float(b["advantages"][i]))
                      for b in batches for i in range(len(b["advantages"])))

    whole = [rows(*[_one(s) for s in rnd.items[k::2]]) for k in range(2)]
    for step in range(2):
        assert rows(rnd.micro[step]) == rows(*[part.micro[step] for part in ranks]) == whole[step]
    with pytest.raises(ValueError, match=r"^the checkpoint's round holds 8 completions; this run's rounds hold 4 on "
                                         r"each of 1 rank\(s\)$"):
        restore_round([rnd.state_dict()], RoundPlan(micro_batch_size=2, **shape), 0, collator)


def _one(s):
    """A one-row micro-batch of a :class:`Sampled` (what :func:`rows` reads)."""
    ids = torch.tensor([s.prompt_ids + s.completion_ids])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "advantages": torch.tensor([s.advantage])}


def test_a_reward_failing_on_another_rank_stops_this_one(tokenizer, tiny):
    """Every rank reaches the round's all-gather; the error flag in the table stops the ranks whose functions ran
    fine too, in one line naming the failing rank (the failing rank names the function and the row)."""
    rewards = build_rewards([{"fn": "length", "cache": 2}], 5)
    plan = RoundPlan(num_generations=4, micro_batch_size=4, steps_per_generation=1, world_size=2)

    def gather(t):  # rank 1's table carries the error flag
        other = t.clone()
        other[:, -1] = 1.0
        return torch.cat([t, other])

    with pytest.raises(RewardError, match="a reward function failed on rank 1"):
        _round(tokenizer, tiny, rewards, plan, gather=gather)


def test_a_generator_that_cannot_run_here_is_refused_in_one_line(monkeypatch):
    """rl.generator=vllm without CUDA, or without the package, names the key and the fix (before the model loads)."""
    import importlib.util

    with pytest.raises(ValueError, match=r"^rl.generator=vllm needs a CUDA device and this run has none; set "
                                         r"rl.generator=transformers"):
        check_generator("vllm", cuda=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None)
    with pytest.raises(ValueError, match=r"^rl.generator=vllm needs the vllm package: pip install 'scale\[vllm\]'"):
        check_generator("vllm", cuda=True)
    check_generator("transformers", cuda=False)


def test_beta_without_a_reference_is_refused_in_one_line():
    """rl.beta > 0 on a model without a LoRA adapter to switch off (no reference to take the KL to)."""
    from scale.config.validation import ConfigError
    from scale.training.parts.rl import rl_reference

    with pytest.raises(ConfigError, match=r"^rl.beta > 0 needs a reference and this model has no LoRA adapter to "
                                          r"switch off; set rl.beta=0$"):
        rl_reference(torch.nn.Linear(2, 2))


def test_rollouts_type():
    r = Rollouts([[1, 2]], None, [False], 2)
    assert r.tokens == 2
