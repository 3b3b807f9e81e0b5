"""What every data format shares: the tokenized :class:`Example`, the :class:`Task` interface a format implements,
and the tokenization helpers (special tokens, EOS, the length limit). Plain tensors, no accelerate.

A format is one module of :mod:`scale.tasks` with a ``TASK`` object that says

- which columns it needs (:meth:`Task.columns`) and how a file row becomes a checked row (:meth:`Task.read`);
- how a row becomes token ids plus the trained positions and their weights (:meth:`Task.encode`);
- what its evaluation adds to ``eval/loss`` (:meth:`Task.eval_columns`, :meth:`Task.summary`).

The registry (:mod:`scale.tasks`) decides the format once, from ``data.format`` or the file's columns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from scale.config import DataConfig, LossConfig
from scale.formats import DataError


@dataclass
class Example:
    """One tokenized row.

    Attributes:
        input_ids: the row's tokens, no padding.
        tail_len: how many of the last tokens form the tail (``1 <= tail_len < len(input_ids)``); the tail's first
            token is trained.
        type_indicator: the row's type (selects its weight in ``loss.type_weights``).
        target_token: a single-token label's id, or the ``target`` column's token; 0 when none.
        label: index of the label in ``data.labels``; -1 outside classification.
        row: index of the row in the data file (for error messages); -1 when unknown.
        trained: ``tail_len`` 0/1 flags, 1 where a tail token is trained (a chat's user/tool turns between two
            assistant turns are 0); ``None``: every tail token is trained.
    """

    input_ids: list[int]
    tail_len: int
    type_indicator: int = 0
    target_token: int = 0
    label: int = -1
    row: int = -1
    trained: list[int] | None = None

    def tail_flags(self) -> list[int]:
        """``tail_len`` 0/1 flags: which tail tokens are trained."""
        return list(self.trained) if self.trained is not None else [1] * self.tail_len


def special_affixes(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The special tokens the tokenizer's post-processor puts before and after a text: ``(prefix, suffix)``.

    E.g. ``([bos], [])`` for Llama-2, ``([], [])`` for SmolLM2, ``([bos], [eos])`` for a tokenizer built with
    ``add_eos_token``. Found by encoding a probe with and without special tokens.
    """
    plain = tokenizer("a b", add_special_tokens=False)["input_ids"]
    full = tokenizer("a b", add_special_tokens=True)["input_ids"]
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return list(full[:start]), list(full[start + len(plain):])
    return [], []


def encode(tokenizer: Any, text: str) -> list[int]:
    """``text``'s tokens without the tokenizer's own special tokens (special-token spellings are parsed)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def encode_literal(tokenizer: Any, text: str) -> list[int]:
    """``text``'s tokens with every special-token spelling encoded as plain text (never a control token)."""
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])


class Builder:
    """Shared pieces of tokenization: special tokens, EOS, the length limit and what it dropped."""

    def __init__(self, tokenizer: Any, data_cfg: DataConfig) -> None:
        if tokenizer.eos_token_id is None:
            raise DataError("the tokenizer has no EOS token; set one (tokenizer.eos_token) before training")
        self.tokenizer = tokenizer
        self.cfg = data_cfg
        self.eos = tokenizer.eos_token_id
        self.prefix, _ = special_affixes(tokenizer)
        self.dropped: list[int] = []
        self.notes: dict[str, int] = {}  # counts a format reports once (e.g. special-token spellings kept as text)

    def with_eos(self, ids: list[int]) -> list[int]:
        return ids if ids and ids[-1] == self.eos else ids + [self.eos]

    def front(self, prompt: list[int]) -> tuple[list[int], list[int]]:
        """``(prefix, prompt)``: the tokenizer's BOS in front once, even when the text already starts with it."""
        if self.prefix and prompt[:len(self.prefix)] == self.prefix:
            return self.prefix, prompt[len(self.prefix):]
        return self.prefix, prompt

    def count(self, note: str, n: int = 1) -> None:
        """Add ``n`` to the count ``note`` (:attr:`notes`)."""
        self.notes[note] = self.notes.get(note, 0) + n

    def too_long(self, i: int, n: int) -> bool:
        """Whether row ``i`` of ``n`` tokens is dropped: over ``data.max_length`` with ``data.truncation=drop``
        (listed in :attr:`dropped`). A row over the limit that is kept and cut is counted (``rows_truncated``)."""
        if n <= self.cfg.max_length:
            return False
        if self.cfg.truncation == "drop":
            self.dropped.append(i)
            return True
        self.count("rows_truncated")
        return False

    def assemble(self, prefix: list[int], prompt: list[int], tail: list[int], i: int) -> list[int] | None:
        """``prefix + prompt + tail``, losing prompt tokens after ``prefix`` to fit ``data.max_length``
        (``data.truncation=keep_end``), or ``None`` for a row over it that is dropped (``drop``)."""
        room = self.cfg.max_length - len(prefix) - len(tail)
        if prompt and room >= 1 and self.too_long(i, len(prefix) + len(prompt) + len(tail)):
            return None
        if room < 1 or not prompt:
            if not prompt:
                raise DataError(f"row {i}: nothing precedes the tail, so its first token has no prediction; "
                                f"give the row a prompt")
            if self.cfg.drop_long_completions:
                self.dropped.append(i)
                return None
            raise DataError(f"row {i}: the trained tail is {len(tail)} tokens; with {len(prefix) + 1} token(s) "
                            f"before it the row needs {len(prefix) + len(tail) + 1} > data.max_length="
                            f"{self.cfg.max_length}. Raise data.max_length, or set data.drop_long_completions=true "
                            f"to drop such rows (counted in the log).")
        return prefix + prompt[-room:] + tail


class Task:
    """One data format. Subclasses set :attr:`name` and override what differs from these defaults.

    The per-run state a format needs (label tokens, the chat template) is built by :meth:`prepare` and kept on
    the instance; the registry hands out a fresh instance per call of :func:`scale.tasks.get`.
    """

    name: ClassVar[str] = ""
    #: the keys every row of this format holds (:func:`scale.tasks.row_format`)
    row_keys: ClassVar[set[str]] = set()
    #: the row's ``type_indicator`` defaults to its label index (``loss.type_weights`` needs one per label)
    types_are_labels: ClassVar[bool] = False
    #: ``loss.threshold`` / ``loss.target_position`` decide this format's tail
    uses_threshold: ClassVar[bool] = False
    #: the :attr:`Builder.notes` counts this format reports per split (``data/<split>_<name>``, zeros included):
    #: rows whose start ``data.truncation`` cut, and what else the format counts
    counted: ClassVar[tuple[str, ...]] = ("rows_truncated",)

    def columns(self, cfg: DataConfig) -> list[str]:
        """The columns this format needs (detection: a file whose columns include them all)."""
        raise NotImplementedError

    def optional_columns(self, cfg: DataConfig) -> list[str]:
        """Columns besides :meth:`columns` that this format reads (detection of the fallback format)."""
        return []

    def read(self, raw: dict[str, Any], cfg: DataConfig, i: int, path: str) -> dict[str, Any]:
        """Check file row ``i`` and return the fields this format keeps (the registry adds ``row``, ``type``).

        Raises:
            DataError: the row cannot be used; the message names the row and the fix.
        """
        raise NotImplementedError

    def prepare(self, tokenizer: Any, data_cfg: DataConfig, loss_cfg: LossConfig) -> None:
        """Build what :meth:`encode` needs for a whole run (once, before the rows)."""

    def check(self, tokenizer: Any, rows: list[dict[str, Any]]) -> None:
        """Checks over all rows before any is tokenized (after :meth:`prepare`); warnings are logged once.

        Raises:
            DataError: the rows cannot be trained as they are.
        """

    def encode(self, row: dict[str, Any], b: Builder, loss_cfg: LossConfig) -> Example | None:
        """Token ids and the trained tail of one row; ``None`` when ``data.drop_long_completions`` dropped it.

        Raises:
            DataError: the row cannot be tokenized (names the row).
        """
        raise NotImplementedError

    def texts(self, row: dict[str, Any], cfg: DataConfig) -> list[str]:
        """The texts :meth:`encode` passes to ``tokenizer(text, add_special_tokens=False)`` for ``row``, so
        :mod:`scale.cache` can encode a chunk of rows in one batched call [issue 18]; ``[]``: none known (each
        text is then encoded on its own, with the same ids)."""
        return []

    def info(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        """What the loss and evaluation need to know (:class:`scale.data.Splits` fields and eval context)."""
        return {}

    def eval_columns(self, model: torch.nn.Module, batch: dict[str, Tensor], tail_logits: Tensor, targets: Tensor,
                     spec: Any) -> list[Tensor]:
        """``[B]`` per-row figures this format adds to the evaluation table (summed over the split)."""
        return []

    def summary(self, sums: list[float], n: int, spec: Any) -> dict[str, float]:
        """The format's eval metrics from the sums of :meth:`eval_columns` over ``n`` rows."""
        return {}

    def fingerprint(self) -> str:
        """Text that decides the tokens besides the data file and the config (a chat template); '' for none."""
        return ""
