"""One round of rollouts: this rank's prompts -> sampled completions -> rewards -> advantages -> the round's
micro-batches for :class:`scale.objectives.grpo.GrpoObjective`. Plain tensors: the loop hands in its all-gather
and its forwards (:func:`build_round`).

A *round* is ``rl.steps_per_generation`` micro-batches of ``train.micro_batch_size`` completions on every rank,
trained ``rl.num_iterations`` times: ``steps_per_generation x num_iterations / gradient_accumulation_steps``
optimizer steps (TRL's ``generate_every``). Each rank samples ``rl.num_generations`` completions of each of its own
prompts (a prompt's group never spans two ranks), in prompt order; micro-batch ``k`` holds completions
``k x micro_batch_size ...`` (TRL shuffles the round first; the loss of a step does not depend on the order when a
round is one step, the default). Collective: one all-gather per round of a ``[completions, F + 3]`` table (every
function's reward, the completion's trained tokens, its truncation, an error flag), from which every rank computes
the same advantages (``rl.scale_rewards: batch`` needs the round's std), the same ``dapo`` normaliser and the same
metrics.

When a round spans more than one optimizer step, the policy moves while its completions are still trained: their
log-probs under the round's policy (``old_logps``) are computed once, before the first step (TRL 1.16, the same
condition: ``gradient_accumulation_steps % (steps_per_generation x num_iterations) != 0``); otherwise the trained
forward is the round's policy and the ratio is 1. With ``rl.beta`` > 0 the reference's log-probs (``ref_logps``) are
computed once per round too.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor

from scale.data.collate import Collator
from scale.data.tasks.base import Example
from scale.objectives.grpo import group_advantages, nanstd
from scale.objectives.rewards import Reward, RewardCall, RewardError, completion_text, score, total
from scale.generation.rollout import Generator, Rollouts, completion_seed


@dataclass
class Prompt:
    """One prompt of the ``prompts`` format, tokenized.

    Attributes:
        index: its position in the train split (with the round, it seeds its completions).
        row: its data-file row (error messages, ``samples.jsonl``).
        prompt_ids: its tokens as the model reads them (template, generation prompt, BOS).
        prompt: as the file holds it (text, or a list of messages): what reward functions get.
        columns: the row's other columns (reward functions get them by name).
    """

    index: int
    row: int
    prompt_ids: list[int]
    prompt: Any
    columns: dict[str, Any] = field(default_factory=dict)


@dataclass
class RoundPlan:
    """The shape of every round.

    Attributes:
        num_generations: ``rl.num_generations`` (``G``).
        micro_batch_size: completions per micro-batch (``train.micro_batch_size``).
        steps_per_generation: micro-batches per round on each rank (``rl.steps_per_generation``).
        num_iterations: ``rl.num_iterations``.
        gradient_accumulation_steps: ``train.gradient_accumulation_steps``.
        world_size: ranks.
        scale_rewards: ``rl.scale_rewards``.
        loss_type: ``rl.loss_type``.
        mask_truncated: ``rl.mask_truncated_completions``.
        seed: ``train.seed``.
    """

    num_generations: int = 8
    micro_batch_size: int = 8
    steps_per_generation: int = 1
    num_iterations: int = 1
    gradient_accumulation_steps: int = 1
    world_size: int = 1
    scale_rewards: str = "group"
    loss_type: str = "dapo"
    mask_truncated: bool = False
    seed: int = 0

    @property
    def completions(self) -> int:
        """Completions per round on each rank."""
        return self.micro_batch_size * self.steps_per_generation

    @property
    def prompts(self) -> int:
        """Prompts per round on each rank."""
        return self.completions // self.num_generations

    @property
    def micro_batches(self) -> int:
        """Micro-batches a round trains on each rank, iterations included."""
        return self.steps_per_generation * self.num_iterations

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps per round."""
        return self.micro_batches // self.gradient_accumulation_steps

    @property
    def needs_old_logps(self) -> bool:
        """Whether the policy moves while the round trains (more than one optimizer step): the round's log-probs
        are stored before its first step."""
        return self.gradient_accumulation_steps % self.micro_batches != 0


@dataclass
class Round:
    """One round on this rank.

    Attributes:
        index: the round's seed index (the optimizer step it starts at).
        micro: its ``steps_per_generation`` micro-batches (CPU tensors; the loop moves them).
        records: one per completion on this rank: ``row, prompt, completion, rewards {fn: value}, reward,
            advantage, tokens, truncated`` (``samples.jsonl``).
        stats: the round's metrics over every rank (``train/<name>``): reward means and stds per function and
            total, ``frac_reward_zero_std``, the advantages' spread, completion lengths, the truncated fraction.
        tokens: completion tokens sampled on this rank; seconds: time spent sampling on this rank.
    """

    index: int
    micro: list[dict[str, Tensor]]
    records: list[dict[str, Any]]
    stats: dict[str, float]
    tokens: int = 0
    seconds: float = 0.0


def right_aligned(values: list[Tensor], width: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """``[B, width]``: each 1-D ``values[b]`` in the last ``len(values[b])`` columns (a tail's alignment), 0 before."""
    out = torch.zeros((len(values), width), dtype=dtype)
    for b, v in enumerate(values):
        if len(v):
            out[b, width - len(v):] = v.to(dtype)
    return out


def round_stats(per_func: Tensor, rewards: Tensor, advantages: Tensor, std_zero: Tensor, lengths: Tensor,
                truncated: Tensor, names: list[str]) -> dict[str, float]:
    """The round's metrics (``train/<name>``, TRL's meanings) from every rank's completions: ``reward/<fn>/mean``,
    ``reward/<fn>/std`` (NaN-aware: a ``None`` is not counted), ``reward/total/mean``, ``reward/total/std``,
    ``frac_reward_zero_std``, ``advantage/std``, ``advantage/min``, ``advantage/max``,
    ``completions/mean_length``, ``completions/min_length``, ``completions/max_length``,
    ``completions/truncated_fraction`` (TRL's ``clipped_ratio``) and ``completions/mean_terminated_length``."""
    out: dict[str, float] = {}
    for f, name in enumerate(names):
        out[f"reward/{name}/mean"] = float(torch.nanmean(per_func[:, f]))
        out[f"reward/{name}/std"] = float(nanstd(per_func[:, f]))
    out["reward/total/mean"] = float(torch.nanmean(rewards))
    out["reward/total/std"] = float(nanstd(rewards))
    out["frac_reward_zero_std"] = float(std_zero.float().mean())
    out["advantage/std"] = float(advantages.std()) if advantages.numel() > 1 else 0.0
    out["advantage/min"], out["advantage/max"] = float(advantages.min()), float(advantages.max())
    lengths = lengths.double()
    out["completions/mean_length"] = float(lengths.mean())
    out["completions/min_length"], out["completions/max_length"] = float(lengths.min()), float(lengths.max())
    out["completions/truncated_fraction"] = float(truncated.double().mean())
    done = lengths[~truncated.bool()]
    out["completions/mean_terminated_length"] = float(done.mean()) if done.numel() else 0.0
    return out


def _describe_failure(e: BaseException) -> str:
    return str(e) if isinstance(e, RewardError) else f"{type(e).__name__}: {e}"


def build_round(prompts: list[Prompt], round_index: int, plan: RoundPlan, generator: Generator,
                gen_model: torch.nn.Module, rewards: list[Reward], tokenizer: Any, collator: Collator,
                gather: Callable[[Tensor], Tensor] = lambda t: t, rank: int = 0,
                old_logps: Callable[[dict[str, Tensor]], Tensor] | None = None,
                ref_logps: Callable[[dict[str, Tensor]], Tensor] | None = None,
                synced: bool = False, trainer_state: Any = None) -> Round:
    """Sample, score and batch one round on this rank (module docstring).

    Args:
        prompts: this rank's ``plan.prompts`` prompts of the round.
        round_index: the round's seed index (the optimizer step it starts at).
        plan: the round's shape.
        generator: what samples (:mod:`scale.generation.rollout`).
        gen_model: the policy to sample with (unwrapped).
        rewards: ``rl.rewards``, built.
        tokenizer: decodes completions (special tokens dropped) and prompts.
        collator: pads a micro-batch's rows (``data.padding_side``).
        gather: the all-gather over ranks of a ``[n, k]`` tensor (same ``n`` on every rank) -> ``[world x n, k]``
            in rank order; collective.
        rank: this rank's index.
        old_logps: ``batch -> [B, N]`` the policy's tail logps under ``no_grad`` (only when
            ``plan.needs_old_logps``).
        ref_logps: ``batch -> [B, N]`` the reference's (``rl.beta`` > 0).
        synced: the weights are partitioned (ZeRO-3, FSDP): generation runs in lock-step.
        trainer_state: what reward functions get as ``trainer_state`` (``global_step``, ``epoch``).

    Returns:
        The :class:`Round`.

    Raises:
        RewardError: a reward function failed on some rank (every rank raises; the failing rank names the function
            and the row, the others say which rank failed).
    """
    G = plan.num_generations
    if len(prompts) * G != plan.completions:
        raise ValueError(f"a round needs {plan.prompts} prompts on each rank, got {len(prompts)}")
    started = time.perf_counter()
    asked = [p for p in prompts for _ in range(G)]
    seeds = [completion_seed(plan.seed, round_index, p.index, g) for p in prompts for g in range(G)]
    out: Rollouts = generator.generate(gen_model, [p.prompt_ids for p in asked], seeds, synced=synced)
    seconds = time.perf_counter() - started
    texts = tokenizer.batch_decode(out.completion_ids, skip_special_tokens=True)
    chat = [isinstance(p.prompt, list) for p in asked]
    completions = [[{"role": "assistant", "content": t}] if c else t for t, c in zip(texts, chat)]
    keys = sorted({k for p in asked for k in p.columns})
    logged: dict[str, list[Any]] = {}
    metrics: dict[str, list[float]] = {}
    extras = {"trainer_state": trainer_state or SimpleNamespace(global_step=round_index, epoch=0),
              "log_extra": lambda column, values: logged.setdefault(column, []).extend(values),
              "log_metric": lambda name, value: metrics.setdefault(name, []).append(float(value))}
    call = RewardCall([p.prompt for p in asked], completions, out.completion_ids,
                      {k: [p.columns.get(k) for p in asked] for k in keys}, [p.row for p in asked], extras)
    failure = None
    try:
        per_func = score(rewards, call)
    except Exception as e:  # noqa: BLE001 - every rank must reach the gather; raised after it
        failure, per_func = e, torch.zeros((len(asked), len(rewards)), dtype=torch.float32)
    keep = torch.tensor([not (plan.mask_truncated and t) for t in out.truncated], dtype=torch.float32)
    lengths = torch.tensor([len(c) for c in out.completion_ids], dtype=torch.float32)
    mine = torch.cat([per_func, (lengths * keep)[:, None], lengths[:, None],
                      torch.tensor(out.truncated, dtype=torch.float32)[:, None],
                      torch.full((len(asked), 1), float(failure is not None))], dim=1)
    table = gather(mine).cpu()  # collective: every rank's rewards, once per round
    F = len(rewards)
    if table[:, -1].any():
        if failure is not None:
            raise RewardError(_describe_failure(failure)) from None
        bad = int(table[:, -1].nonzero()[0, 0]) // len(asked)
        raise RewardError(f"a reward function failed on rank {bad} (its message names the function and the row)")
    all_rewards = total(table[:, :F], [r.weight for r in rewards])
    advantages, std_zero = group_advantages(all_rewards, G, plan.scale_rewards)
    stats = round_stats(table[:, :F], all_rewards, advantages, std_zero, table[:, F + 1], table[:, F + 2],
                        [r.name for r in rewards])
    stats |= {k: sum(v) / len(v) for k, v in metrics.items()}  # log_metric: this rank's mean
    mine_adv = advantages[rank * len(asked):(rank + 1) * len(asked)]
    round_weight = torch.tensor([float(table[:, F].sum()) / (plan.steps_per_generation * plan.world_size)])

    micro = []
    mb = plan.micro_batch_size
    for k in range(plan.steps_per_generation):
        idx = list(range(k * mb, (k + 1) * mb))
        examples = [Example(asked[i].prompt_ids + out.completion_ids[i], len(out.completion_ids[i]),
                            row=asked[i].row) for i in idx]
        batch = collator(examples)
        N = batch["tail_mask"].shape[1]
        batch["loss_mask"] = batch["tail_mask"] * keep[idx].long()[:, None]
        batch["advantages"] = mine_adv[idx].float()
        if plan.loss_type == "dapo":
            batch["round_weight"] = round_weight
        if out.sampler_logps is not None:
            batch["sampler_logps"] = right_aligned([out.sampler_logps[i] for i in idx], N)
        micro.append(batch)
    for batch in micro:  # the round's policy and the reference, once per round (no graph)
        if plan.needs_old_logps and old_logps is not None:
            batch["old_logps"] = old_logps(batch).detach().float().cpu()
        if ref_logps is not None:
            batch["ref_logps"] = ref_logps(batch).detach().float().cpu()

    names = [r.name for r in rewards]
    records = []
    for i, p in enumerate(asked):
        rec = {"row": p.row, "prompt": p.prompt,
               "completion": completion_text(completions[i]),
               "rewards": {n: (None if math.isnan(float(per_func[i, f])) else float(per_func[i, f]))
                           for f, n in enumerate(names)},
               "reward": None if math.isnan(float(all_rewards[rank * len(asked) + i]))
               else float(all_rewards[rank * len(asked) + i]),
               "advantage": float(mine_adv[i]), "tokens": len(out.completion_ids[i]),
               "truncated": bool(out.truncated[i])}
        for column, values in logged.items():
            if i < len(values):
                rec[column] = values[i]
        records.append(rec)
    return Round(round_index, micro, records, stats, out.tokens, seconds)
