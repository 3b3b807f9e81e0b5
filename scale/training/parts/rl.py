"""The online-RL part (``loss.objective: grpo``): the reward functions and the generator, checked before the model
loads (:func:`check_rl`); what the loaders are under it (:func:`rl_loaders`: prompt indices, for accelerate's
wrappers and the step count); the reference (:func:`rl_reference`); and the loop's rollout source, its evaluation
and the round a checkpoint cuts (:func:`build_rl`). The rounds themselves are :mod:`scale.training.rollouts`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from accelerate.utils import DistributedType
from torch import Tensor
from torch.utils.data import DataLoader

from scale.config.schema import Config
from scale.config.validation import ConfigError
from scale.data.collate import Collator
from scale.data.tasks.base import encode
from scale.data.tokenize import Splits
from scale.generation.export import serving_tokenizer
from scale.generation.rollout import Generator, Sampling, TransformersGenerator, check_generator
from scale.generation.vllm import VllmGenerator
from scale.objectives.grpo import GrpoObjective
from scale.objectives.preference import has_adapter, reference_mode
from scale.objectives.rewards import Reward, build_rewards
from scale.training.best import check_reported
from scale.training.checkpoint.saving import unwrap
from scale.training.parts.launch import Launch
from scale.training.parts.loaders import Loaders
from scale.training.rollouts import Prompt, Round, RoundPlan, build_round, evaluate_prompts, restore_round
from scale.training.state import TrainerState
from scale.utils.assets import resolve_model
from scale.utils.signals import EvalInterrupted

ROUND_DIR = "rollouts"
"""A checkpoint's directory of the round in progress: ``rank<r>.pt`` per rank (only when cut mid-round)."""


def check_rl(launch: Launch, cfg: Config) -> list[Reward]:
    """Build ``rl.rewards`` (imports, built-ins, reward models on this rank's device) and check ``rl.generator``
    can run here: before the model loads, so bad input costs seconds.

    Raises:
        RewardError: an ``rl.rewards`` entry that does not build (one line naming it).
        ConfigError: ``rl.generator=vllm`` without CUDA or without the package.
    """
    try:
        check_generator(cfg.rl.generator, launch.acc.device.type == "cuda")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return build_rewards(cfg.rl.rewards, cfg.rl.max_completion_length, launch.acc.device)


def pick_rl_metrics(cfg: Config, rewards: list[Reward]) -> list[Any]:
    """Check ``train.keep_best`` against what a ``grpo`` evaluation reports (before step 1); no eval samples are
    picked (the evaluation completes every held-out prompt and keeps ``eval.generate_samples`` records).

    Raises:
        ConfigError: ``train.keep_best`` names a figure no evaluation reports.
    """
    names = {f"eval/reward/{r.name}/mean" for r in rewards} | {
        "eval/reward/total/mean", "eval/completions/mean_length", "eval/completions/truncated_fraction",
        "eval/prompts"}
    check_reported(cfg.train.keep_best, names)
    return []


def round_plan(cfg: Config, world: int) -> RoundPlan:
    """The rounds' shape from the config (``rl.*``, ``train.*``) over ``world`` data-parallel ranks."""
    rl, t = cfg.rl, cfg.train
    return RoundPlan(num_generations=rl.num_generations, micro_batch_size=t.micro_batch_size,
                     steps_per_generation=rl.steps_per_generation or t.gradient_accumulation_steps,
                     num_iterations=rl.num_iterations, gradient_accumulation_steps=t.gradient_accumulation_steps,
                     world_size=world, scale_rewards=rl.scale_rewards, loss_type=rl.loss_type,
                     mask_truncated=rl.mask_truncated_completions, seed=t.seed,
                     prompt_budget=cfg.data.max_length - rl.max_completion_length)


@dataclass
class RlLoaders(Loaders):
    """:class:`Loaders` under ``loss.objective: grpo``: loaders over prompt indices (what accelerate wraps and
    DeepSpeed reads the micro-batch size from; the loop trains :class:`RolloutSource`'s micro-batches instead), and
    the run's steps counted in rounds."""

    plan: RoundPlan = field(default_factory=RoundPlan)
    rounds_per_epoch: int = 0

    def max_steps(self, cfg: Config) -> int:
        """``train.max_steps``, else ``train.num_epochs`` epochs of whole rounds."""
        return cfg.train.max_steps or cfg.train.num_epochs * self.rounds_per_epoch * self.plan.optimizer_steps


def rl_loaders(launch: Launch, cfg: Config, splits: Splits) -> RlLoaders:
    """The loaders under ``loss.objective: grpo`` (:class:`RlLoaders`).

    Raises:
        DataError-like ConfigError: the train split holds fewer prompts than one round over every rank.
    """
    world = launch.plan.data_parallel_size
    plan = round_plan(cfg, world)
    n = len(splits.train)
    if n < plan.prompts * world:
        raise ConfigError(f"a round of rollouts samples {plan.prompts} prompts on each of {world} rank(s) "
                          f"(train.micro_batch_size x rl.steps_per_generation / rl.num_generations) and the train "
                          f"split holds {n}; lower train.micro_batch_size or add prompts")
    train = DataLoader(list(range(n)), batch_size=cfg.train.micro_batch_size)
    held = DataLoader(list(range(len(splits.eval))), batch_size=cfg.train.eval_micro_batch_size)
    return RlLoaders(train, held, cfg.train.global_batch_size(world), None, plan=plan,
                     rounds_per_epoch=n // (plan.prompts * world))


def rl_reference(model: torch.nn.Module, frozen: torch.nn.Module | None = None
                 ) -> tuple[torch.nn.Module, Callable[[], contextlib.AbstractContextManager]]:
    """The reference under ``rl.beta`` > 0: ``(module, context)``, the module to run and the context to run it in
    (no graph): a full run's frozen copy of the starting weights (``frozen``, :func:`scale.training.parts.preference.
    load_frozen_reference`, wrapped as the policy), else the policy with its LoRA adapter switched off, or the
    starting adapter's frozen copy (:func:`scale.objectives.preference.reference_mode`, as DPO's in-step reference).

    Raises:
        ConfigError: no frozen reference and the model has no adapter to switch off.
    """
    if frozen is not None:
        return frozen, torch.no_grad
    if not has_adapter(model):
        raise ConfigError("rl.beta > 0 needs a reference and this model has no LoRA adapter to switch off; set "
                          "rl.beta=0")
    return model, lambda: reference_mode(model)


def stop_ids(cfg: Config, tokenizer: Any, stops: list[int]) -> tuple[int, ...]:
    """EOS and the template's end-of-turn (``stops``) plus ``rl.stop``, each one token.

    Raises:
        ConfigError: an ``rl.stop`` entry that is not one token.
    """
    out = list(stops)
    for s in cfg.rl.stop:
        ids = encode(tokenizer, s)
        if len(ids) != 1:
            raise ConfigError(f"rl.stop: {s!r} is {len(ids)} tokens ({ids}); a stop is one token")
        out.append(ids[0])
    return tuple(dict.fromkeys(out))


class PromptRounds:
    """Which prompts each round of an epoch samples on each rank: a permutation of the train split by ``train.seed``
    and the epoch, cut into global rounds of ``P x world`` prompts (the last partial one dropped), rank ``r`` taking
    the ``r``-th slice of ``P`` (as accelerate shards batches: the same global rounds for any number of ranks with the
    same global batch).

    Args:
        n: prompts in the train split.
        per_rank: ``P``, prompts per round on each rank.
        world: data-parallel ranks.
        rank: this rank.
        seed: ``train.seed``.
    """

    def __init__(self, n: int, per_rank: int, world: int, rank: int, seed: int) -> None:
        self.n, self.per_rank, self.world, self.rank, self.seed = n, per_rank, world, rank, seed

    def __len__(self) -> int:
        """Rounds per epoch."""
        return self.n // (self.per_rank * self.world)

    def epoch(self, epoch: int) -> list[list[int]]:
        """Every round of ``epoch``: this rank's prompt indices."""
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()
        g = self.per_rank * self.world
        return [order[k * g + self.rank * self.per_rank:k * g + (self.rank + 1) * self.per_rank]
                for k in range(len(self))]


@dataclass
class RoundMeter:
    """The rounds of one log interval: their metrics (averaged over rounds, as TRL averages them over its logging
    steps), the completion tokens sampled on every rank and the seconds spent sampling (this rank's)."""

    sums: dict[str, float] = field(default_factory=dict)
    rounds: int = 0
    tokens: int = 0
    seconds: float = 0.0
    pending: float = 0.0  # sampling seconds not yet taken out of the loop's data time

    def add(self, rnd: Round) -> None:
        for k, v in rnd.stats.items():
            self.sums[k] = self.sums.get(k, 0.0) + v
        self.rounds += 1
        self.tokens += rnd.tokens
        self.seconds += rnd.seconds
        self.pending += rnd.seconds

    def take_pending(self) -> float:
        """Sampling seconds since the last call (the loop counts them as rollout time, not data time)."""
        s, self.pending = self.pending, 0.0
        return s

    def flush(self) -> dict[str, float]:
        """``train/<metric>`` means over the interval's rounds, ``train/rollout_tokens_per_s`` and ``train/rollout_s``;
        ``{}`` when no round started in it. Resets."""
        if not self.rounds:
            return {}
        out = {f"train/{k}": v / self.rounds for k, v in self.sums.items()}
        out["train/rollout_s"] = self.seconds
        out["train/rollout_tokens_per_s"] = self.tokens / max(self.seconds, 1e-9)
        self.sums, self.rounds, self.tokens, self.seconds = {}, 0, 0, 0.0
        return out


class RolloutSource:
    """The loop's micro-batches under ``loss.objective: grpo``: for each round of the epoch, :func:`build_round`
    (collective), then its micro-batches on the device, ``rl.num_iterations`` times over. A drop-in for the train
    loader in :func:`scale.train.fit` (``set_epoch``, iteration, :meth:`resume_at`).

    Args:
        rounds: the prompts of each round (:class:`PromptRounds`).
        prompts: ``index -> Prompt`` (the train split's).
        plan: the rounds' shape.
        make_round: ``(prompts, round_index) -> Round`` (:func:`build_round` with the run's model, generator,
            rewards and collectives).
        step: the optimizer step now (the round's seed index).
        device: where micro-batches go.
        restore: ``() -> Round`` the round a checkpoint cut (:func:`restore_round`), or ``None``.
        trained: micro-batches of the epoch trained so far (``windows_in_epoch x GA``): where a checkpoint cuts
            (the loop draws a window's micro-batches before it learns that a signal stops it).
    """

    def __init__(self, rounds: PromptRounds, prompts: Callable[[int], Prompt], plan: RoundPlan,
                 make_round: Callable[[list[Prompt], int], Round], step: Callable[[], int], device: Any,
                 restore: Callable[[], Round] | None = None, trained: Callable[[], int] = lambda: 0) -> None:
        self.rounds, self.prompts, self.plan = rounds, prompts, plan
        self.make_round, self.step, self.device, self.restore = make_round, step, device, restore
        self.trained = trained
        self.epoch, self.start = 0, 0
        self.current: Round | None = None  # the round being trained (or whose first window was just drawn)
        self.position = 0  # micro-batches of the current round handed out
        self.meter = RoundMeter()
        self.last_records: list[dict[str, Any]] = []  # the latest round's, for samples.jsonl at the next log

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.start = epoch, 0

    def resume_at(self, micro_batches: int) -> RolloutSource:
        """Continue the epoch after ``micro_batches`` of it (``windows_in_epoch x GA``): the rounds before are
        skipped, and a round cut in the middle comes back from the checkpoint (``restore``)."""
        self.start = micro_batches
        return self

    def __len__(self) -> int:
        return len(self.rounds) * self.plan.micro_batches

    def __iter__(self) -> Iterator[dict[str, Tensor]]:
        per_round = self.plan.micro_batches
        first, offset = divmod(self.start, per_round)
        self.start = 0
        for k, indices in enumerate(self.rounds.epoch(self.epoch)):
            if k < first:
                continue
            if k == first and offset:
                if self.restore is None:
                    raise RuntimeError("resumed in the middle of a round and the checkpoint holds none")
                self.current, self.position = self.restore(), offset
            else:
                self.current = self.make_round([self.prompts(i) for i in indices], self.step())
                self.meter.add(self.current)
                self.last_records, self.position = self.current.records, 0
            micro = self.current.micro
            while self.position < per_round:
                batch = micro[self.position % len(micro)]
                self.position += 1
                yield {key: v.to(self.device) for key, v in batch.items()}
        self.current = None

    def mid_round(self) -> bool:
        """Whether a checkpoint now cuts a round: the micro-batches trained stop inside one (its windows drawn so
        far belong to it: a window never spans two rounds)."""
        return self.current is not None and self.trained() % self.plan.micro_batches != 0

    def save(self, directory: Path, rank: int) -> None:
        """Write this rank's part of the round in progress into a checkpoint being written (only mid-round)."""
        if self.mid_round():
            (directory / ROUND_DIR).mkdir(parents=True, exist_ok=True)
            torch.save(self.current.state_dict(), directory / ROUND_DIR / f"rank{rank}.pt")


def read_round(checkpoint: Path) -> list[dict[str, Any]] | None:
    """Every rank's part of the round a checkpoint cut, in rank order; ``None`` when it cut none."""
    files = sorted((checkpoint / ROUND_DIR).glob("rank*.pt"), key=lambda p: int(p.stem[4:]))
    return [torch.load(f, weights_only=True) for f in files] or None


@dataclass
class Rl:
    """What the loop runs under ``loss.objective: grpo`` (:func:`build_rl`).

    Attributes:
        source: the train micro-batches (:class:`RolloutSource`).
        evaluate: ``stop -> (metrics, records)``: the held-out evaluation (:func:`scale.training.rollouts.
            evaluate_prompts`). Collective.
        rewards: ``rl.rewards``, built.
    """

    source: RolloutSource
    evaluate: Callable[[Callable[[], bool] | None], tuple[dict[str, float], list[dict[str, Any]]]]
    rewards: list[Reward]


def build_rl(launch: Launch, cfg: Config, splits: Splits, model: torch.nn.Module, objective: GrpoObjective,
             state: TrainerState, rewards: list[Reward], plan: RoundPlan, chat: bool,
             frozen: torch.nn.Module | None = None) -> Rl:
    """The rollout source and the evaluation of a ``grpo`` run, after ``prepare`` and the resume; ``frozen``: a full
    run's frozen reference (the KL term's, ``rl.beta`` > 0), else None.

    Raises:
        ConfigError: ``rl.beta`` > 0 without a reference (:func:`rl_reference`), an ``rl.stop`` of several tokens.
    """
    acc = launch.acc
    tokenizer, stops, _ = serving_tokenizer(cfg, chat=chat)
    ids = stop_ids(cfg, tokenizer, stops)
    rl = cfg.rl
    sampling = Sampling(rl.temperature, rl.top_p, rl.top_k, rl.max_completion_length, ids, tokenizer.pad_token_id)
    generator: Generator = make_generator(cfg, sampling)
    greedy = TransformersGenerator(Sampling(0.0, 1.0, 0, rl.max_completion_length, ids, tokenizer.pad_token_id))
    reference = rl_reference(model, frozen) if objective.needs_reference else None
    collator = Collator(tokenizer.pad_token_id, cfg.data.padding_side)
    synced = launch.plan.partitioned and acc.num_processes > 1
    rank = acc.process_index

    def gather(t: Tensor) -> Tensor:
        return acc.gather(t.to(acc.device))

    def logps(batch: dict[str, Tensor], net: torch.nn.Module = model) -> Tensor:
        with torch.no_grad(), acc.autocast():
            return objective.forward_logps(net, {k: v.to(acc.device) for k, v in batch.items()})[0]

    def ref_logps(batch: dict[str, Tensor]) -> Tensor:
        net, context = reference
        with context():
            return logps(batch, net)

    fsdp = acc.distributed_type == DistributedType.FSDP

    def generating() -> torch.nn.Module:
        """The unwrapped policy to generate with. Under FSDP2 generation calls the modules below the root, whose
        own parameters (the final norm, ...) only the root's forward unshards (and keeps so: FSDP2 does not reshard
        the root after its forward; a backward does): one root forward of one token first, every round."""
        if fsdp:
            with torch.no_grad():
                model(input_ids=torch.full((1, 1), tokenizer.pad_token_id, device=acc.device), use_cache=False)
        return unwrap(acc, model)

    def make_round(prompts: list[Prompt], index: int) -> Round:
        with acc.autocast():
            return build_round(prompts, index, plan, generator, generating(), rewards, tokenizer, collator,
                               gather, rank, logps, ref_logps if reference is not None else None, synced,
                               SimpleNamespace(global_step=state.step, epoch=state.epoch))

    train_prompts: dict[int, Prompt] = {}

    def prompt(i: int) -> Prompt:
        if i not in train_prompts:
            train_prompts[i] = Prompt.of(i, splits.train[i])
        return train_prompts[i]

    saved = read_round(launch.resume) if launch.resume is not None else None
    restore = (lambda: restore_round(saved, plan, rank, collator)) if saved else None
    source = RolloutSource(PromptRounds(len(splits.train), plan.prompts, plan.world_size, rank, cfg.train.seed),
                           prompt, plan, make_round, lambda: state.step, acc.device, restore,
                           lambda: state.windows_in_epoch * cfg.train.gradient_accumulation_steps)
    held = [Prompt.of(i, e) for i, e in enumerate(splits.eval)]

    def evaluate(stop: Callable[[], bool] | None) -> tuple[dict[str, float], list[dict[str, Any]]]:
        def check() -> None:
            flag = torch.tensor(float(stop is not None and stop()), device=acc.device)
            if acc.num_processes > 1:
                flag = acc.reduce(flag, reduction="sum")  # collective: one number per generate call
            if float(flag) > 0:
                raise EvalInterrupted("a stop was requested during evaluation")

        net = generating()
        was_training = net.training
        try:
            with acc.autocast():
                return evaluate_prompts(held, greedy, net, rewards, tokenizer, cfg.train.eval_micro_batch_size,
                                        acc.num_processes, rank, gather, check, synced, plan.prompt_budget,
                                        cfg.eval.generate_samples if acc.is_main_process else 0)
        finally:
            net.train(was_training)

    return Rl(source, evaluate, rewards)


def make_generator(cfg: Config, sampling: Sampling) -> Generator:
    """``rl.generator``'s engine (:mod:`scale.generation.rollout`, :mod:`scale.generation.vllm`: CUDA only, checked by
    :func:`check_rl` before the model loads)."""
    if cfg.rl.generator == "vllm":
        return VllmGenerator(sampling, resolve_model(cfg.model.name_or_path), cfg.lora.r,
                             cfg.rl.vllm_gpu_memory_utilization, cfg.data.max_length)
    return TransformersGenerator(sampling)
