"""The preference part of a run (``loss.objective``: dpo | simpo | orpo on ``data.format: preference`` pairs): the
objective and the data checked together, the starting adapter's frozen copy as the DPO reference, a full run's
frozen copy of the starting weights (``loss.reference: model``; GRPO's KL reference too), and the reference pass of
``loss.reference: precomputed``. The pair loaders are :mod:`scale.training.parts.loaders`'s.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from torch.utils.data import DataLoader

from scale.config.schema import Config
from scale.data.collate import Collator
from scale.data.order import PackedRows
from scale.data.tasks.preference import PairCollator, PairedExamples
from scale.data.token_table import Reordered
from scale.data.tokenize import Splits
from scale.distributed.frozen import frozen_elements, wrap_frozen
from scale.modeling.dropout import disable_dropout
from scale.modeling.finetune import frozen_reference_key, weights_plan
from scale.objectives.preference import PreferenceObjective, add_reference_adapter, reference_logps
from scale.training.parts.launch import Launch
from scale.training.parts.model import load_run_model, shape_forward

logger = get_logger(__name__)


def keep_reference(cfg: Config, model: torch.nn.Module, objective: Any) -> None:
    """With ``model.adapter`` under DPO's in-step reference (or GRPO's KL term, ``rl.beta`` > 0), keep the starting
    adapter's frozen copy as the reference (:func:`scale.objectives.preference.add_reference_adapter`, as TRL keeps
    its ``ref`` adapter); before the optimizer sees the model."""
    in_step = getattr(objective, "reference", "adapter") == "adapter"  # DPO's precomputed references need no copy
    if getattr(objective, "needs_reference", False) and in_step and cfg.model.adapter is not None:
        add_reference_adapter(model)


def load_frozen_reference(launch: Launch, cfg: Config, vocab_size: int) -> torch.nn.Module | None:
    """A full run's reference (:func:`frozen_reference_key`): the starting weights loaded again from
    ``model.name_or_path`` by the policy's own path (:func:`scale.training.parts.model.load_run_model`; ``tiny-llama``
    from ``train.seed``), every parameter frozen, dropout off, eval mode, no gradient checkpointing, the policy's
    forward changes (:func:`scale.training.parts.model.shape_forward`). Before ``prepare``; wrapped after it by
    :func:`wrap_reference`. None when the run keeps none. Collective."""
    if frozen_reference_key(cfg) is None:
        return None
    again = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, gradient_checkpointing=False))
    ref = load_run_model(launch, again, vocab_size)  # collective
    ref.requires_grad_(False)
    disable_dropout(ref)
    shape_forward(launch, cfg, ref)
    return ref.eval()


def wrap_reference(launch: Launch, cfg: Config, ref: torch.nn.Module | None) -> torch.nn.Module | None:
    """:func:`load_frozen_reference`'s model wrapped for the launch mode (:func:`scale.distributed.frozen.wrap_frozen`:
    ZeRO-3 and FSDP2 partition it 1/N, the other modes hold it whole; never saved), after the policy's
    ``prepare``, with its start-up line. Collective."""
    if ref is None:
        return None
    acc, mode = launch.acc, launch.plan.mode
    wrapped = wrap_frozen(acc, ref)  # collective
    local, whole = frozen_elements(wrapped)
    dtype = weights_plan(cfg, mode).module_dtype
    logger.info("reference (%s): a frozen copy of the starting weights, %s forward, %d of its %d elements on this "
                "rank (%s%s); rebuilt from model.name_or_path, never in checkpoints", frozen_reference_key(cfg),
                dtype, local, whole, mode, ": partitioned" if launch.plan.partitioned else ": whole",
                main_process_only=True)
    return wrapped


def precompute_references(acc: Accelerator, cfg: Config, model: torch.nn.Module, objective: Any, splits: Splits,
                          pad_token_id: int, loaders: list[DataLoader]) -> None:
    """``loss.reference: precomputed``: the reference logps of every train and eval pair, from one pass of the
    (prepared) model as training starts, set on the loaders' :class:`PairedExamples` so every batch carries them.

    Collective under ZeRO-3: every rank runs the whole pass in the same batches. The result is kept in
    ``<output_dir>/reference_logps.pt`` under the key of the token cache (the token fingerprint of both splits) and
    of the model (``model.*``), so a resumed run reads it instead of a second pass.
    """
    if not (isinstance(objective, PreferenceObjective) and objective.needs_reference_pass):
        return
    key = hashlib.sha256(repr((splits.fingerprint, cfg.model.name_or_path, cfg.model.adapter, cfg.model.dtype,
                               cfg.model.quantize_4bit, cfg.train.seed)
                              + ((cfg.model.finetune,) if cfg.model.finetune != "lora" else ())).encode()).hexdigest()
    path = Path(cfg.output_dir) / "reference_logps.pt"
    stored = torch.load(path) if path.is_file() else None
    if stored is None or stored.get("key") != key:
        collate = PairCollator(Collator(pad_token_id, cfg.data.padding_side))
        refs = {}
        for name, split in (("train", splits.train), ("eval", splits.eval)):
            dl = DataLoader(PairedExamples(split), batch_size=cfg.train.eval_micro_batch_size, collate_fn=collate)
            as_is = cfg.model.adapter is not None or cfg.model.finetune == "full"  # the starting weights themselves
            refs[name] = reference_logps(model, ({k: v.to(acc.device) for k, v in b.items()} for b in dl),
                                         cfg.data.padding_side, starting_adapter=as_is)
        stored = {"key": key, **refs}
        if acc.is_main_process:
            Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
            torch.save(stored, path)
            logger.info("reference pass: %d train and %d eval pairs (loss.reference=precomputed) -> %s",
                        len(refs["train"]) // 2, len(refs["eval"]) // 2, path, main_process_only=True)
    for dl, name in zip(loaders, ("train", "eval")):
        pairs_of_loader(dl.dataset).ref_logps = stored[name]


def pairs_of_loader(dataset: Any) -> PairedExamples:
    """The :class:`PairedExamples` under a pair loader's dataset: itself, the split an evaluation order
    (:class:`Reordered`) views, or the pairs that ``data.packing``'s bins (:class:`PackedRows`) hold."""
    if isinstance(dataset, Reordered):
        return dataset.base
    if isinstance(dataset, PackedRows):
        return dataset.rows
    return dataset
