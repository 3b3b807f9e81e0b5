"""Preference objectives on the training loop: DPO (sigmoid, IPO, hinge), SimPO and ORPO on pairs of tails
(:class:`PreferenceObjective`), with their reference model. The per-pair losses, their formulas and sources
are :mod:`scale.objectives.pair_losses`. Plain tensors, no accelerate. ORPO under ``data.pair_conventions: trl``
takes TRL's NLL term over whole rows (:func:`orpo_trl_terms`, one forward: :func:`whole_row_logps`).

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

**A second copy** (``loss.reference: model``, full fine-tunes, which have no adapter to switch off): a frozen copy
of the starting weights, loaded and wrapped by the run (:mod:`scale.distributed.frozen`), set as
:attr:`PreferenceObjective.reference_model`; this module only calls it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor

from scale.loss.tail import forward_tail
from scale.objectives.pair_losses import METRICS, PairTerms, dpo_loss, orpo_loss, pairs_of, side_logps, simpo_loss

OBJECTIVES = ("dpo", "simpo", "orpo")
REFERENCES = ("adapter", "precomputed")
REFERENCE_ADAPTER = "reference"
"""Name of the frozen copy of a starting adapter that is the DPO reference (:func:`add_reference_adapter`)."""


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


def has_adapter(model: torch.nn.Module) -> bool:
    """Whether ``model`` (unwrapped or not) holds a peft adapter that :func:`reference_mode` can switch off."""
    return _peft_model(model) is not None


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


def whole_row_mask(batch: dict[str, Tensor]) -> Tensor:
    """``[B, W]`` right-aligned 1s on every token of each row but its first (every token a causal LM predicts),
    ``W`` the longest row's length - 1: a ``tail_mask`` that scores whole rows.

    ``W`` is the padded width - 1 for a padded batch; a padding-free batch (``seq_lens``) reads its longest row on
    the host (one read per micro-batch)."""
    if "seq_lens" in batch:
        lengths = batch["seq_lens"]
        W = int(lengths.max()) - 1  # host read: a packed row has no padded width
    else:
        lengths = batch["attention_mask"].sum(-1)
        W = batch["input_ids"].shape[1] - 1
    cols = torch.arange(W, device=lengths.device)
    return (cols[None, :] >= W - (lengths[:, None] - 1)).to(batch["tail_mask"].dtype)


def whole_row_logps(model: torch.nn.Module, batch: dict[str, Tensor],
                    padding_side: str = "left") -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One forward scoring every token of a pair batch's rows (TRL's ORPO NLL needs the prompt's too).

    Returns:
        ``(logps [2P], lengths [2P], row_logps [2P], row_tokens [2P])``: :func:`tail_logps`'s summed tail logps and
        tail lengths, and each row's summed logps of all its tokens but the first and their count (float).
    """
    wide = whole_row_mask(batch)
    logits, targets = forward_tail(model, {**batch, "tail_mask": wide}, padding_side=padding_side, check=False)
    logits = logits if logits.dtype == torch.float64 else logits.float()
    token = logits.gather(-1, targets[..., None]).squeeze(-1) - torch.logsumexp(logits, -1)     # [2P, W]
    W, N = wide.shape[1], batch["tail_mask"].shape[1]
    tail, rows = batch["tail_mask"].bool(), wide.bool()
    return (token[:, W - N:].masked_fill(~tail, 0.0).sum(-1), tail.sum(-1).to(token.dtype),
            token.masked_fill(~rows, 0.0).sum(-1), rows.sum(-1).to(token.dtype))


def orpo_trl_terms(model: torch.nn.Module, batch: dict[str, Tensor], beta: float = 0.1,
                   padding_side: str = "left") -> PairTerms:
    """ORPO as TRL 1.16's ``ORPOTrainer`` computes it (``data.pair_conventions: trl``): its NLL term is the
    cross-entropy of *every* token of the micro-batch's chosen rows but the first (prompt included), averaged over
    all of them at once (``concatenated_forward``: ``nn.CrossEntropyLoss`` over the chosen half), the same for each
    pair; the odds-ratio term is :func:`scale.objectives.pair_losses.orpo_loss`'s. Summed over the pairs, a
    micro-batch of ``P`` pairs adds ``P`` times its pooled NLL: the step's loss is TRL's (the mean of its
    micro-batches' losses) when the micro-batches hold as many pairs each, and depends on how the pairs are grouped
    into micro-batches, as TRL's does.

    Returns:
        :class:`PairTerms` (``losses[p]`` = pooled NLL - ``beta log s(log odds ratio_p)``).
    """
    logps, lengths, row_logps, row_tokens = whole_row_logps(model, batch, padding_side)
    (lc, lr), (nc, nr) = pairs_of(logps), pairs_of(lengths)
    nll = -row_logps[0::2].sum() / row_tokens[0::2].sum().clamp(min=1)
    return orpo_loss(lc, lr, nc, nr, beta, nll=nll)


def tail_logps(model: torch.nn.Module, batch: dict[str, Tensor], padding_side: str = "left") -> tuple[Tensor, Tensor]:
    """``(logps [2P], lengths [2P])`` of a pair batch's rows under ``model`` (:func:`side_logps` of
    :func:`scale.loss.tail.forward_tail`): padded, padding-free or packed."""
    tail_logits, targets = forward_tail(model, batch, padding_side=padding_side, check=False)
    return side_logps(tail_logits, targets, batch["tail_mask"])


def reference_forward(model: torch.nn.Module, batch: dict[str, Tensor], padding_side: str = "left",
                      frozen: torch.nn.Module | None = None) -> Tensor:
    """``[2P]`` the reference's summed tail logps of a pair batch, float32 (float64 for float64 logits), no graph
    kept: ``frozen`` (``loss.reference: model``, a full run's frozen copy of the starting weights, already in eval
    mode and wrapped for the launch mode; this module only calls it) when given, else ``model`` under
    :func:`reference_mode`."""
    if frozen is not None:
        with torch.no_grad():
            return tail_logps(frozen, batch, padding_side)[0].detach()
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
        reference: ``loss.reference``: ``adapter`` (in the step) | ``model`` (in the step: ``reference_model``) |
            ``precomputed`` (``dpo`` only).
        padding_side: ``data.padding_side``.
        conventions: ``data.pair_conventions``: ``trl`` gives ORPO TRL's NLL term (:func:`orpo_trl_terms`).
        reference_model: ``loss.reference: model``: the frozen copy of the starting weights, set by the run once it
            is built and wrapped (:mod:`scale.distributed.frozen`); None: the policy under :func:`reference_mode`.
    """

    name: str = "dpo"
    beta: float = 0.1
    dpo_loss: str = "sigmoid"
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    reference: str = "adapter"
    padding_side: str = "left"
    conventions: str = "scale"
    reference_model: torch.nn.Module | None = field(default=None, repr=False, compare=False)

    #: what :meth:`metrics` returns, in order (the meter logs ``train/<name>``)
    metric_names: ClassVar[tuple[str, ...]] = METRICS

    @classmethod
    def from_config(cls, cfg: Any) -> PreferenceObjective:
        """From the ``loss`` section (``loss.objective`` one of :data:`OBJECTIVES`) and ``data.padding_side``."""
        loss = cfg.loss
        return cls(name=loss.objective, beta=loss.beta, dpo_loss=loss.dpo_loss, label_smoothing=loss.label_smoothing,
                   simpo_gamma=loss.simpo_gamma, reference=loss.reference, padding_side=cfg.data.padding_side,
                   conventions=cfg.data.pair_conventions)

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
        if self.name == "orpo" and self.conventions == "trl":
            return orpo_trl_terms(model, batch, self.beta, self.padding_side)
        logps, lengths = tail_logps(model, batch, self.padding_side)
        (lc, lr), (nc, nr) = pairs_of(logps), pairs_of(lengths)
        if self.name == "simpo":
            return simpo_loss(lc, lr, nc, nr, self.beta, self.simpo_gamma, self.label_smoothing)
        if self.name == "orpo":
            return orpo_loss(lc, lr, nc, nr, self.beta)
        ref = (batch["ref_logps"] if self.needs_reference_pass else
               reference_forward(model, batch, self.padding_side, self.reference_model))
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
        ref = (reference_forward(model, batch, self.padding_side, self.reference_model).to(logps.dtype)
               if self.needs_reference else None)
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
