"""Preference objectives: DPO (sigmoid, IPO, hinge), SimPO and ORPO, on pairs of tails. Plain tensors, no accelerate.

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
(the paper's ``L_SFT``, eq. 6), where TRL averages tokens over the micro-batch: equal when the chosen tails have
one length.

**Dropout.** A policy forward that draws dropout masks scores each side with noise, and a reference under other
masks than the policy's makes a step's rewards noise even where the policy still equals its reference (TRL:
``disable_dropout``, huggingface/trl#2042). Under these objectives ``model.disable_dropout`` (null) is true: every
dropout of the model and LoRA's are off (:func:`scale.modeling.dropout.disable_dropout`), so policy == reference gives
rewards of exactly 0. The reference always runs in eval mode (:func:`reference_mode`), without masks.

**The reference without a second copy** (DPO): the same model, run under ``torch.no_grad`` in eval mode in the
same step (:func:`reference_forward`): with its LoRA adapter disabled (peft's ``disable_adapter()``: the base
model), or, when the run starts from an adapter (an SFT run's), with that adapter's frozen copy, the peft adapter
named :data:`REFERENCE_ADAPTER` (:func:`add_reference_adapter`, as TRL's ``DPOTrainer`` keeps its ``ref`` adapter). Or
precomputed (``loss.reference: precomputed``): one pass before training (:func:`reference_logps`) stores every pair's
reference logps, and the step runs the policy only (the batch's ``ref_logps``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from scale.loss.tail import forward_tail

OBJECTIVES = ("dpo", "simpo", "orpo")
DPO_LOSSES = ("sigmoid", "ipo", "hinge")
REFERENCES = ("adapter", "precomputed")
REFERENCE_ADAPTER = "reference"
"""Name of the frozen copy of a starting adapter that is the DPO reference (:func:`add_reference_adapter`)."""
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
              beta: float = 0.1) -> PairTerms:
    """ORPO: the chosen answer's NLL plus ``beta`` times the odds-ratio loss, reference-free (module docstring).

    Args:
        chosen_logps, rejected_logps: ``[P]`` the policy's summed tail logps.
        chosen_lengths, rejected_lengths: ``[P]`` tail tokens of each side.
        beta: ``loss.beta``: ORPO's ``lambda`` (TRL's ``beta``, default 0.1).

    Returns:
        :class:`PairTerms`; rewards ``beta x`` per-token logps, ``logps/*`` per token.
    """
    chosen = chosen_logps / chosen_lengths.clamp(min=1)      # log P(y|x) per token, < 0
    rejected = rejected_logps / rejected_lengths.clamp(min=1)
    # log odds(y) = log p - log(1 - p); TRL odds_ratio_loss
    log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
    losses = -chosen - beta * F.logsigmoid(log_odds)
    return PairTerms(losses, beta * chosen.detach(), beta * rejected.detach(), chosen.detach(), rejected.detach())


def _peft_model(model: torch.nn.Module) -> Any:
    """The peft ``PeftModel`` inside ``model`` (unwrapped from DDP / DeepSpeed / compile wrappers), or ``None``."""
    seen = model
    for _ in range(8):
        if hasattr(seen, "disable_adapter") and hasattr(seen, "peft_config"):
            return seen
        inner = getattr(seen, "module", None) or getattr(seen, "_orig_mod", None)
        if inner is None:
            return None
        seen = inner
    return None


@contextlib.contextmanager
def reference_mode(model: torch.nn.Module) -> Iterator[None]:
    """Run ``model`` as the DPO reference inside the block: the frozen :data:`REFERENCE_ADAPTER` when the model has
    one, else with its adapters disabled (the base model), under ``torch.no_grad`` and in eval mode: the reference
    draws no dropout masks whatever ``model.disable_dropout`` says, as the precomputed pass (which runs in eval
    mode) computes it, so an in-step and a precomputed reference agree. (TRL's ``DPOTrainer`` runs its reference
    in the policy's mode: with ``disable_dropout=False`` its reference draws masks.) The mode is restored after.

    Raises:
        ValueError: ``model`` holds no peft adapter (a full fine-tune needs ``loss.reference: precomputed``).
    """
    peft_model = _peft_model(model)
    if peft_model is None:
        raise ValueError("the in-step DPO reference is the model without its LoRA adapter, and this model has none; "
                         "set loss.reference=precomputed")
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            if REFERENCE_ADAPTER in peft_model.peft_config:
                previous = peft_model.active_adapter
                peft_model.set_adapter(REFERENCE_ADAPTER)
                try:
                    yield
                finally:
                    peft_model.set_adapter(previous)
            else:
                with peft_model.disable_adapter():
                    yield
    finally:
        model.train(was_training)


def add_reference_adapter(model: torch.nn.Module) -> None:
    """Keep a frozen copy of the model's (starting) ``default`` adapter as :data:`REFERENCE_ADAPTER`: the DPO
    reference of a run that continues an adapter (TRL's ``DPOTrainer`` does the same with its ``ref`` adapter).

    Raises:
        ValueError: ``model`` holds no peft adapter.
    """
    peft_model = _peft_model(model)
    if peft_model is None:
        raise ValueError("add_reference_adapter needs a peft model")
    peft_model.add_adapter(REFERENCE_ADAPTER, peft_model.peft_config["default"])
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if ".default." in name:
                ref = peft_model.get_parameter(name.replace(".default.", f".{REFERENCE_ADAPTER}."))
                ref.copy_(param)
                ref.requires_grad_(False)
    peft_model.set_adapter("default")


def tail_logps(model: torch.nn.Module, batch: dict[str, Tensor], padding_side: str = "left") -> tuple[Tensor, Tensor]:
    """``(logps [2P], lengths [2P])`` of a pair batch's rows under ``model`` (:func:`side_logps` of
    :func:`scale.loss.tail.forward_tail`): padded, padding-free or packed."""
    tail_logits, targets = forward_tail(model, batch, padding_side=padding_side, check=False)
    return side_logps(tail_logits, targets, batch["tail_mask"])


def reference_forward(model: torch.nn.Module, batch: dict[str, Tensor], padding_side: str = "left") -> Tensor:
    """``[2P]`` the reference's summed tail logps of a pair batch, float32 (float64 for float64 logits), computed
    under :func:`reference_mode` (no graph kept)."""
    with reference_mode(model):
        logps, _ = tail_logps(model, batch, padding_side)
    return logps.detach()


def reference_logps(model: torch.nn.Module, batches: Any, padding_side: str = "left",
                    starting_adapter: bool = False) -> Tensor:
    """The reference pass before training (``loss.reference: precomputed``): every pair's reference logps.

    Args:
        model: the policy model as training starts, before any step and before a resumed checkpoint is loaded.
        batches: the split's pair batches in split order (:class:`scale.data.tasks.preference.PairCollator` over
            :class:`scale.data.tasks.preference.PairedExamples` without ``ref_logps``, unshuffled).
        starting_adapter: the reference is the adapter the run starts from (``model.adapter``): the model runs as it
            is (under ``no_grad``), which before the first step is that adapter; otherwise as :func:`reference_mode`
            runs it (adapters disabled: the base model).

    Returns:
        ``[2 x pairs]`` float64 on the CPU, example order (``2p`` chosen, ``2p + 1`` rejected): what
        :class:`scale.data.tasks.preference.PairedExamples` takes as ``ref_logps``.
    """
    was_training = model.training
    model.eval()
    try:
        if starting_adapter:
            with torch.no_grad():
                out = [tail_logps(model, b, padding_side)[0].detach().double().cpu() for b in batches]
        else:
            out = [reference_forward(model, b, padding_side).double().cpu() for b in batches]
    finally:
        model.train(was_training)
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)


@dataclass
class PreferenceObjective:
    """A preference objective on the training loop (``loss.objective``: ``dpo`` | ``simpo`` | ``orpo``).

    The loss of a micro-batch is the sum of its pairs' losses under the pair weights (:meth:`weights`: one per pair),
    so the loop's window denominator counts pairs over the whole window and every rank, and the step's loss is
    the mean pair loss of the global batch, whatever the split into micro-batches and ranks.

    Attributes:
        name: ``loss.objective``.
        beta: ``loss.beta``.
        dpo_loss: ``loss.dpo_loss`` (``dpo`` only).
        label_smoothing: ``loss.label_smoothing``.
        simpo_gamma: ``loss.simpo_gamma``.
        reference: ``loss.reference``: ``adapter`` (in the step) | ``precomputed`` (``dpo`` only).
        padding_side: ``data.padding_side``.
    """

    name: str = "dpo"
    beta: float = 0.1
    dpo_loss: str = "sigmoid"
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    reference: str = "adapter"
    padding_side: str = "left"

    #: what :meth:`metrics` returns, in order (the meter logs ``train/<name>``)
    metric_names: ClassVar[tuple[str, ...]] = METRICS

    @classmethod
    def from_config(cls, cfg: Any) -> PreferenceObjective:
        """From the ``loss`` section (``loss.objective`` one of :data:`OBJECTIVES`) and ``data.padding_side``."""
        loss = cfg.loss
        return cls(name=loss.objective, beta=loss.beta, dpo_loss=loss.dpo_loss, label_smoothing=loss.label_smoothing,
                   simpo_gamma=loss.simpo_gamma, reference=loss.reference, padding_side=cfg.data.padding_side)

    @property
    def batch_keys(self) -> tuple[str, ...]:
        """What a batch must carry: the rows (padded or padding-free), ``tail_mask``, ``pair_row`` (and
        ``ref_logps`` with precomputed references)."""
        return ("input_ids", "tail_mask", "pair_row") + (("ref_logps",) if self.needs_reference_pass else ())

    @property
    def needs_reference(self) -> bool:
        return self.name == "dpo"

    @property
    def needs_reference_pass(self) -> bool:
        """Whether a pass over the data before training computes the reference logps."""
        return self.needs_reference and self.reference == "precomputed"

    def weights(self, batch: dict[str, Tensor]) -> Tensor:
        """``[P]`` float32 ones: each pair counts once in the window's denominator."""
        return torch.ones(batch["pair_row"].shape[0], dtype=torch.float32, device=batch["pair_row"].device)

    def terms(self, model: torch.nn.Module, batch: dict[str, Tensor]) -> PairTerms:
        """The micro-batch's :class:`PairTerms`: one policy forward over its ``2P`` rows (and, for DPO with the
        in-step reference, one forward of the reference under ``no_grad``)."""
        logps, lengths = tail_logps(model, batch, self.padding_side)
        (lc, lr), (nc, nr) = pairs_of(logps), pairs_of(lengths)
        if self.name == "simpo":
            return simpo_loss(lc, lr, nc, nr, self.beta, self.simpo_gamma, self.label_smoothing)
        if self.name == "orpo":
            return orpo_loss(lc, lr, nc, nr, self.beta)
        ref = batch["ref_logps"] if self.needs_reference_pass else reference_forward(model, batch, self.padding_side)
        rc, rr = pairs_of(ref.to(logps.dtype))
        return dpo_loss(lc, lr, rc, rr, nc, nr, self.beta, self.dpo_loss, self.label_smoothing)

    def eval_columns(self, model: torch.nn.Module, batch: dict[str, Tensor]) -> Tensor:
        """``[P, 7]`` per held-out pair: its loss and :data:`METRICS` (:meth:`PairTerms.columns`), for the
        evaluation's table (one row per pair: what ``gather_for_metrics`` de-duplicates)."""
        return self.terms(model, batch).columns()

    @staticmethod
    def eval_summary(sums: list[float], n: int) -> dict[str, float]:
        """``eval/loss`` (mean pair loss), ``eval/<metric>`` (means over the ``n`` pairs) and ``eval/pairs`` from
        the column sums of :meth:`eval_columns` over the split."""
        return {"eval/loss": sums[0] / n, **{f"eval/{k}": v / n for k, v in zip(METRICS, sums[1:])},
                "eval/pairs": n}

    def loss_step(self, model: torch.nn.Module, batch: dict[str, Tensor], weights: Tensor) -> Tensor:
        """The micro-batch's loss numerator ``[]``: ``sum_p weights[p] x loss_p`` (no collectives); its metric sums
        are kept for :meth:`metrics`."""
        num, self._metrics = self.loss_and_metrics(model, batch, weights)
        return num

    def metrics(self) -> dict[str, Tensor]:
        """The :data:`METRICS` sums (``[]`` each, under the pair weights) of the last :meth:`loss_step`: what the
        loop's meter adds up and divides by the pairs of the log interval."""
        return self._metrics

    @torch.no_grad()
    def pair_scores(self, model: torch.nn.Module, batch: dict[str, Tensor]) -> list[dict[str, Any]]:
        """What ``samples.jsonl`` shows of each pair of ``batch`` beside the policy's answer, as Python floats: the
        policy's summed tail logps of chosen and rejected (nats) and, for DPO, the reference's (always the in-step
        reference, :func:`reference_forward`: the same numbers a precomputed pass stores), the objective's rewards
        (module docstring: ``beta (policy - reference)`` for DPO, ``beta x`` per-token logps for SimPO and ORPO)
        and their margin, and each side's tail tokens. Under ``no_grad``; ``model`` as given (train or eval mode).

        Returns:
            One dict per pair: ``logps`` (``policy``, and ``reference`` for DPO: ``{chosen, rejected}``),
            ``rewards`` (``chosen``, ``rejected``, ``margin``), ``tokens`` (``chosen``, ``rejected``).
        """
        logps, lengths = tail_logps(model, batch, self.padding_side)
        (lc, lr), (nc, nr) = pairs_of(logps), pairs_of(lengths)
        ref = reference_forward(model, batch, self.padding_side).to(logps.dtype) if self.needs_reference else None
        if self.name == "simpo":
            terms = simpo_loss(lc, lr, nc, nr, self.beta, self.simpo_gamma, self.label_smoothing)
        elif self.name == "orpo":
            terms = orpo_loss(lc, lr, nc, nr, self.beta)
        else:
            rc, rr = pairs_of(ref)
            terms = dpo_loss(lc, lr, rc, rr, nc, nr, self.beta, self.dpo_loss, self.label_smoothing)
        out = []
        for p in range(lc.shape[0]):
            c, r = float(terms.chosen_rewards[p]), float(terms.rejected_rewards[p])  # host sync (samples only)
            side = {"policy": {"chosen": float(lc[p]), "rejected": float(lr[p])}}
            if ref is not None:
                side["reference"] = {"chosen": float(ref[2 * p]), "rejected": float(ref[2 * p + 1])}
            out.append({"logps": side, "rewards": {"chosen": c, "rejected": r, "margin": c - r},
                        "tokens": {"chosen": int(nc[p]), "rejected": int(nr[p])}})
        return out

    def loss_and_metrics(self, model: torch.nn.Module, batch: dict[str, Tensor],
                         weights: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """``(numerator [], metric sums)``: :meth:`loss_step` and :meth:`PairTerms.metrics` of one forward."""
        t = self.terms(model, batch)
        return (t.losses * weights.to(t.losses.dtype)).sum(), t.metrics(weights)
