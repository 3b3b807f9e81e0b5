"""GRPO and its variants (``loss.objective: grpo``, settings under ``rl.*``) on completions the loop sampled.
Plain tensors, no accelerate.

A GRPO micro-batch holds ``B`` completions, each a row ``prompt + completion`` whose *tail* is the completion
(``tail_mask [B, N]``, right-aligned as every tail here: :mod:`scale.data.collate`), with what its round computed
(:mod:`scale.training.rollouts`): ``advantages [B]``, ``loss_mask [B, N]`` (the tail, minus truncated completions under
``rl.mask_truncated_completions``), and where needed ``old_logps``, ``ref_logps``, ``sampler_logps`` ``[B, N]``.
Log-probabilities are of ``logits / rl.temperature`` (the distribution the completions were sampled from, as TRL's
``GRPOTrainer`` scores them), in nats.

**Advantages** (:func:`group_advantages`), per completion ``i`` of prompt group ``g`` (``rl.num_generations`` =
``G`` completions), ``r_i`` the weighted sum of the reward functions:
``A_i = r_i - mean_g(r)``, divided by ``std_g(r) + 1e-4`` (``rl.scale_rewards: group``; DeepSeekMath, Shao et al.
2024, sec. 4.1.2, arXiv:2402.03300), by the round's ``std(r) + 1e-4`` (``batch``: group mean, batch std, LitePPO,
Liu et al. 2025, arXiv:2508.08221) or not divided (``none``: Dr. GRPO, Liu et al. 2025, arXiv:2503.20783, sec.
3.1). ``std`` is Bessel-corrected; a reward ``None`` (TRL: the function does not apply) is left out of the sums,
and a completion no function scored gets ``A = 0``. TRL 1.16 ``GRPOTrainer._generate_and_score_completions``.

**Per-token loss** (:func:`token_terms`), ``l = log pi(y_t)``, ``l_old`` the round's policy (``rl.num_iterations``
> 1 or ``rl.steps_per_generation`` > the accumulation: the stored ``old_logps``; else ``l`` detached, ratio 1):

- ratio ``w = exp(l - l_old)`` per token (``rl.importance_sampling_level: token``), or per sequence
  ``exp(mean_t (l - l_old))`` (``sequence``: GSPO, Zheng et al. 2025, eq. 7, arXiv:2507.18071);
- clipped surrogate ``-min(w A, clip(w, 1 - eps, 1 + eps_high) A)`` (PPO, Schulman et al. 2017, eq. 7,
  arXiv:1707.06347; ``eps_high`` > ``eps``: DAPO's clip-higher, Yu et al. 2025, sec. 3.1, arXiv:2503.14476);
- plus ``beta x KL`` with the k3 estimator ``exp(l_ref - l) - (l_ref - l) - 1`` (Schulman 2020,
  http://joschu.net/blog/kl-approx.html; DeepSeekMath eq. 4), multiplied by ``w`` under ``rl.kl_bias_correction``
  (TRL's ``use_bias_correction_kl``, default on: DeepSeek-V3.2, arXiv:2512.02556, eq. 7).

**Normalisations** (``rl.loss_type``): the micro-batch's numerator is a sum, and its :meth:`GrpoObjective.weights`
sum over the whole accumulation window and every rank to the denominator, so the step's loss is the same whatever
the split into micro-batches and ranks (:mod:`scale.training.windows`):

| ``loss_type`` | loss of one optimizer step (weights of a micro-batch) | source |
|---|---|---|
| ``grpo`` | mean over the step's completions of each one's token mean (1 per completion) | DeepSeekMath eq. 3 |
| ``bnpo`` | sum of token losses / the step's tokens (``loss_mask``) | TRL ``bnpo`` (see below) |
| ``dr_grpo`` | token losses / (completions x ``L``) (``L`` = ``rl.max_completion_length`` each) | Dr. GRPO eq. 4 |
| ``dapo`` | sum of token losses / (round tokens x ``GA / S``) (round tokens / (``S`` x ranks)) | DAPO eq. 8 |

(``GA``: ``train.gradient_accumulation_steps``; ``S``: ``rl.steps_per_generation``; round tokens: the trained
tokens of the round on every rank.)

``grpo``, ``dr_grpo`` and ``dapo`` equal TRL 1.16's losses in every split (TRL's ``dapo`` normaliser is the same
round average, ``num_items_in_batch``); TRL's ``bnpo`` divides each micro-batch by its own tokens on its own rank
(its docs: "results may slightly vary depending on the local batch size"), so here ``bnpo`` is the step's token
mean instead, which equals TRL's when a step is one micro-batch on one rank. With ``steps_per_generation`` equal
to the accumulation (the default) ``dapo`` and ``bnpo`` are the same loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from scale.loss import tail as scale_loss

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo")
SCALE_REWARDS = ("group", "batch", "none")
IMPORTANCE_LEVELS = ("token", "sequence")
STD_EPS = 1e-4
"""Added to the reward std before dividing (TRL's ``1e-4``)."""

#: per-token metrics (TRL's names), each a mean over the log interval's trained tokens (``kl``, ``entropy``,
#: ``logprob_mismatch``), or over its tokens / completions (``clip_ratio/*``: completions under sequence-level
#: ratios); ``kl`` only with ``rl.beta`` > 0
METRICS = ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
           "logprob_mismatch")


def nanstd(x: Tensor, dim: int | None = None) -> Tensor:
    """Bessel-corrected standard deviation ignoring NaNs (NaN with fewer than 2 values): TRL's ``nanstd``."""
    dims = () if dim is None else (dim,)
    mean = torch.nanmean(x, dim=dim, keepdim=True) if dims else torch.nanmean(x)
    var = torch.nanmean((x - mean) ** 2, dim=dim) if dims else torch.nanmean((x - mean) ** 2)
    count = (~torch.isnan(x)).sum(dim=dim) if dims else (~torch.isnan(x)).sum()
    var = torch.where(count > 1, var * count / (count - 1).clamp(min=1), torch.full_like(var, float("nan")))
    return var.sqrt()


def group_advantages(rewards: Tensor, num_generations: int, scale_rewards: str = "group") -> tuple[Tensor, Tensor]:
    """Group-normalised advantages of one round (module docstring).

    Args:
        rewards: ``[N]`` each completion's weighted reward sum, groups of ``num_generations`` consecutive
            completions of one prompt; NaN where no reward function scored it. The whole round, every rank's part
            in rank order (``batch`` needs the round's std).
        num_generations: ``G`` completions per prompt (divides ``N``).
        scale_rewards: ``group`` | ``batch`` | ``none``.

    Returns:
        ``(advantages [N], std_is_zero [N] bool)``: the advantages (0 where the reward is NaN), and where the std
        they were (or, for ``none``, would be) divided by is 0 (``frac_reward_zero_std``).

    Raises:
        ValueError: an unknown ``scale_rewards``, or ``N`` not a multiple of ``num_generations``.
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"rl.scale_rewards={scale_rewards!r} is not one of {list(SCALE_REWARDS)}")
    if rewards.numel() % num_generations:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of rl.num_generations={num_generations}")
    grouped = rewards.view(-1, num_generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)
    if scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    elif num_generations > 1:
        std = nanstd(grouped, dim=1).repeat_interleave(num_generations)
    else:
        std = torch.zeros_like(rewards)
    adv = rewards - mean
    if scale_rewards != "none":
        adv = adv / (std + STD_EPS)
    return torch.nan_to_num(adv, nan=0.0), torch.isclose(std, torch.zeros_like(std))


def token_logps(tail_logits: Tensor, targets: Tensor, temperature: float = 1.0,
                entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """Each tail token's log-probability under ``softmax(logits / temperature)``.

    Args:
        tail_logits: ``[B, N, V]`` (:func:`scale.loss.tail.forward_tail`); computed in float32 (float64 kept).
        targets: ``[B, N]`` the tail's token ids.
        temperature: the sampling temperature (> 0).
        entropy: also return each position's entropy (nats, detached).

    Returns:
        ``(logps [B, N], entropy [B, N] or None)``; positions outside a row's tail hold arbitrary values.
    """
    logits = tail_logits if tail_logits.dtype == torch.float64 else tail_logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, -1)
    logps = logits.gather(-1, targets[..., None]).squeeze(-1) - lse
    ent = None
    if entropy:
        with torch.no_grad():
            probs = torch.softmax(logits, -1)
            ent = lse - (probs * logits).sum(-1)
    return logps, ent


@dataclass
class TokenTerms:
    """One micro-batch's per-token terms (:func:`token_terms`).

    Attributes:
        loss: ``[B, N]`` (``[B, 1]`` under sequence-level ratios without a KL term): the per-token loss before
            masking and normalisation, with the graph.
        ratio: ``[B, N]`` or ``[B, 1]``: the importance ratio ``w`` (detached).
        kl: ``[B, N]`` the k3 KL estimate (times ``w`` under the bias correction, as TRL logs it), before
            ``beta``, detached; ``None`` at beta 0.
    """

    loss: Tensor
    ratio: Tensor
    kl: Tensor | None


def token_terms(logps: Tensor, old_logps: Tensor | None, ref_logps: Tensor | None, advantages: Tensor, mask: Tensor,
                epsilon: float = 0.2, epsilon_high: float | None = None, importance_sampling_level: str = "token",
                beta: float = 0.0, kl_bias_correction: bool = True) -> TokenTerms:
    """The clipped surrogate (+ KL) per token (module docstring); TRL 1.16 ``GRPOTrainer._compute_loss``.

    Args:
        logps: ``[B, N]`` the policy's token logps, with the graph.
        old_logps: ``[B, N]`` the round's policy (no graph), or ``None``: ``logps`` detached (ratio 1).
        ref_logps: ``[B, N]`` the reference's (no graph); needed when ``beta`` > 0.
        advantages: ``[B]``.
        mask: ``[B, N]`` 1 on trained tokens (float).
        epsilon, epsilon_high: the clip range ``[1 - epsilon, 1 + epsilon_high]`` (``epsilon_high`` None:
            ``epsilon``).
        importance_sampling_level: ``token`` | ``sequence`` (GSPO).
        beta: the KL coefficient.
        kl_bias_correction: multiply the KL by the ratio (DeepSeek-V3.2).

    Raises:
        ValueError: an unknown ``importance_sampling_level``; ``beta`` > 0 without ``ref_logps``.
    """
    high = epsilon if epsilon_high is None else epsilon_high
    old = logps.detach() if old_logps is None else old_logps.to(logps.dtype)
    log_ratio = logps - old
    if importance_sampling_level == "token":
        log_w = log_ratio
    elif importance_sampling_level == "sequence":
        log_w = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0))[:, None]
    else:
        raise ValueError(f"rl.importance_sampling_level={importance_sampling_level!r} is not one of "
                         f"{list(IMPORTANCE_LEVELS)}")
    w = torch.exp(log_w)
    A = advantages.to(logps.dtype)[:, None]
    loss = -torch.min(w * A, torch.clamp(w, 1 - epsilon, 1 + high) * A)
    kl = None
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("rl.beta > 0 needs the reference's logps")
        d = ref_logps.to(logps.dtype) - logps
        per_token_kl = torch.exp(d) - d - 1
        if kl_bias_correction:
            per_token_kl = per_token_kl * w
        kl = per_token_kl.detach()
        loss = loss + beta * per_token_kl
    return TokenTerms(loss, w.detach(), kl)


def loss_numerator(loss: Tensor, mask: Tensor, loss_type: str) -> Tensor:
    """``[]`` the micro-batch's share of the step's loss before the window's denominator: ``sum_b`` of each
    completion's token mean (``grpo``), or the masked sum of token losses (``bnpo``, ``dr_grpo``, ``dapo``).

    Raises:
        ValueError: an unknown ``loss_type``.
    """
    masked = loss * mask  # [B, N] (a [B, 1] sequence-level loss broadcasts over the tokens, as in TRL)
    if loss_type == "grpo":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum()
    if loss_type in ("bnpo", "dr_grpo", "dapo"):
        return masked.sum()
    raise ValueError(f"rl.loss_type={loss_type!r} is not one of {list(LOSS_TYPES)}")


def loss_weights(loss_type: str, mask: Tensor, max_completion_length: int, round_weight: Tensor | None) -> Tensor:
    """The micro-batch's weights, whose sum over the window (every rank) is the loss denominator (table above).

    Args:
        loss_type: ``rl.loss_type``.
        mask: ``[B, N]`` the trained tokens.
        max_completion_length: ``rl.max_completion_length`` (``dr_grpo``'s constant).
        round_weight: ``[1]``: the round's trained tokens on every rank / (``steps_per_generation`` x ranks)
            (``dapo``).

    Returns:
        float32: ``[B]`` (``grpo``, ``dr_grpo``), ``[B, N]`` (``bnpo``) or ``[1]`` (``dapo``).

    Raises:
        ValueError: an unknown ``loss_type``; ``dapo`` without ``round_weight``.
    """
    B = mask.shape[0]
    if loss_type == "grpo":
        return torch.ones(B, dtype=torch.float32, device=mask.device)
    if loss_type == "dr_grpo":
        return torch.full((B,), float(max_completion_length), dtype=torch.float32, device=mask.device)
    if loss_type == "bnpo":
        return mask.float()
    if loss_type == "dapo":
        if round_weight is None:
            raise ValueError("rl.loss_type=dapo: the batch carries no round_weight")
        return round_weight.float().reshape(1)
    raise ValueError(f"rl.loss_type={loss_type!r} is not one of {list(LOSS_TYPES)}")


def metric_sums(terms: TokenTerms, advantages: Tensor, mask: Tensor, epsilon: float, epsilon_high: float | None,
                entropy: Tensor | None, trainer_logps: Tensor, sampler_logps: Tensor | None) -> dict[str, Tensor]:
    """``[]`` sums of one micro-batch's :data:`METRICS` and their counts (``<name>/n``), detached: the meter adds
    them over the log interval and reports ``sum / n`` (TRL's ``global_masked_mean``, over the interval).

    ``clip_ratio/low_mean``: the share of ratios below ``1 - epsilon`` where ``A < 0`` (clipped from below);
    ``high_mean``: above ``1 + epsilon_high`` where ``A > 0``; ``region_mean``: either. Per token, or per completion
    under sequence-level ratios. ``logprob_mismatch``: the mean ``|sampler - trainer|`` token logp (nats) between the
    rollout's own log-probs and the trainer's forward of the same tokens (the old policy's where stored).
    """
    high = epsilon if epsilon_high is None else epsilon_high
    A = advantages[:, None]
    w = terms.ratio
    low = ((w < 1 - epsilon) & (A < 0)).to(mask.dtype)
    up = ((w > 1 + high) & (A > 0)).to(mask.dtype)
    tokens = mask.sum()
    if w.shape[1] == 1:  # sequence-level: one ratio per completion
        count = torch.tensor(float(w.shape[0]), dtype=mask.dtype, device=mask.device)
        low_s, up_s = low.sum(), up.sum()
    else:
        count = tokens
        low_s, up_s = (low * mask).sum(), (up * mask).sum()
    out = {"clip_ratio/low_mean": low_s, "clip_ratio/high_mean": up_s, "clip_ratio/region_mean": low_s + up_s}
    out |= {f"{k}/n": count for k in list(out)}
    if terms.kl is not None:
        out["kl"], out["kl/n"] = (terms.kl * mask).sum(), tokens
    if entropy is not None:
        out["entropy"], out["entropy/n"] = (entropy * mask).sum(), tokens
    if sampler_logps is not None:
        diff = (sampler_logps.to(trainer_logps.dtype) - trainer_logps.detach()).abs()
        out["logprob_mismatch"], out["logprob_mismatch/n"] = diff.masked_fill(mask == 0, 0.0).sum(), tokens
    else:  # a generator that gives no log-probs: nothing to compare (counted 0)
        out["logprob_mismatch"] = out["logprob_mismatch/n"] = torch.zeros((), dtype=mask.dtype, device=mask.device)
    return {k: v.detach().double() for k, v in out.items()}


@dataclass
class GrpoObjective:
    """``loss.objective: grpo`` on the training loop: one micro-batch of sampled completions (module docstring)
    -> its loss numerator under :meth:`weights`, and its metric sums.

    Attributes:
        loss_type: ``rl.loss_type``: grpo | dr_grpo | dapo | bnpo.
        epsilon, epsilon_high: ``rl.epsilon``, ``rl.epsilon_high`` (None: ``epsilon``).
        importance_sampling_level: ``rl.importance_sampling_level``: token | sequence.
        beta: ``rl.beta`` (0: no reference forward).
        kl_bias_correction: ``rl.kl_bias_correction``.
        temperature: ``rl.temperature``: the logps are of ``logits / temperature``.
        max_completion_length: ``rl.max_completion_length`` (``dr_grpo``'s constant).
        padding_side: ``data.padding_side``.
    """

    loss_type: str = "dapo"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    importance_sampling_level: str = "token"
    beta: float = 0.0
    kl_bias_correction: bool = True
    temperature: float = 1.0
    max_completion_length: int = 256
    padding_side: str = "left"

    name: ClassVar[str] = "grpo"

    @classmethod
    def from_config(cls, cfg: Any) -> GrpoObjective:
        """From the ``rl`` section and ``data.padding_side``."""
        rl = cfg.rl
        return cls(loss_type=rl.loss_type, epsilon=rl.epsilon, epsilon_high=rl.epsilon_high,
                   importance_sampling_level=rl.importance_sampling_level, beta=rl.beta,
                   kl_bias_correction=rl.kl_bias_correction, temperature=rl.temperature,
                   max_completion_length=rl.max_completion_length, padding_side=cfg.data.padding_side)

    @property
    def metric_names(self) -> tuple[str, ...]:
        """What :meth:`metrics` returns: each metric's sum and its count ``<name>/n`` (the meter logs
        ``train/<name>`` as their ratio over the log interval)."""
        names = [m for m in METRICS if m != "kl" or self.beta != 0.0]
        return tuple(names + [f"{m}/n" for m in names])

    @property
    def batch_keys(self) -> tuple[str, ...]:
        """What a batch must carry (:mod:`scale.training.rollouts`)."""
        return ("input_ids", "tail_mask", "loss_mask", "advantages")

    @property
    def needs_reference(self) -> bool:
        """Whether the round computes the reference's logps (``beta`` > 0)."""
        return self.beta != 0.0

    def weights(self, batch: dict[str, Tensor]) -> Tensor:
        """The micro-batch's loss weights (:func:`loss_weights`), float32."""
        return loss_weights(self.loss_type, batch["loss_mask"], self.max_completion_length, batch.get("round_weight"))

    def forward_logps(self, model: torch.nn.Module, batch: dict[str, Tensor],
                      entropy: bool = False) -> tuple[Tensor, Tensor | None]:
        """``(logps [B, N], entropy [B, N] or None)`` of the batch's completions under ``model`` (with the graph
        unless called under ``no_grad``)."""
        tail_logits, targets = scale_loss.forward_tail(model, batch, padding_side=self.padding_side, check=False)
        return token_logps(tail_logits, targets, self.temperature, entropy)

    def terms(self, logps: Tensor, batch: dict[str, Tensor]) -> TokenTerms:
        """:func:`token_terms` of ``logps`` under this objective's settings and the batch's stored logps."""
        return token_terms(logps, batch.get("old_logps"), batch.get("ref_logps"), batch["advantages"],
                           batch["loss_mask"].to(logps.dtype), self.epsilon, self.epsilon_high,
                           self.importance_sampling_level, self.beta, self.kl_bias_correction)

    def loss_and_metrics(self, model: torch.nn.Module, batch: dict[str, Tensor],
                         weights: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """``(numerator [], metric sums)`` of one micro-batch: one policy forward. ``weights`` is unused beyond
        zeroing a stand-in (all-zero weights: an exact 0 numerator and no metrics)."""
        logps, ent = self.forward_logps(model, batch, entropy=True)
        mask = batch["loss_mask"].to(logps.dtype)
        t = self.terms(logps, batch)
        num = loss_numerator(t.loss, mask, self.loss_type)
        trainer = batch.get("old_logps", logps)
        sums = metric_sums(t, batch["advantages"].to(logps.dtype), mask, self.epsilon, self.epsilon_high, ent,
                           trainer, batch.get("sampler_logps"))
        return num, sums

    def loss_step(self, model: torch.nn.Module, batch: dict[str, Tensor], weights: Tensor) -> Tensor:
        """The micro-batch's loss numerator ``[]`` (no collectives); its metric sums are kept for :meth:`metrics`."""
        num, self._metrics = self.loss_and_metrics(model, batch, weights)
        return num

    def metrics(self) -> dict[str, Tensor]:
        """The metric sums and counts of the last :meth:`loss_step` (:func:`metric_sums`)."""
        return self._metrics
