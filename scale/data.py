"""Labelled text -> token sequences -> padded batches. No device placement, no distributed code.

A row ``{"text": "A three-hour cinema master class.", "label": "positive"}`` renders through
``data.template`` (``"Review: {text}\\nSentiment: {label}"``) plus EOS, is tokenized, and, when longer than
``data.max_length``, loses tokens from the *start* so the answer tail always survives. Batches are dicts:

- ``input_ids`` ``[B, T]`` int64, ``attention_mask`` ``[B, T]`` int64 (left or right padded);
- ``type_indicator`` ``[B]`` int64: ``data.type_column`` or the label's index in ``data.labels``;
- ``target_token`` ``[B]`` int64: token id of the row's label word;
- ``row`` ``[B]`` int64: index of each example's row in the data file (error messages name it).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from scale.config import DataConfig, LossConfig

_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".tsv": "csv"}


class DataError(ValueError):
    """The data file or its rows cannot be used; the message names the field and the fix."""


def load_rows(cfg: DataConfig, path: str) -> list[dict[str, Any]]:
    """Read a jsonl/json/csv/tsv file with ``datasets`` and return its rows as dicts.

    Args:
        cfg: the data section (columns, labels).
        path: local file (already resolved from an embedded name).

    Returns:
        Rows with ``text``, ``label`` and, if configured, ``type`` keys.

    Raises:
        DataError: missing, empty or non-UTF-8 file, unknown extension, missing column, or a label
            outside ``data.labels``.
    """
    import datasets

    file = Path(path)
    if not file.is_file():
        what = "is a directory" if file.is_dir() else "does not exist"
        raise DataError(f"data.path={path!r} {what}; point it at a .jsonl/.csv/.tsv file (a relative path is "
                        f"read from the current directory)")
    builder = _BUILDERS.get(file.suffix.lower())
    if builder is None:
        raise DataError(f"data.path={path!r}: unknown extension {file.suffix!r}; use one of {sorted(_BUILDERS)}")
    if file.stat().st_size == 0:
        raise DataError(f"data.path={path!r} is empty; it needs at least one labelled row")
    try:
        file.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"data.path={path!r} is not UTF-8 (byte {e.start}); re-encode it as UTF-8") from e
    kwargs: dict[str, Any] = {}
    if file.suffix.lower() == ".tsv":
        kwargs["delimiter"] = "\t"
    if cfg.column_names is not None:
        if builder != "csv":
            raise DataError("data.column_names applies to header-less .csv/.tsv files only; remove it")
        kwargs["column_names"] = cfg.column_names
    datasets.disable_progress_bars()
    try:
        ds = datasets.load_dataset(builder, data_files=str(file), split="train", **kwargs)
    except Exception as e:  # datasets raises several types for malformed files
        raise DataError(f"data.path={path!r} could not be parsed as {builder}: {e}") from e
    if len(ds) == 0:
        raise DataError(f"data.path={path!r} has no rows")
    wanted = {"data.text_column": cfg.text_column, "data.label_column": cfg.label_column}
    if cfg.type_column is not None:
        wanted["data.type_column"] = cfg.type_column
    for key, column in wanted.items():
        if column not in ds.column_names:
            raise DataError(f"{key}={column!r} is not a column of {path}; its columns are {ds.column_names}. "
                            f"Set {key} (or data.column_names for a header-less file).")
    texts, labels = ds[cfg.text_column], ds[cfg.label_column]
    types = ds[cfg.type_column] if cfg.type_column is not None else None
    allowed = set(cfg.labels)
    rows = []
    for i, (text, label) in enumerate(zip(texts, labels)):
        label = str(label).strip() if label is not None else None
        if label not in allowed:
            raise DataError(f"row {i} of {path}: label {label!r} is not in data.labels={cfg.labels}; "
                            f"fix the row or add the label to data.labels")
        if text is None or not str(text).strip():
            raise DataError(f"row {i} of {path}: empty {cfg.text_column!r}")
        row = {"text": str(text).strip(), "label": label, "row": i}
        if types is not None:
            if not isinstance(types[i], int) or isinstance(types[i], bool):
                raise DataError(f"row {i} of {path}: data.type_column={cfg.type_column!r} must be an integer, "
                                f"got {types[i]!r}")
            row["type"] = types[i]
        rows.append(row)
    return rows


def label_token_ids(tokenizer: Any, cfg: DataConfig) -> list[int]:
    """Token id of each label word as it appears in the rendered template.

    Args:
        tokenizer: a transformers tokenizer.
        cfg: the data section (``labels``, ``template``).

    Returns:
        One token id per entry of ``data.labels``.

    Raises:
        DataError: a label renders as more (or fewer) than one token, or two labels share a token.
    """
    prefix = cfg.template.replace("{label}", "").format(text="x")
    base = tokenizer(prefix.rstrip(), add_special_tokens=False)["input_ids"]
    ids = []
    for label in cfg.labels:
        full = tokenizer(prefix + label, add_special_tokens=False)["input_ids"]
        # The label is one token iff the last token alone decodes to it (a leading space may merge into it).
        if tokenizer.decode(full[-1:]).strip() != label.strip():
            k = 0
            while k < min(len(base), len(full)) and base[k] == full[k]:
                k += 1
            pieces = [tokenizer.decode([t]) for t in full[k:]]
            raise DataError(f"data.labels: {label!r} renders as {len(pieces)} tokens {pieces} in data.template; "
                            f"every label word must be a single token: choose another word")
        ids.append(full[-1])
    if len(set(ids)) != len(ids):
        raise DataError(f"data.labels={cfg.labels} map to repeated token ids {ids}; use distinct words")
    return ids


@dataclass
class Example:
    """One tokenized row: ``input_ids`` (list of ints, no padding), ``type_indicator``, ``target_token``."""

    input_ids: list[int]
    type_indicator: int
    target_token: int
    row: int = -1  # index of the row in the data file (for error messages); -1 when unknown


def tokenize_rows(rows: list[dict[str, Any]], tokenizer: Any, data_cfg: DataConfig,
                  loss_cfg: LossConfig) -> list[Example]:
    """Render, tokenize and left-truncate every row, and check that its tail holds the label.

    Raises:
        DataError: the label word is not at ``loss.target_position`` of a row, or a row has fewer than
            ``loss.threshold + 1`` tokens.
    """
    label_ids = label_token_ids(tokenizer, data_cfg)
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError("the tokenizer has no EOS token; set one (tokenizer.eos_token) before training")
    rendered = [data_cfg.template.format(text=r["text"], label=r["label"]) for r in rows]
    encoded = tokenizer(rendered, add_special_tokens=True)["input_ids"]
    examples = []
    need = loss_cfg.threshold + 1
    for i, (row, ids) in enumerate(zip(rows, encoded)):
        i = row.get("row", i)  # report the row of the data file, not of the split
        ids = list(ids) + [eos]
        ids = ids[-data_cfg.max_length:]  # drop from the prompt side: the answer tail survives
        if len(ids) < need:
            raise DataError(f"row {i} has {len(ids)} tokens; loss.threshold={loss_cfg.threshold} needs at least "
                            f"{need}. Lower loss.threshold, raise data.max_length or drop the row.")
        label_index = data_cfg.labels.index(row["label"])
        target = label_ids[label_index]
        if ids[loss_cfg.target_position] != target:
            got = tokenizer.decode([ids[loss_cfg.target_position]])
            raise DataError(f"row {i}: the token at loss.target_position={loss_cfg.target_position} is {got!r}, "
                            f"not the label {row['label']!r}; set loss.target_position to where the label sits")
        examples.append(Example(ids, int(row.get("type", label_index)), target, i))
    return examples


def split_rows(rows: list[Any], eval_size: int, seed: int) -> tuple[list[Any], list[Any]]:
    """Deterministic shuffle by ``seed``; the first ``eval_size`` rows are the held-out split.

    Returns:
        ``(train_rows, eval_rows)``.

    Raises:
        DataError: fewer rows than ``eval_size + 1``.
    """
    if len(rows) <= eval_size:
        raise DataError(f"data has {len(rows)} rows but data.eval_size={eval_size}; lower data.eval_size")
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    return [rows[i] for i in order[eval_size:]], [rows[i] for i in order[:eval_size]]


class Collator:
    """Pad a list of :class:`Example` into a batch dict (see the module docstring for shapes).

    Args:
        pad_token_id: id written into padding positions (masked out by ``attention_mask``).
        padding_side: ``"left"`` or ``"right"``.
    """

    def __init__(self, pad_token_id: int, padding_side: str = "left") -> None:
        self.pad_token_id = pad_token_id
        self.padding_side = padding_side

    def __call__(self, examples: list[Example]) -> dict[str, Tensor]:
        T = max(len(e.input_ids) for e in examples)
        ids = torch.full((len(examples), T), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(examples), T), dtype=torch.long)
        for b, e in enumerate(examples):
            n = len(e.input_ids)
            span = slice(T - n, T) if self.padding_side == "left" else slice(0, n)
            ids[b, span] = torch.tensor(e.input_ids, dtype=torch.long)
            mask[b, span] = 1
        return {
            "input_ids": ids,
            "attention_mask": mask,
            "type_indicator": torch.tensor([e.type_indicator for e in examples], dtype=torch.long),
            "target_token": torch.tensor([e.target_token for e in examples], dtype=torch.long),
            "row": torch.tensor([e.row for e in examples], dtype=torch.long),
        }


@dataclass
class Splits:
    """Tokenized train and eval examples plus what the loss needs to know about labels."""

    train: list[Example]
    eval: list[Example]
    label_token_ids: list[int]


def build_splits(data_cfg: DataConfig, loss_cfg: LossConfig, tokenizer: Any, path: str, seed: int) -> Splits:
    """Load, filter, split and tokenize: the whole data pipeline up to the DataLoader.

    Raises:
        DataError: see :func:`load_rows`, :func:`split_rows`, :func:`tokenize_rows`.
    """
    rows = load_rows(data_cfg, path)
    if data_cfg.max_text_chars is not None:
        rows = [r for r in rows if len(r["text"]) <= data_cfg.max_text_chars]
    train_rows, eval_rows = split_rows(rows, data_cfg.eval_size, seed)
    if data_cfg.max_train_examples is not None:
        train_rows = train_rows[: data_cfg.max_train_examples]
    return Splits(
        train=tokenize_rows(train_rows, tokenizer, data_cfg, loss_cfg),
        eval=tokenize_rows(eval_rows, tokenizer, data_cfg, loss_cfg),
        label_token_ids=label_token_ids(tokenizer, data_cfg),
    )
