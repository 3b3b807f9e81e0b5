"""The preference losses: DPO (sigmoid, IPO, hinge), SimPO and ORPO, per pair of tails, and the metrics TRL logs for
them. Plain tensors, no accelerate; the objective that runs them in the loop is :mod:`scale.objectives.preference`.

A preference micro-batch (:class:`scale.data.tasks.preference.PairCollator`) holds ``P`` pairs as ``2P`` rows, row
``2p`` the chosen and ``2p + 1`` the rejected side of pair ``p``; each row's tail (``tail_mask``) is its completion.
Every objective here reads one number per side: the side's *summed tail log-probability*
``logp(y | x) = sum_t log pi(y_t | x, y_<t)`` over its trained tail tokens (:func:`side_logps`), and its tail length
``|y|``. Shapes: ``P`` pairs; ``[P]`` per pair; logps in nats.

The per-pair losses (``beta`` = ``loss.beta``, ``eps`` = ``loss.label_smoothing``, ``gamma`` = ``loss.simpo_gamma``):

- ``dpo``, ``loss.dpo_loss: sigmoid``: ``-(1-eps) log s(beta h) - eps log s(-beta h)``, ``h = (lc - rc) - (lr - rr)``.
  Rafailov et al. 2023, eq. 7 (arXiv:2305.18290); TRL ``DPOTrainer`` ``sigmoid``; ``eps``: conservative DPO
  (Mitchell 2023), smoothed as TRL's ``CPOTrainer`` does.
- ``dpo``, ``ipo``: ``((lc - rc)/|yc| - (lr - rr)/|yr| - 1/(2 beta))^2``. Azar et al. 2023, eq. 17
  (arXiv:2310.12036); per token as TRL's ``DPOTrainer`` (a normalisation confirmed with the IPO authors there).
- ``dpo``, ``hinge``: ``max(0, 1 - beta h)``. SLiC, Zhao et al. 2023 (arXiv:2305.10425); TRL ``hinge``.
- ``simpo``: ``-(1-eps) log s(beta (lc/|yc| - lr/|yr|) - gamma) - eps log s(-(...))``. Meng et al. 2024, eq. 6
  (arXiv:2405.14734); TRL ``CPOTrainer`` ``loss_type=simpo`` with ``cpo_alpha=0``.
- ``orpo``: ``-lc/|yc| - beta log s(log odds(yc) - log odds(yr))``, ``odds = p/(1-p)``, ``p = exp(l/|y|)``.
  Hong et al. 2024, eqs. 6-7 (arXiv:2403.07691); TRL ``ORPOTrainer.odds_ratio_loss``.

(``lc``/``lr``: policy logps of chosen/rejected; ``rc``/``rr``: the reference model's; ``s``: the logistic sigmoid.)

Metrics, with TRL's names and meanings (per pair, averaged over pairs): ``rewards/chosen`` = ``beta (lc - rc)``
(SimPO, ORPO: ``beta lc/|yc|``), ``rewards/rejected`` likewise, ``rewards/accuracies`` = chosen reward >
rejected reward, ``rewards/margins`` = their difference, ``logps/chosen``, ``logps/rejected`` = ``lc``, ``lr`` (SimPO,
ORPO: per token, as TRL logs them). TRL's ``DPOTrainer`` today applies ``label_smoothing`` to its ``robust``,
``exo_pair`` and ``aot*`` losses only; here it smooths ``sigmoid`` as the DPO paper's conservative variant and TRL's
``CPOTrainer`` do (the default 0 is TRL's ``sigmoid`` exactly). ORPO's NLL term is each pair's per-token chosen NLL
(the paper's ``L_SFT``, eq. 6); TRL's ``ORPOTrainer`` averages every token of the micro-batch's chosen rows but the
first, prompt included, which ``data.pair_conventions: trl`` reproduces
(:func:`scale.objectives.preference.orpo_trl_terms`, one forward over whole rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


DPO_LOSSES = ("sigmoid", "ipo", "hinge")
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")
"""The per-pair metrics (TRL's names); the loop logs them as ``train/<name>`` and ``eval/<name>``, means over pairs."""


@dataclass
class PairTerms:
    """One micro-batch's per-pair terms, each ``[P]``.

    Attributes:
        losses: the objective's loss of each pair (the loop sums them under the pair weights and divides by the
            window's pairs).
        chosen_rewards, rejected_rewards: the implicit rewards (see the module docstring), detached.
        chosen_logps, rejected_logps: what ``logps/*`` report: summed tail logps (DPO) or per token (SimPO, ORPO),
            detached.
    """

    losses: Tensor
    chosen_rewards: Tensor
    rejected_rewards: Tensor
    chosen_logps: Tensor
    rejected_logps: Tensor

    def columns(self) -> Tensor:
        """``[P, 7]``: each pair's loss and its :data:`METRICS`, detached."""
        c, r = self.chosen_rewards, self.rejected_rewards
        return torch.stack([self.losses.detach(), c, r, (c > r).to(c.dtype), c - r, self.chosen_logps,
                            self.rejected_logps], dim=1)

    def metrics(self, weights: Tensor) -> dict[str, Tensor]:
        """Each metric of :data:`METRICS` as the ``[]`` sum over the pairs under ``weights`` ``[P]`` (the meter divides
        by the window's pairs)."""
        sums = (self.columns()[:, 1:] * weights.to(self.losses.dtype)[:, None]).sum(0)
        return dict(zip(METRICS, sums.unbind()))

def side_logps(tail_logits: Tensor, targets: Tensor, tail_mask: Tensor) -> tuple[Tensor, Tensor]:
    """Each row's summed log-probability of its trained tail tokens, and how many there are.

    Args:
        tail_logits: ``[B, N, V]`` predictions of the tail tokens (:func:`scale.loss.tail.forward_tail`); computed in
            float32 (float64 kept).
        targets: ``[B, N]`` token ids.
        tail_mask: ``[B, N]`` 1 on trained tail tokens.

    Returns:
        ``(logps [B], lengths [B])``: ``sum_t log softmax(logits_t)[y_t]`` over the trained tokens (nats), and the
        count of trained tokens (float).
    """
    logits = tail_logits if tail_logits.dtype == torch.float64 else tail_logits.float()
    token = logits.gather(-1, targets[..., None]).squeeze(-1) - torch.logsumexp(logits, -1)   # [B, N]
    mask = tail_mask.bool()
    # Outside the tail the logits may belong to padding: mask, never multiply a possible inf/NaN by 0.
    return token.masked_fill(~mask, 0.0).sum(-1), mask.sum(-1).to(token.dtype)

def pairs_of(values: Tensor) -> tuple[Tensor, Tensor]:
    """``[2P]`` per row -> ``(chosen [P], rejected [P])``: rows ``2p`` and ``2p + 1``."""
    return values[0::2], values[1::2]

def _smoothed_sigmoid(z: Tensor, label_smoothing: float) -> Tensor:
    """``-(1 - eps) log s(z) - eps log s(-z)``: the logistic loss of a preference whose label is flipped with
    probability ``eps`` (cDPO; TRL's ``CPOTrainer``)."""
    return -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)

def dpo_loss(chosen_logps: Tensor, rejected_logps: Tensor, ref_chosen_logps: Tensor, ref_rejected_logps: Tensor,
             chosen_lengths: Tensor, rejected_lengths: Tensor, beta: float = 0.1, kind: str = "sigmoid",
             label_smoothing: float = 0.0) -> PairTerms:
    """DPO and its IPO and hinge forms (see the module docstring for the formulas and their sources).

    Args:
        chosen_logps, rejected_logps: ``[P]`` the policy's summed tail logps.
        ref_chosen_logps, ref_rejected_logps: ``[P]`` the reference model's.
        chosen_lengths, rejected_lengths: ``[P]`` tail tokens of each side (IPO normalises by them).
        beta: ``loss.beta`` (IPO: its ``tau``; hinge: ``1 / margin``).
        kind: ``loss.dpo_loss``: ``sigmoid`` | ``ipo`` | ``hinge``.
        label_smoothing: ``loss.label_smoothing`` (``sigmoid`` only), in ``[0, 0.5)``.

    Returns:
        :class:`PairTerms`; rewards ``beta (policy - reference)`` summed logps, ``logps/*`` the policy's sums.

    Raises:
        ValueError: an unknown ``kind``.
    """
    chosen_ratio = chosen_logps - ref_chosen_logps           # [P] log pi/pi_ref of the chosen answer
    rejected_ratio = rejected_logps - ref_rejected_logps
    h = chosen_ratio - rejected_ratio
    if kind == "sigmoid":
        losses = _smoothed_sigmoid(beta * h, label_smoothing)
    elif kind == "ipo":
        per_token = chosen_ratio / chosen_lengths.clamp(min=1) - rejected_ratio / rejected_lengths.clamp(min=1)
        losses = (per_token - 1 / (2 * beta)) ** 2
    elif kind == "hinge":
        losses = torch.relu(1 - beta * h)
    else:
        raise ValueError(f"loss.dpo_loss={kind!r} is not one of {list(DPO_LOSSES)}")
    return PairTerms(losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach(), chosen_logps.detach(),
                     rejected_logps.detach())

def simpo_loss(chosen_logps: Tensor, rejected_logps: Tensor, chosen_lengths: Tensor, rejected_lengths: Tensor,
               beta: float = 2.0, gamma: float = 0.5, label_smoothing: float = 0.0) -> PairTerms:
    """SimPO: reference-free, on per-token logps, with a target margin ``gamma`` (module docstring).

    Args:
        chosen_logps, rejected_logps: ``[P]`` the policy's summed tail logps.
        chosen_lengths, rejected_lengths: ``[P]`` tail tokens of each side.
        beta: ``loss.beta`` (SimPO's paper uses 2 to 2.5).
        gamma: ``loss.simpo_gamma``, the target reward margin (nats x beta); TRL's ``simpo_gamma``.
        label_smoothing: ``loss.label_smoothing``.

    Returns:
        :class:`PairTerms`; rewards ``beta x`` per-token logps, ``logps/*`` per token.
    """
    chosen = chosen_logps / chosen_lengths.clamp(min=1)
    rejected = rejected_logps / rejected_lengths.clamp(min=1)
    # TRL: logits = (chosen - rejected) - gamma / beta, loss on beta * logits: beta (chosen - rejected) - gamma.
    losses = _smoothed_sigmoid(beta * (chosen - rejected) - gamma, label_smoothing)
    return PairTerms(losses, beta * chosen.detach(), beta * rejected.detach(), chosen.detach(), rejected.detach())

def log1mexp(x: Tensor) -> Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, accurate at both ends (Maechler 2012: ``log(-expm1(x))`` near 0,
    ``log1p(-exp(x))`` below ``-log 2``)."""
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))

def orpo_loss(chosen_logps: Tensor, rejected_logps: Tensor, chosen_lengths: Tensor, rejected_lengths: Tensor,
              beta: float = 0.1, nll: Tensor | None = None) -> PairTerms:
    """ORPO: the chosen answer's NLL plus ``beta`` times the odds-ratio loss, reference-free (module docstring).

    Args:
        chosen_logps, rejected_logps: ``[P]`` the policy's summed tail logps.
        chosen_lengths, rejected_lengths: ``[P]`` tail tokens of each side.
        beta: ``loss.beta``: ORPO's ``lambda`` (TRL's ``beta``, default 0.1).
        nll: ``[]`` or ``[P]``, the NLL term in place of each pair's per-token chosen NLL (``data.pair_conventions:
            trl``: TRL's, every token of the micro-batch's chosen rows but the first, pooled); ``None``: the pair's.

    Returns:
        :class:`PairTerms`; rewards ``beta x`` per-token logps, ``logps/*`` per token.
    """
    chosen = chosen_logps / chosen_lengths.clamp(min=1)      # log P(y|x) per token, < 0
    rejected = rejected_logps / rejected_lengths.clamp(min=1)
    # log odds(y) = log p - log(1 - p); TRL odds_ratio_loss
    log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
    losses = (-chosen if nll is None else nll.expand_as(chosen)) - beta * F.logsigmoid(log_odds)
    return PairTerms(losses, beta * chosen.detach(), beta * rejected.detach(), chosen.detach(), rejected.detach())
