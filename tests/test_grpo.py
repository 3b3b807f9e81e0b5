"""GRPO (``loss.objective: grpo``): the advantages and each loss type against the formulas computed by hand in
float64, the step's loss and gradient the same whatever the split into micro-batches and ranks, and TRL 1.16's
``GRPOTrainer`` run step by step on the same prompts (its own tokenization and ours), the same fixed completions and
the same reward functions: loss, gradient norm, rewards, advantages, KL, entropy and clip fractions per step.
"""

from __future__ import annotations

import math

import pytest
import torch

from scale.config.schema import DataConfig, LoraConfig, LossConfig, ModelConfig
from scale.data.collate import Collator
from scale.data.tasks.base import Builder
from scale.data.tasks.prompts import Prompts
from scale.generation.rollout import Rollouts
from scale.modeling.build import add_lora, load_base
from scale.objectives.grpo import GrpoObjective, group_advantages, loss_numerator, loss_weights, token_terms
from scale.objectives.preference import add_reference_adapter, reference_mode
from scale.objectives.rewards import build_rewards
from scale.training.rollouts import Prompt, RoundPlan, build_round
from tests.conftest import ROOT

EPS64 = torch.finfo(torch.float64).eps
CHATML = ROOT / "configs" / "chat" / "chatml.jinja"


# ---------------------------------------------------------------------------------------------- rewards used here


def exact_answer(completions, answer, **kwargs):
    """A TRL-style reward: 1 when the completion's text (or its message's content) is the answer."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [float(t.strip() == a) for t, a in zip(texts, answer)]


def brevity(completion_ids, **kwargs):
    """A TRL-style reward on tokens: shorter is better."""
    return [1.0 / len(ids) for ids in completion_ids]


# ------------------------------------------------------------------------------------------------- by hand


def _hand_advantages(rewards, G, scale):
    r = [float(x) for x in rewards]
    out = []
    groups = [r[i:i + G] for i in range(0, len(r), G)]
    allm = sum(r) / len(r)
    batch_std = math.sqrt(sum((x - allm) ** 2 for x in r) / (len(r) - 1))
    for g in groups:
        m = sum(g) / G
        s = math.sqrt(sum((x - m) ** 2 for x in g) / (G - 1))
        d = {"group": s + 1e-4, "batch": batch_std + 1e-4, "none": 1.0}[scale]
        out += [(x - m) / d for x in g]
    return out


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_by_hand(scale):
    """Group mean subtracted, divided by the group's (or the round's) Bessel std + 1e-4, or not divided: float64 by
    hand (the same few operations: <= 8 eps64 x |reward|); a group of equal rewards gets 0 and counts as
    zero-std."""
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0, 2.0, 2.0, 2.0, 2.0, -1.0, 3.0, 0.25, 0.0], dtype=torch.float64)
    adv, zero = group_advantages(rewards, 4, scale)
    want = _hand_advantages(rewards.tolist(), 4, scale)
    for a, w in zip(adv.tolist(), want):
        assert abs(a - w) <= 8 * EPS64 * max(1.0, abs(w)) / (1e-4 if scale == "group" else 1.0)
    assert adv[4:8].abs().max() == 0
    assert zero.tolist() == ([False] * 4 + [True] * 4 + [False] * 4 if scale != "batch" else [False] * 12)


def test_advantages_leave_out_unscored_completions():
    """A ``None`` reward (NaN) is left out of its group's mean and std and its advantage is 0, as TRL does."""
    nan = math.nan
    adv, _ = group_advantages(torch.tensor([1.0, nan, 0.0, 2.0]), 4, "group")
    m, s = 1.0, 1.0  # mean and Bessel std of [1, 0, 2]
    assert adv[1] == 0
    assert torch.allclose(adv[[0, 2, 3]], torch.tensor([(1 - m) / (s + 1e-4), (0 - m) / (s + 1e-4),
                                                        (2 - m) / (s + 1e-4)]), rtol=0, atol=1e-6)


def _case(seed=0, B=4, N=5):
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(B, N, generator=g, dtype=torch.float64) * 3
    old = logps + 0.4 * torch.randn(B, N, generator=g, dtype=torch.float64)
    ref = logps + 0.3 * torch.randn(B, N, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.5, -0.7, 0.0, -2.0], dtype=torch.float64)[:B]
    mask = torch.ones(B, N, dtype=torch.float64)
    mask[1, :2] = 0  # right-aligned tails of different lengths
    mask[3, :4] = 0
    return logps, old, ref, adv, mask


def _hand_loss(logps, old, ref, adv, mask, loss_type, level, beta, eps, eps_high, bias, L, round_weight):
    B, N = logps.shape
    per_row, total_tokens = [], 0.0
    for b in range(B):
        toks = [t for t in range(N) if mask[b, t] > 0]
        total_tokens += len(toks)
        seq_w = math.exp(sum(float(logps[b, t] - old[b, t]) for t in toks) / max(len(toks), 1))
        vals = []
        for t in toks:
            w = seq_w if level == "sequence" else math.exp(float(logps[b, t] - old[b, t]))
            a = float(adv[b])
            val = -min(w * a, min(max(w, 1 - eps), 1 + eps_high) * a)
            if beta:
                d = float(ref[b, t] - logps[b, t])
                kl = math.exp(d) - d - 1
                val += beta * kl * (w if bias else 1.0)
            vals.append(val)
        per_row.append(vals)
    if loss_type == "grpo":
        return sum(sum(v) / max(len(v), 1) for v in per_row) / B
    s = sum(sum(v) for v in per_row)
    return s / {"bnpo": total_tokens, "dr_grpo": B * L, "dapo": round_weight}[loss_type]


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "bnpo"])
@pytest.mark.parametrize("level,beta,bias", [("token", 0.0, True), ("token", 0.04, True), ("sequence", 0.04, False)])
def test_loss_types_by_hand(loss_type, level, beta, bias):
    """Each loss type's numerator / weights equals the formula computed token by token in Python floats (float64
    tensors against float64 scalars: a sum of <= 20 terms of size <= ~10: 64 eps64 x that), and its gradient is the
    one autograd takes of the hand formula's tensor form (checked through the ratio's clip: both sides clip)."""
    logps, old, ref, adv, mask = _case()
    logps.requires_grad_(True)
    eps, eps_high, L, rw = 0.2, 0.28, 7, 13.0
    t = token_terms(logps, old, ref, adv, mask, eps, eps_high, level, beta, bias)
    num = loss_numerator(t.loss, mask, loss_type)
    den = loss_weights(loss_type, mask, L, torch.tensor([rw])).double().sum()
    got = float((num / den).detach())
    want = _hand_loss(logps.detach(), old, ref, adv, mask, loss_type, level, beta, eps, eps_high, bias, L, rw)
    assert abs(got - want) <= 64 * EPS64 * 20 * max(1.0, abs(want)), (got, want)


def test_ratio_one_without_old_logps_and_clip_regions():
    """Without stored old logps the ratio is exactly 1 (the trained forward is the round's policy): the loss is
    ``-A`` per token and its gradient ``-A d log pi``; with old logps the clip regions are where TRL counts them."""
    logps, old, _ref, adv, mask = _case()
    t = token_terms(logps, None, None, adv, mask)
    assert torch.equal(t.ratio, torch.ones_like(logps))
    assert torch.equal(t.loss, -adv[:, None].expand_as(logps))
    t = token_terms(logps, old, None, adv, mask, 0.2, 0.28)
    w = torch.exp(logps - old)
    assert torch.equal(t.ratio, w)


# ------------------------------------------------------------------------------------- the tiny model, one round


def _model(tokenizer, seed=3, adapter_seed=7, dtype=torch.float64):
    base = load_base(ModelConfig(name_or_path="tiny-llama"), vocab_size=len(tokenizer), seed=seed).to(dtype)
    torch.manual_seed(seed)
    model = add_lora(base, ModelConfig(name_or_path="tiny-llama", gradient_checkpointing=False),
                     LoraConfig(r=4, dropout=0.0))
    g = torch.Generator().manual_seed(adapter_seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5)
    return model


TEXT_PROMPTS = [{"prompt": "Review: a great film, I loved it. Sentiment:", "answer": "positive"},
                {"prompt": "Review: dull. Sentiment:", "answer": "negative"},
                {"prompt": "Review: the plot went nowhere and the acting was flat. Sentiment:", "answer": "negative"},
                {"prompt": "Review: fun! Sentiment:", "answer": "positive"}]
CHAT_PROMPTS = [{"prompt": [{"role": "system", "content": "Answer in one word."},
                            {"role": "user", "content": p["prompt"]}], "answer": p["answer"]} for p in TEXT_PROMPTS]
# four completions per prompt: right, wrong, right with more words, and one cut short (no EOS: truncated)
COMPLETIONS = {0: [" positive", " negative", " positive, truly", " pos"],
               1: [" negative", " positive", " negative negative", " neg"],
               2: [" negative", " negative", " positive", " meh meh"],
               3: [" positive", " negative", " positive", " po"]}


def _completion_ids(tokenizer, chat):
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>") if chat else tokenizer.eos_token_id
    return {p: [tokenizer(c.strip() if chat else c, add_special_tokens=False)["input_ids"] + ([stop] if g != 3 else [])
                for g, c in enumerate(cs)] for p, cs in COMPLETIONS.items()}


class FixedGenerator:
    """The completions of :data:`COMPLETIONS`, whatever the seeds: what both trainers sample here."""

    name = "fixed"

    def __init__(self, by_prompt_ids, stops):
        self.by_prompt_ids, self.stops = by_prompt_ids, set(stops)

    def generate(self, model, prompts, seeds, synced=False):
        seen, out = {}, []
        for p in prompts:
            k = tuple(p)
            g = seen.get(k, 0)
            seen[k] = g + 1
            out.append(self.by_prompt_ids[k][g])
        return Rollouts(out, None, [c[-1] not in self.stops for c in out], sum(map(len, out)))


def _prompts(tokenizer, rows, chat, first=0):
    task = Prompts()
    cfg = DataConfig(chat_template=str(CHATML) if chat else None, max_length=128)
    task.prepare(tokenizer, cfg, LossConfig())
    b = Builder(tokenizer, cfg)
    return [Prompt(i, i, task.prompt_ids({"prompt": r["prompt"], "row": i}, b), r["prompt"],
                   {"answer": r["answer"]}) for i, r in enumerate(rows, start=first)]


def _round(tokenizer, model, objective, plan, prompts, chat, rewards, round_index=0):
    ids = _completion_ids(tokenizer, chat)
    stops = [tokenizer.eos_token_id, tokenizer.pad_token_id] + (
        [tokenizer.convert_tokens_to_ids("<|im_end|>")] if chat else [])
    gen = FixedGenerator({tuple(p.prompt_ids): ids[p.index] for p in prompts}, stops)

    def policy_logps(batch):
        with torch.no_grad():
            return objective.forward_logps(model, batch)[0]

    def reference_logps(batch):
        with reference_mode(model):
            return objective.forward_logps(model, batch)[0]

    return build_round(prompts, round_index, plan, gen, model, rewards, tokenizer, Collator(tokenizer.pad_token_id),
                       old_logps=policy_logps, ref_logps=reference_logps if objective.beta else None)


# ------------------------------------------------------------------------------------- invariance


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "bnpo"])
def test_loss_and_gradient_do_not_depend_on_the_split(tokenizer, loss_type):
    """One round of 16 completions trained as 1 micro-batch of 16, as 4 of 4 (accumulation) and as 2 "ranks" x 2
    micro-batches of 4 (each rank's numerators divided by the whole window's weights, as the loop does): the same
    loss and gradient (float64 model; different padding and summation order only: fp32_paths_rel's form at eps64).
    Dividing each micro-batch by its own weights instead (TRL's bnpo) gives another loss here: the split matters."""
    from tests.bounds import fp32_paths_rel

    model = _model(tokenizer)
    rewards = build_rewards(["tests.test_grpo:exact_answer", {"fn": "tests.test_grpo:brevity", "weight": 0.5}], 8)
    prompts = _prompts(tokenizer, TEXT_PROMPTS, chat=False)
    objective = GrpoObjective(loss_type=loss_type, beta=0.04, temperature=0.7, max_completion_length=8)
    add_reference_adapter(model)
    results = []
    for mb, S in ((16, 1), (4, 4)):
        plan = RoundPlan(num_generations=4, micro_batch_size=mb, steps_per_generation=S, gradient_accumulation_steps=S,
                         loss_type=loss_type, mask_truncated=True)
        rnd = _round(tokenizer, model, objective, plan, prompts, False, rewards)
        ws = [objective.weights(b) for b in rnd.micro]
        den = sum(float(w.double().sum()) for w in ws)
        model.zero_grad()
        total = 0.0
        for b, w in zip(rnd.micro, ws):
            num, _ = objective.loss_and_metrics(model, b, w)
            (num / den).backward()
            total += float(num) / den
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        results.append((total, grads, rnd, ws))
    (l1, g1, _, _), (l4, g4, rnd4, ws4) = results
    bound = fp32_paths_rel(len(tokenizer), 64, eps=EPS64)
    assert abs(l1 - l4) <= bound * max(1.0, abs(l1))
    assert (g1 - g4).abs().max() <= bound * g1.abs().max()
    if loss_type == "bnpo":  # per micro-batch normalisation (TRL's bnpo) is not the step's token mean
        own = sum(float(objective.loss_and_metrics(model, b, w)[0]) / float(w.sum()) for b, w in zip(rnd4.micro, ws4))
        assert abs(own / 4 - l1) > 1e3 * bound * max(1.0, abs(l1))


# ------------------------------------------------------------------------------------------------- TRL


def _trl_run(tmp_path, tokenizer, monkeypatch, chat, rows, first, **overrides):
    """TRL's GRPOTrainer trained on ``rows`` with :data:`COMPLETIONS` in place of sampling; returns its per-step
    logs, the prompt order it asked for each generation, and the prompt ids it tokenized."""
    trl = pytest.importorskip("trl")
    import trl.trainer.grpo_trainer as grpo_module
    from datasets import Dataset

    ga = overrides["gradient_accumulation_steps"]
    order = RoundPlan(steps_per_generation=overrides.get("steps_per_generation", ga) // ga).order

    def ours(batch):  # TRL's shuffle of a round replaced by the order ours trains it in (RoundPlan.order)
        perm = order(len(next(v for v in batch.values() if v is not None)))
        return {k: v if v is None or (isinstance(v, torch.Tensor) and v.ndim == 0) else
                v[perm] if isinstance(v, torch.Tensor) else [v[i] for i in perm] for k, v in batch.items()}

    monkeypatch.setattr(grpo_module, "shuffle_sequence_dict", ours)
    model = _model(tokenizer)
    settings = {"num_generations": 4, "max_completion_length": 8, "temperature": 0.7, "learning_rate": LR,
                "lr_scheduler_type": "constant", "warmup_steps": 0, "weight_decay": 0.0, "max_grad_norm": 1e9,
                "logging_steps": 1, "report_to": [], "save_strategy": "no", "use_cpu": True, "seed": 0,
                "gradient_checkpointing": False, "bf16": False, "optim": "sgd", "epsilon": EPSILON,
                "epsilon_high": EPSILON_HIGH, "reward_weights": [1.0, 0.5]}
    settings.update(overrides)
    args = trl.GRPOConfig(output_dir=str(tmp_path / "trl"), **settings)
    template = CHATML.read_text() if chat else None
    tok = tokenizer
    if chat:
        import copy

        tok = copy.deepcopy(tokenizer)
        tok.chat_template = template
    trainer = trl.GRPOTrainer(model=model, reward_funcs=[exact_answer, brevity], args=args,
                              train_dataset=Dataset.from_list(rows), processing_class=tok)
    ids = _completion_ids(tokenizer, chat)
    key = {}
    for i, r in enumerate(rows):  # TRL's own tokenization of each prompt
        p = trainer._tokenize_prompts([r["prompt"]])[0][0]
        key[tuple(p)] = first + i
    asked = []

    def fixed(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        seen, out = {}, []
        order = [key[tuple(p)] for p in prompt_ids]
        for k in order:
            g = seen.get(k, 0)
            seen[k] = g + 1
            out.append(ids[k][g])
        asked.append(order[::4])
        return out, None

    trainer._generate_single_turn = fixed
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    return logs, asked, key, trainer


LR = 0.02  # plain SGD (Adam's division by sqrt(v) blows the round-off of near-zero gradients up to lr-sized steps)
# a narrow clip range, so that the small steps (whose round-off stays below 1e-5) move ratios out of it
EPSILON, EPSILON_HIGH = 0.01, 0.015
ONE_BATCH = {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1}  # 2 prompts x 4 completions
TRL_CASES = {
    "grpo, group std, token ratios, kl, 2 iterations, text": ({
        "loss_type": "grpo", "scale_rewards": "group", "beta": 0.04, "num_iterations": 2,
        "mask_truncated_completions": True, **ONE_BATCH, "max_steps": 2}, False),
    "dr_grpo, no std, token ratios, no kl, 1 iteration, chat": ({
        "loss_type": "dr_grpo", "scale_rewards": "none", "beta": 0.0, "num_iterations": 1, **ONE_BATCH,
        "max_steps": 2}, True),
    "dapo, batch std, kl, a round of 4 micro-batches over 2 steps of 2, chat": ({
        "loss_type": "dapo", "scale_rewards": "batch", "beta": 0.04, "num_iterations": 1,
        "mask_truncated_completions": True, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2,
        "steps_per_generation": 4, "max_steps": 2}, True),
    "bnpo, group std, sequence ratios (GSPO), kl without the bias correction, 3 iterations, text": ({
        "loss_type": "bnpo", "scale_rewards": "group", "importance_sampling_level": "sequence", "beta": 0.04,
        "use_bias_correction_kl": False, "num_iterations": 3, **ONE_BATCH, "max_steps": 3}, False),
}


@pytest.mark.parametrize("case", list(TRL_CASES))
def test_equals_trl_grpo_trainer_step_by_step(tmp_path, tokenizer, monkeypatch, case):
    """TRL 1.16's GRPOTrainer and ours on the same prompts (each tool tokenizes them itself: the ids must agree), the
    same fixed completions, the same TRL-signature reward functions, the same float64 model and plain SGD, step by step:
    loss, gradient norm, every reward metric, the advantages, completion lengths and the truncated share, and the
    KL, entropy and clip fractions (TRL's mean of per-micro-batch means, formed from ours). Within the issue's 1e-5
    (relative above 1): the models are float64, but TRL's fused LM head keeps its log-softmax sums in float32
    (trl/kernels/chunked_logprob.py), a rounding of ~1e-7 relative per log-prob, which SGD carries over the steps
    linearly (Adam would not: it scales a near-zero gradient's round-off up to a full lr-sized step). The gradient
    norm, whose float32 round-off is not bounded by 1e-5, within fp32_paths_rel (tests/bounds.py)."""
    from tests.bounds import fp32_paths_rel

    grad_rel = fp32_paths_rel(len(tokenizer), 64)  # TRL's float32 log-softmax against our float64 one
    settings, chat = TRL_CASES[case]
    rows = (CHAT_PROMPTS if chat else TEXT_PROMPTS)[1:3]  # a short and a long prompt: left padding
    logs, asked, trl_key, trainer = _trl_run(tmp_path, tokenizer, monkeypatch, chat, rows, 1, **settings)
    steps = settings["max_steps"]
    assert len(logs) == steps

    prompts = {p.index: p for p in _prompts(tokenizer, rows, chat, first=1)}
    assert {tuple(p.prompt_ids): p.index for p in prompts.values()} == trl_key  # our tokenization is TRL's
    model = _model(tokenizer)
    objective = GrpoObjective(loss_type=settings["loss_type"], epsilon=EPSILON, epsilon_high=EPSILON_HIGH,
                              importance_sampling_level=settings.get("importance_sampling_level", "token"),
                              beta=settings["beta"], kl_bias_correction=settings.get("use_bias_correction_kl", True),
                              temperature=0.7, max_completion_length=8)
    if objective.beta:
        add_reference_adapter(model)  # TRL keeps the starting adapter as "ref" too
    rewards = build_rewards(["tests.test_grpo:exact_answer", {"fn": "tests.test_grpo:brevity", "weight": 0.5}], 8)
    ga, mb = settings["gradient_accumulation_steps"], settings["per_device_train_batch_size"]
    plan = RoundPlan(num_generations=4, micro_batch_size=mb,
                     steps_per_generation=settings.get("steps_per_generation", ga),
                     num_iterations=settings["num_iterations"], gradient_accumulation_steps=ga,
                     scale_rewards=settings.get("scale_rewards", "group"), loss_type=settings["loss_type"],
                     mask_truncated=settings.get("mask_truncated_completions", False))
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    queue, rnd_stats, step = [], None, 0
    trl_adv = torch.tensor(list(trainer._logs["advantages"]), dtype=torch.float64)
    ours_adv = []
    rounds = 0
    while step < steps:
        if not queue:
            order = asked[rounds]
            rnd = _round(tokenizer, model, objective, plan, [prompts[k] for k in order], chat, rewards, rounds)
            rounds += 1
            ours_adv += [r["advantage"] for r in rnd.records]
            queue = list(rnd.micro) * plan.num_iterations
            rnd_stats = rnd.stats
        window, queue = queue[:ga], queue[ga:]
        ws = [objective.weights(b) for b in window]
        den = sum(float(w.double().sum()) for w in ws)
        loss, per_micro = 0.0, []
        for b, w in zip(window, ws):
            num, sums = objective.loss_and_metrics(model, b, w)
            (num / den).backward()
            loss += float(num) / den
            per_micro.append(sums)
        grad_norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in model.parameters() if p.grad is not None))
        opt.step()
        opt.zero_grad()
        got = {"loss": loss, "grad_norm": grad_norm}
        for k in ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
            if k in per_micro[0]:
                got[k] = sum(float(m[k] / m[f"{k}/n"]) for m in per_micro) / len(per_micro)
        want = logs[step]
        if "reward" in want:  # the step that generated logs the round's metrics
            got |= {"reward": rnd_stats["reward/total/mean"], "reward_std": rnd_stats["reward/total/std"],
                    "frac_reward_zero_std": rnd_stats["frac_reward_zero_std"],
                    "completions/mean_length": rnd_stats["completions/mean_length"],
                    "completions/clipped_ratio": rnd_stats["completions/truncated_fraction"],
                    "completions/mean_terminated_length": rnd_stats["completions/mean_terminated_length"]}
            for name in ("exact_answer", "brevity"):
                got[f"rewards/{name}/mean"] = rnd_stats[f"reward/{name}/mean"]
                got[f"rewards/{name}/std"] = rnd_stats[f"reward/{name}/std"]
        compared = [k for k in got if k in want]
        assert len(compared) >= (len(got) if step else 8), (step, sorted(got), sorted(want))
        for k in compared:
            tol = grad_rel * abs(want[k]) if k == "grad_norm" else 1e-5 * max(1.0, abs(want[k]))
            assert abs(got[k] - want[k]) <= tol, (case, step, k, got[k], want[k])
        step += 1
    assert abs(logs[-1]["grad_norm"] - logs[0]["grad_norm"]) > 1e-4  # the policy moved: later steps test it
    last = torch.tensor(ours_adv[-len(trl_adv):], dtype=torch.float64)  # TRL keeps the last round's
    assert torch.allclose(last, trl_adv, rtol=0, atol=1e-5)
