"""Online RL in the loop (``loss.objective: grpo``): rounds of rollouts, sampled, scored and batched for
:class:`scale.objectives.grpo.GrpoObjective` (:func:`build_round`), handed to the loop as its micro-batches
(:class:`RolloutSource`), kept in a checkpoint taken in the middle of a round, and the held-out evaluation
(:func:`evaluate_prompts`).

A *round* is ``rl.steps_per_generation`` micro-batches of ``train.micro_batch_size`` completions on every rank,
trained ``rl.num_iterations`` times: ``steps_per_generation x num_iterations / gradient_accumulation_steps``
optimizer steps (TRL's ``generate_every``). Its prompts are ``P = micro_batch_size x steps_per_generation /
num_generations`` per rank, drawn from the train split in an order fixed by ``train.seed`` and the epoch
(:class:`PromptRounds`: global round ``k`` is the same prompts for any number of ranks with the same global batch).
Each rank samples ``rl.num_generations`` completions of each of its own prompts (a prompt's group never spans two
ranks), each completion seeded by ``train.seed``, the round and the prompt (:func:`scale.generation.rollout.
completion_seed`), so a rerun, a resume or another launch mode draws the same completions. A round of several
optimizer steps deals its completions to them round-robin (:meth:`RoundPlan.order`: which completions a step trains
does not depend on the number of ranks; TRL shuffles the round first); a round of one step (the default) is trained
in prompt order.

Collective: one all-gather per round of a ``[completions, F + 3]`` table (every function's reward, the completion's
kept tokens, its length, its truncation, an error flag), from which every rank computes the same advantages
(``rl.scale_rewards: batch`` needs the round's std), the same ``dapo`` normaliser and the same metrics, and stops
together when a reward function failed on one of them.

When a round spans more than one optimizer step the policy moves while its completions are still trained: their
log-probs under the round's policy (``old_logps``) are computed once, before its first step (TRL 1.16's condition:
``gradient_accumulation_steps % (steps_per_generation x num_iterations) != 0``); otherwise the trained forward is
the round's policy and the ratio is 1. With ``rl.beta`` > 0 the reference's log-probs (``ref_logps``) are computed
once per round too.
"""

from __future__ import annotations

import json
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
from scale.data.tasks.prompts import fit_prompt
from scale.generation.rollout import Generator, Rollouts, completion_seed
from scale.objectives.grpo import group_advantages, nanstd
from scale.objectives.rewards import Reward, RewardCall, RewardError, completion_text, score, total


@dataclass
class Prompt:
    """One prompt of the ``prompts`` format, tokenized.

    Attributes:
        index, row: its position in the train split (with the round, it seeds its completions); its data-file row.
        prompt_ids: its tokens as the model reads them (template, generation prompt, BOS).
        prompt: as the file holds it (text, or a list of messages): what reward functions get.
        columns: the row's other columns (reward functions get them by name).
    """

    index: int
    row: int
    prompt_ids: list[int]
    prompt: Any
    columns: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, index: int, e: Example) -> Prompt:
        """The prompt of a ``prompts`` example (:mod:`scale.data.tasks.prompts`: its ``extra`` JSON)."""
        extra = json.loads(e.extra) if e.extra else {"prompt": "", "columns": {}}
        return cls(index, e.row, list(e.input_ids), extra["prompt"], extra.get("columns", {}))


@dataclass
class RoundPlan:
    """The shape of every round.

    Attributes:
        num_generations: ``rl.num_generations`` (``G``).
        micro_batch_size: completions per micro-batch (``train.micro_batch_size``).
        steps_per_generation: micro-batches per round on each rank (``rl.steps_per_generation``).
        num_iterations: ``rl.num_iterations``.
        gradient_accumulation_steps: ``train.gradient_accumulation_steps``.
        world_size: data-parallel ranks.
        scale_rewards: ``rl.scale_rewards``.
        loss_type: ``rl.loss_type``.
        mask_truncated: ``rl.mask_truncated_completions``.
        seed: ``train.seed``.
        prompt_budget: the most prompt tokens a completion is sampled after (``data.max_length -
            rl.max_completion_length``); a longer prompt loses its oldest tokens after the BOS.
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
    prompt_budget: int | None = None

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

    def order(self, n: int) -> list[int]:
        """The order a rank trains its ``n`` completions of a round in (they come in prompt order): step ``s`` of the
        ``S = steps_per_generation / gradient_accumulation_steps`` takes every ``S``-th completion from the ``s``-th.
        ``n`` being a multiple of ``S``, a step's completions over all ranks are those whose index in the round is
        ``s`` mod ``S``: the same for any number of ranks. ``S`` 1 (the default): prompt order."""
        S = self.steps_per_generation // self.gradient_accumulation_steps
        return [j for s in range(S) for j in range(s, n, S)]


@dataclass
class Sampled:
    """One completion of a round: what training it needs (CPU tensors, unpadded).

    Attributes:
        prompt_ids, completion_ids, row, advantage: its row's two parts, its prompt's data-file row, its advantage.
        keep: trained (``False``: truncated under ``rl.mask_truncated_completions``).
        sampler_logps, old_logps, ref_logps: ``[len(completion_ids)]`` float32: the sampler's, the round's
            policy's (when stored) and the reference's (``rl.beta`` > 0) token log-probs, or ``None``.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    row: int
    advantage: float
    keep: bool = True
    sampler_logps: Tensor | None = None
    old_logps: Tensor | None = None
    ref_logps: Tensor | None = None


@dataclass
class Round:
    """One round on this rank.

    Attributes:
        index: the round's seed index (the optimizer step it starts at).
        items, tokens_kept: its completions on this rank, in prompt order; the trained tokens of the round on every
            rank (``dapo``'s normaliser).
        micro: its ``steps_per_generation`` micro-batches (CPU tensors; the loop moves them).
        records: one per completion on this rank: ``row, prompt, completion, rewards {fn: value}, reward,
            advantage, tokens, truncated`` (``samples.jsonl``).
        stats: the round's metrics over every rank (:func:`round_stats`).
        tokens: completion tokens sampled on every rank; seconds: time spent sampling on this rank.
    """

    index: int
    items: list[Sampled]
    tokens_kept: float
    micro: list[dict[str, Tensor]] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=dict)
    tokens: int = 0
    seconds: float = 0.0

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the round (:data:`ROUND_DIR`): enough to train its remaining micro-batches
        exactly as the uninterrupted run does, in any launch mode."""
        return {"index": self.index, "tokens_kept": self.tokens_kept, "items": [vars(i) for i in self.items],
                "records": self.records, "stats": self.stats}


def right_aligned(values: list[Tensor], width: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """``[B, width]``: each 1-D ``values[b]`` in the last ``len(values[b])`` columns (a tail's alignment), 0 before."""
    out = torch.zeros((len(values), width), dtype=dtype)
    for b, v in enumerate(values):
        if len(v):
            out[b, width - len(v):] = v.to(dtype)
    return out


def micro_batches(items: list[Sampled], plan: RoundPlan, collator: Collator, tokens_kept: float) -> list[dict[str,
                                                                                                            Tensor]]:
    """This rank's items, in :meth:`RoundPlan.order`, as ``len(items) / micro_batch_size`` padded micro-batches: rows
    ``prompt + completion`` (the completion is the tail), ``loss_mask`` (the tail, 0 on a masked truncated
    completion), ``advantages [B]``, the stored log-probs right-aligned like the tail, and ``dapo``'s ``round_weight``
    (the round's trained tokens / (``steps_per_generation`` x ranks)), ``row``."""
    out = []
    mb = plan.micro_batch_size
    items = [items[j] for j in plan.order(len(items))]
    for k in range(0, len(items), mb):
        chunk = items[k:k + mb]
        batch = collator([Example(s.prompt_ids + s.completion_ids, len(s.completion_ids), row=s.row) for s in chunk])
        N = batch["tail_mask"].shape[1]
        batch["loss_mask"] = batch["tail_mask"] * torch.tensor([int(s.keep) for s in chunk])[:, None]
        batch["advantages"] = torch.tensor([s.advantage for s in chunk], dtype=torch.float32)
        if plan.loss_type == "dapo":
            batch["round_weight"] = torch.tensor([tokens_kept / (plan.steps_per_generation * plan.world_size)])
        for key in ("sampler_logps", "old_logps", "ref_logps"):
            if all(getattr(s, key) is not None for s in chunk):
                batch[key] = right_aligned([getattr(s, key) for s in chunk], N)
        out.append(batch)
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
    out["reward/total/mean"], out["reward/total/std"] = float(torch.nanmean(rewards)), float(nanstd(rewards))
    out["frac_reward_zero_std"] = float(std_zero.float().mean())
    out["advantage/std"] = float(advantages.std()) if advantages.numel() > 1 else 0.0
    out["advantage/min"], out["advantage/max"] = float(advantages.min()), float(advantages.max())
    out["completions/mean_length"] = float((lengths := lengths.double()).mean())
    out["completions/min_length"], out["completions/max_length"] = float(lengths.min()), float(lengths.max())
    out["completions/truncated_fraction"], done = float(truncated.double().mean()), lengths[~truncated.bool()]
    out["completions/mean_terminated_length"] = float(done.mean()) if done.numel() else 0.0
    return out


def _value(x: float) -> float | None:  # a reward of None (NaN in the table) stays None in the records
    return None if math.isnan(x) else x


def score_round(rewards: list[Reward], prompts: list[Prompt], out: Rollouts, tokenizer: Any, rows_state: Any,
                gather: Callable[[Tensor], Tensor], mask_truncated: bool,
                valid: Tensor | None = None) -> tuple[Tensor, Tensor, list[Any], dict]:
    """Score this rank's completions and gather every rank's table (one collective).

    Args:
        valid: ``[n]`` 1 on completions that count (the evaluation pads a rank's share with repeats), appended as a
            column before the error flag.

    Returns:
        ``(table [all completions, F + 4 (+ 1)], this rank's per-function rewards [n, F], completions as reward
        functions got them, what log_extra/log_metric got)``; table columns: the F rewards, kept tokens, length,
        truncated, (valid,) error flag.

    Raises:
        RewardError: a reward function failed on some rank (every rank raises; the failing rank names the function
            and the row, the others say which rank failed).
    """
    texts = tokenizer.batch_decode(out.completion_ids, skip_special_tokens=True)
    completions = [[{"role": "assistant", "content": t}] if isinstance(p.prompt, list) else t
                   for t, p in zip(texts, prompts)]
    keys = sorted({k for p in prompts for k in p.columns})
    logged: dict[str, list[Any]] = {}
    metrics: dict[str, list[float]] = {}
    extras = {"trainer_state": rows_state,
              "log_extra": lambda column, values: logged.setdefault(column, []).extend(values),
              "log_metric": lambda name, value: metrics.setdefault(name, []).append(float(value))}
    call = RewardCall([p.prompt for p in prompts], completions, out.completion_ids,
                      {k: [p.columns.get(k) for p in prompts] for k in keys}, [p.row for p in prompts], extras)
    failure = None
    try:
        per_func = score(rewards, call)
    except Exception as e:  # noqa: BLE001 - every rank must reach the gather; raised after it
        failure, per_func = e, torch.zeros((len(prompts), len(rewards)), dtype=torch.float32)
    keep = torch.tensor([not (mask_truncated and t) for t in out.truncated], dtype=torch.float32)
    lengths = torch.tensor([len(c) for c in out.completion_ids], dtype=torch.float32)
    mine = torch.cat([per_func, (lengths * keep)[:, None], lengths[:, None],
                      torch.tensor(out.truncated, dtype=torch.float32)[:, None],
                      *([valid.float()[:, None]] if valid is not None else []),
                      torch.full((len(prompts), 1), float(failure is not None))], dim=1)
    table = gather(mine).cpu()  # collective: every rank's rewards, once per round
    if table[:, -1].any():
        if failure is not None:
            raise RewardError(str(failure) if isinstance(failure, RewardError) else
                              f"{type(failure).__name__}: {failure}") from None
        bad = int(table[:, -1].nonzero()[0, 0]) // len(prompts)
        raise RewardError(f"a reward function failed on rank {bad} (its message names the function and the row)")
    return table, per_func, completions, {"logged": logged, "metrics": metrics}


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
        plan, generator, gen_model, rewards: the round's shape, what samples (:mod:`scale.generation.rollout`),
            the policy to sample with (unwrapped), ``rl.rewards`` built.
        tokenizer, collator: decodes completions (special tokens dropped); pads a micro-batch's rows.
        gather: the all-gather over ranks of a ``[n, k]`` tensor (same ``n`` on every rank) -> ``[world x n, k]``
            in rank order; collective.
        rank: this rank's index.
        old_logps, ref_logps: ``batch -> [B, N]`` the policy's tail logps under ``no_grad`` (used when
            ``plan.needs_old_logps``), the reference's (``rl.beta`` > 0).
        synced: the weights are partitioned (ZeRO-3, FSDP): generation runs in lock-step.
        trainer_state: what reward functions get as ``trainer_state`` (``global_step``, ``epoch``).

    Returns the :class:`Round`; raises RewardError when a reward function failed on some rank.
    """
    G = plan.num_generations
    if len(prompts) * G != plan.completions:
        raise ValueError(f"a round needs {plan.prompts} prompts on each rank, got {len(prompts)}")
    started = time.perf_counter()
    asked = [p for p in prompts for _ in range(G)]
    seeds = [completion_seed(plan.seed, round_index, p.index, g) for p in prompts for g in range(G)]
    ids = [fit_prompt(p.prompt_ids, 0, plan.prompt_budget, "keep_end") if plan.prompt_budget else p.prompt_ids
           for p in asked]
    out: Rollouts = generator.generate(gen_model, ids, seeds, synced=synced)
    seconds = time.perf_counter() - started
    table, per_func, completions, logs = score_round(
        rewards, asked, out, tokenizer, trainer_state or SimpleNamespace(global_step=round_index, epoch=0), gather,
        plan.mask_truncated)
    F, n = len(rewards), len(asked)
    all_rewards = total(table[:, :F], [r.weight for r in rewards])
    advantages, std_zero = group_advantages(all_rewards, G, plan.scale_rewards)
    stats = round_stats(table[:, :F], all_rewards, advantages, std_zero, table[:, F + 1], table[:, F + 2],
                        [r.name for r in rewards])
    stats |= {k: sum(v) / len(v) for k, v in logs["metrics"].items()}  # log_metric: this rank's mean
    mine = advantages[rank * n:(rank + 1) * n]
    items = [Sampled(ids[i], out.completion_ids[i], asked[i].row, float(mine[i]),
                     not (plan.mask_truncated and out.truncated[i]),
                     out.sampler_logps[i].float() if out.sampler_logps is not None else None) for i in range(n)]
    rnd = Round(round_index, items, float(table[:, F].sum()), tokens=int(table[:, F + 1].sum()), seconds=seconds,
                stats=stats)
    rnd.micro = micro_batches(items, plan, collator, rnd.tokens_kept)
    if (plan.needs_old_logps and old_logps is not None) or ref_logps is not None:
        ordered = [items[j] for j in plan.order(n)]
        for k, batch in enumerate(rnd.micro):  # the round's policy and the reference, once per round (no graph)
            for key, fn in (("old_logps", old_logps if plan.needs_old_logps else None), ("ref_logps", ref_logps)):
                if fn is not None:
                    values = fn(batch).detach().float().cpu()
                    batch[key] = values
                    for b, s in enumerate(ordered[k * plan.micro_batch_size:(k + 1) * plan.micro_batch_size]):
                        setattr(s, key, values[b, values.shape[1] - len(s.completion_ids):].clone())
    names = [r.name for r in rewards]
    for i, p in enumerate(asked):
        rec = {"row": p.row, "prompt": p.prompt, "completion": completion_text(completions[i]),
               "rewards": {nm: _value(float(per_func[i, f])) for f, nm in enumerate(names)},
               "reward": _value(float(all_rewards[rank * n + i])), "advantage": float(mine[i]),
               "tokens": len(out.completion_ids[i]), "truncated": bool(out.truncated[i])}
        rec |= {column: values[i] for column, values in logs["logged"].items() if i < len(values)}
        rnd.records.append(rec)
    return rnd


def restore_round(parts: list[dict[str, Any]], plan: RoundPlan, rank: int, collator: Collator) -> Round:
    """The round a checkpoint kept (every rank's :meth:`Round.state_dict`, in rank order), re-sliced for this run's
    ranks and batched again: the same completions, advantages and stored log-probs as the run that saved it, and on
    another world size with the same global batch and steps per round each remaining step trains the same
    completions (:meth:`RoundPlan.order`). Raises ValueError when the round's size is not this run's."""
    items = [Sampled(**i) for part in parts for i in part["items"]]
    records = [r for part in parts for r in part["records"]]
    n = len(items) // plan.world_size
    if n != plan.completions:
        raise ValueError(f"the checkpoint's round holds {len(items)} completions; this run's rounds hold "
                         f"{plan.completions} on each of {plan.world_size} rank(s)")
    mine = slice(rank * n, (rank + 1) * n)
    rnd = Round(parts[0]["index"], items[mine], parts[0]["tokens_kept"], records=records[mine],
                stats=parts[0]["stats"])
    rnd.micro = micro_batches(rnd.items, plan, collator, rnd.tokens_kept)
    return rnd


@torch.no_grad()
def evaluate_prompts(prompts: list[Prompt], generator: Generator, net: torch.nn.Module, rewards: list[Reward],
                     tokenizer: Any, batch_size: int, world: int, rank: int, gather: Callable[[Tensor], Tensor],
                     check: Callable[[], None] = lambda: None, synced: bool = False, budget: int | None = None,
                     keep_records: int = 0) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """The held-out evaluation under ``loss.objective: grpo``: a greedy completion of every held-out prompt, scored
    by the run's reward functions. Collective: one all-gather of the rewards, and every rank runs the same number
    of ``generate`` calls (its contiguous share of the prompts, the last share padded with repeats that do not count:
    under ZeRO-3/FSDP the forwards are collective).

    Args:
        prompts: the eval split's prompts.
        generator: a greedy generator (``Sampling.temperature`` 0).
        net: the unwrapped policy.
        batch_size: prompts per ``generate`` call (``train.eval_micro_batch_size``).
        check: called before every ``generate`` call on every rank; raises to stop (a pre-emption).
        budget, keep_records: the prompt budget (:attr:`RoundPlan.prompt_budget`); how many of the first prompts'
            records to return (``eval.generate_samples``).

    Returns:
        ``(metrics, records)``: ``eval/reward/<fn>/mean``, ``eval/reward/total/mean``,
        ``eval/completions/mean_length``, ``eval/completions/truncated_fraction`` and ``eval/prompts`` over the split;
        this rank's first records (rank 0 holds the split's first prompts).

    Raises RewardError when a reward function failed on some rank.
    """
    per = math.ceil(len(prompts) / world)
    mine = list(range(rank * per, min((rank + 1) * per, len(prompts))))
    valid = torch.tensor([1.0] * len(mine) + [0.0] * (per - len(mine)))
    mine += [mine[-1] if mine else 0] * (per - len(mine))
    asked = [prompts[i] for i in mine]
    ids = [fit_prompt(p.prompt_ids, 0, budget, "keep_end") if budget else p.prompt_ids for p in asked]
    done: list[list[int]] = []
    truncated: list[bool] = []
    for k in range(0, per, batch_size):
        check()
        out = generator.generate(net, ids[k:k + batch_size], [0] * len(ids[k:k + batch_size]), synced=synced)
        done += out.completion_ids
        truncated += out.truncated
    check()
    rollouts = Rollouts(done, None, truncated, sum(map(len, done)))
    table, per_func, completions, _ = score_round(rewards, asked, rollouts, tokenizer,
                                                  SimpleNamespace(global_step=-1, epoch=0), gather, False, valid)
    F = len(rewards)
    keep = table[:, F + 3] > 0
    kept = table[keep]
    total_r = total(kept[:, :F], [r.weight for r in rewards])
    metrics = {f"eval/reward/{r.name}/mean": float(torch.nanmean(kept[:, f])) for f, r in enumerate(rewards)}
    metrics |= {"eval/reward/total/mean": float(torch.nanmean(total_r)),
                "eval/completions/mean_length": float(kept[:, F + 1].double().mean()),
                "eval/completions/truncated_fraction": float(kept[:, F + 2].double().mean()),
                "eval/prompts": int(keep.sum())}
    names = [r.name for r in rewards]
    records = []
    for i in range(min(keep_records, int(valid.sum()))):
        by_fn = {nm: _value(float(per_func[i, f])) for f, nm in enumerate(names)}
        weighted = [r.weight * v for r, v in zip(rewards, by_fn.values()) if v is not None]
        records.append({"row": asked[i].row, "prompt": asked[i].prompt, "completion": completion_text(completions[i]),
                        "rewards": by_fn, "reward": sum(weighted) if weighted else None, "tokens": len(done[i]),
                        "truncated": bool(truncated[i])})
    return metrics, records
