"""The data part: the tokenizer and the token cache's splits, prepared by one process and read by the others. What is
on this machine (the built-in tiny-llama, an embedded asset, a directory) every rank reads at once, once the main
process has prepared it; a hub id (a download) is loaded on the main process first. Collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from scale.config.schema import Config
from scale.config.validation import ConfigError
from scale.data.cache import load_splits, wait_for_splits
from scale.data.mixing import sources as mixture_sources
from scale.data.read import DataError
from scale.data.token_table import column
from scale.data.tokenize import Splits, check_objective_fits
from scale.distributed.collective import main_process_first, on_every_rank, shared_run_id
from scale.modeling.build import TINY, load_tokenizer, tokenizer_source
from scale.training.parts.launch import Launch
from scale.utils.assets import EMBEDDED_MODEL, resolve_data, resolve_model


@dataclass
class Data:
    """What the data part built.

    Attributes:
        tokenizer: the run's tokenizer (``model.tokenizer``, else the model's).
        path: the data file the splits were read from (``data.path`` resolved; a mixture's ``data.path``).
        splits: the token cache's train and eval splits (:class:`scale.data.tokenize.Splits`).
    """

    tokenizer: Any
    path: str
    splits: Splits


def build_data(launch: Launch, cfg: Config) -> Data:
    """The tokenizer and the splits, on every rank. Collective.

    One process prepares the cached assets, the others then read them; an error there stops every rank. The token
    cache: the node's main process finds or builds it (``build_splits`` inside) while the other ranks poll its
    build record: no collective is open during a build of any length. Then the ranks agree. ``loss.objective`` is
    checked against the splits' format (:func:`scale.data.tokenize.check_objective_fits`): a build checks it before
    tokenizing, a cache hit here.

    Raises:
        DataError, ConfigError: bad data or config (an objective the format does not train), on every rank.
    """
    acc = launch.acc
    tokenizer_here = on_this_machine(tokenizer_source(cfg.model))
    model_here = on_this_machine(cfg.model.name_or_path)
    together = launch.plan.mode == "zero3"  # from_pretrained under ZeRO-3 runs collectives: every rank loads at once

    def assets() -> tuple[Any, str]:
        tokenizer = None if tokenizer_here else load_tokenizer(cfg.model)
        if tokenizer_here:
            resolve_model(tokenizer_source(cfg.model))  # an embedded asset, prepared once
        if model_here or together:
            resolve_model(cfg.model.name_or_path)  # the asset (SmolLM2's conversion), prepared once
        if cfg.data.datasets:  # data.path is not read; the sources' embedded names are prepared
            mixture_sources(cfg.data)
            return tokenizer, cfg.data.path
        return tokenizer, resolve_data(cfg.data.path)

    run_id = shared_run_id(acc)  # collective
    tokenizer, data_path = main_process_first(acc, assets)  # collective
    if tokenizer is None:
        tokenizer = on_every_rank(acc, lambda: load_tokenizer(cfg.model))  # collective
    splits = on_every_rank(acc, lambda: load_splits(cfg, tokenizer, data_path, run_id) if acc.is_local_main_process
                           else wait_for_splits(cfg, tokenizer, data_path, run_id))  # collective, after the build
    check_objective_fits(cfg.loss, splits.task)  # a cache hit's splits were not checked as they were built
    return Data(tokenizer, data_path, splits)


def on_this_machine(name_or_path: str) -> bool:
    """Whether a model or tokenizer source is read from this machine, not downloaded: the built-in ``tiny-llama``,
    an embedded asset (:func:`scale.utils.assets.resolve_model`) or a directory. Every rank then loads it at once."""
    return name_or_path in (TINY, EMBEDDED_MODEL) or Path(name_or_path).is_dir()


def check_type_weights(cfg: Config, splits: Splits) -> None:
    """Every row's type id has a weight in ``loss.type_weights``, before anything is written.

    Raises:
        ConfigError: classification without ``data.type_column`` (the label index is the type id) and fewer
            weights than labels.
        DataError: a row whose type id has no weight (names the row).
    """
    weights = cfg.loss.type_weights
    if weights is None:
        return
    labels = cfg.data.labels
    if splits.types_are_labels and cfg.data.type_column is None and len(weights) < len(labels):
        raise ConfigError(f"loss.type_weights={weights} has {len(weights)} weight(s) but data.labels has "
                          f"{len(labels)} labels, whose indices are the type ids (data.type_column is null); give "
                          f"one weight per label")
    unweighted = None
    for part in (splits.train, splits.eval):  # per-row columns, no token read
        types = column(part, "type_indicator")
        bad = np.flatnonzero((types < 0) | (types >= len(weights)))
        if unweighted is None and len(bad):
            unweighted = SimpleNamespace(row=int(column(part, "row")[bad[0]]), type_indicator=int(types[bad[0]]))
    if unweighted is not None:
        raise DataError(f"row {unweighted.row} has type id {unweighted.type_indicator} (data.type_column="
                        f"{cfg.data.type_column!r}) but loss.type_weights={weights} has weights for ids 0.."
                        f"{len(weights) - 1} only; give one weight per type id")
