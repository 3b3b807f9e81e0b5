"""What every data format shares: the tokenized :class:`Example`, the :class:`Task` interface a format implements,
the :class:`Rows` a source is read into, and the tokenization helpers (special tokens, EOS, the length limit).
Plain tensors, no accelerate.

A format is one module of :mod:`scale.data.tasks` with a :class:`Task` subclass that says

- which columns it needs (:meth:`Task.columns`) and how a file row becomes a checked row (:meth:`Task.read`);
- how a row becomes token ids plus the trained positions and their weights (:meth:`Task.encode`);
- what its evaluation adds to ``eval/loss`` (:meth:`Task.eval_columns`, :meth:`Task.summary`).

The registry (:mod:`scale.data.tasks`) decides the format once, from ``data.format`` or the file's columns, and the
rows carry that task from then on (:class:`Rows`); the prepared task rides with the tokenized splits to evaluation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from scale.config.schema import DataConfig, LossConfig
from scale.data.read import DataError


@dataclass
class Example:
    """One tokenized row.

    Attributes:
        input_ids: the row's tokens, no padding.
        tail_len: how many of the last tokens form the tail (``1 <= tail_len < len(input_ids)``); the tail's first
            token is trained. 0 for a prompt to sample from (``prompts``: nothing of the row itself is trained).
        type_indicator: the row's type (selects its weight in ``loss.type_weights``).
        target_token: a single-token label's id, or the ``target`` column's token; 0 when none.
        label: index of the label in ``data.labels``; -1 outside classification.
        row: index of the row in the data file (for error messages); -1 when unknown.
        trained: ``tail_len`` 0/1 flags, 1 where a tail token is trained (a chat's user/tool turns between two
            assistant turns are 0); ``None``: every tail token is trained (the compact form; :meth:`tail_flags` is
            every example's per-token mask, which every collator copies).
        extra: what a format keeps of the row besides its tokens, as JSON text (a prompt's other columns, which
            reward functions read: :mod:`scale.data.tasks.prompts`); ``None`` for none. The token cache stores it.
    """

    input_ids: list[int]
    tail_len: int
    type_indicator: int = 0
    target_token: int = 0
    label: int = -1
    row: int = -1
    trained: list[int] | None = None
    extra: str | None = None

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


BY_TRUNCATION, BY_LONG_COMPLETIONS = "data.truncation=drop", "data.drop_long_completions=true"  # what dropped a row


class Builder:
    """Shared pieces of tokenization: special tokens, EOS, the length limit and what it dropped."""

    def __init__(self, tokenizer: Any, data_cfg: DataConfig) -> None:
        if tokenizer.eos_token_id is None:
            raise DataError("the tokenizer has no EOS token; set one (tokenizer.eos_token) before training")
        self.tokenizer = tokenizer
        self.cfg = data_cfg
        self.eos = tokenizer.eos_token_id
        self.prefix, self.suffix = special_affixes(tokenizer)
        self.dropped: list[int] = []
        # per dropped row, in the order of :attr:`dropped`: (its rendered length in tokens, the setting that dropped
        # it: "data.truncation=drop" or "data.drop_long_completions=true")
        self.drop_info: list[tuple[int, str]] = []
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

    def drop(self, i: int, n: int, setting: str) -> None:
        """Record that row ``i`` (``n`` tokens as rendered, before any cut) was dropped by ``setting``
        (:data:`BY_TRUNCATION` or :data:`BY_LONG_COMPLETIONS`): :attr:`dropped` and :attr:`drop_info`."""
        self.dropped.append(i)
        self.drop_info.append((n, setting))

    def too_long(self, i: int, n: int) -> bool:
        """Whether row ``i`` of ``n`` tokens is dropped: over ``data.max_length`` with ``data.truncation=drop``
        (listed in :attr:`dropped`). A row over the limit that is kept and cut is counted (``rows_truncated``)."""
        if n <= self.cfg.max_length:
            return False
        if self.cfg.truncation == "drop":
            self.drop(i, n, BY_TRUNCATION)
            return True
        self.count("rows_truncated")
        return False

    def assemble(self, prefix: list[int], prompt: list[int], tail: list[int], i: int, what: str = "the trained tail",
                 unit: str = "row") -> list[int] | None:
        """``prefix + prompt + tail``, losing prompt tokens after ``prefix`` to fit ``data.max_length``
        (``data.truncation=keep_end``), or ``None`` for a row over it that is dropped (``drop``).

        Args:
            what, unit: the tail and the row in words, for the error (``the rejected answer``, ``pair``).

        Raises:
            DataError: nothing precedes the tail, or the tail cannot fit with one prompt token (names the row,
                the tail and both fixes).
        """
        room, n = self.cfg.max_length - len(prefix) - len(tail), len(prefix) + len(prompt) + len(tail)
        # data.truncation=drop drops every row over the limit, also one whose tail alone could not fit
        if prompt and (room >= 1 or self.cfg.truncation == "drop") and self.too_long(i, n):
            return None
        if room < 1 or not prompt:
            if not prompt:
                raise DataError(f"row {i}: nothing precedes the tail, so its first token has no prediction; "
                                f"give the row a prompt")
            if self.cfg.drop_long_completions:
                self.drop(i, n, BY_LONG_COMPLETIONS)
                return None
            raise DataError(f"row {i}: {what} is {len(tail)} tokens; with {len(prefix) + 1} token(s) before it the "
                            f"{unit} needs {len(prefix) + len(tail) + 1} > data.max_length={self.cfg.max_length}. "
                            f"Raise data.max_length, or set data.drop_long_completions=true to drop such {unit}s "
                            f"(counted in the log).")
        return prefix + prompt[-room:] + tail


class Task:
    """One data format. Subclasses set :attr:`name` and override what differs from these defaults.

    The per-run state a format needs (label tokens, the chat template, the pad token evaluation pads with) is built
    by :meth:`prepare` and kept on the instance, with :attr:`found`, what the rows showed (:meth:`info`); the
    registry hands out a fresh instance per call of :func:`scale.data.tasks.get`.
    """

    name: ClassVar[str] = ""
    #: the row's ``type_indicator`` defaults to its label index (``loss.type_weights`` needs one per label)
    types_are_labels: ClassVar[bool] = False
    #: ``loss.threshold`` / ``loss.target_position`` decide this format's tail
    uses_threshold: ClassVar[bool] = False
    #: the :attr:`Builder.notes` counts this format reports per split (``data/<split>_<name>``, zeros included):
    #: rows whose start ``data.truncation`` cut, and what else the format counts
    counted: ClassVar[tuple[str, ...]] = ("rows_truncated",)
    #: the examples each row becomes, in order, when a row is several (a preference pair: chosen, rejected)
    sides: ClassVar[tuple[str, ...]] = ()

    @property
    def unit(self) -> str:
        """What a row of this format is called in log lines: ``pairs`` for a format of :attr:`sides`, else ``rows``."""
        return "pairs" if self.sides else "rows"

    def __init__(self) -> None:
        self.found: dict[str, Any] = {}  # what the rows showed (:meth:`info`), for evaluation and the split's fields

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
        """Token ids and the trained tail of one row; ``None`` when it was dropped (``data.truncation=drop``, or
        ``data.drop_long_completions``; :meth:`Builder.drop`).

        Raises:
            DataError: the row cannot be tokenized (names the row).
        """
        raise NotImplementedError

    def texts(self, row: dict[str, Any], cfg: DataConfig) -> list[str]:
        """The texts :meth:`encode` passes to ``tokenizer(text, add_special_tokens=False)`` for ``row``, so
        :mod:`scale.data.cache` can encode a chunk of rows in one batched call; ``[]``: none known (each text is
        then encoded on its own, with the same ids)."""
        return []

    def for_rows(self, rows: list[dict[str, Any]]) -> Task:
        """The task that encodes ``rows`` as :meth:`read` returned them: this one, unless the format reads its rows
        as another's (a prompt/completion file of conversations is a chat)."""
        return self

    def info(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        """What evaluation and :class:`scale.data.tokenize.Splits` need to know about ``rows`` (label tokens,
        whether rows carry a target), as plain data: the token cache keeps it (``meta.json``)."""
        return {}

    def restore(self, found: dict[str, Any]) -> None:
        """Keep :meth:`info`'s answer in :attr:`found` (a token cache hit reads no row: it restores the stored one)."""
        self.found = dict(found)

    def eval_columns(self, model: torch.nn.Module, batch: dict[str, Tensor], tail_logits: Tensor, targets: Tensor,
                     spec: Any) -> list[Tensor]:
        """``[B]`` per-row figures this format adds to the evaluation table (summed over the split); ``spec`` is
        the run's :class:`scale.objectives.tail.LossSpec` (how the batches are padded)."""
        return []

    def summary(self, sums: list[float], n: int, spec: Any) -> dict[str, float]:
        """The format's eval metrics from the sums of :meth:`eval_columns` over ``n`` rows."""
        return {}

    def fingerprint(self) -> str:
        """Text that decides the tokens besides the data file and the config (a chat template); '' for none."""
        return ""


def exact_match(tail_logits: Tensor, targets: Tensor, mask: Tensor) -> Tensor:
    """``[B]`` 1.0 where every trained tail token (``mask [B, N]``) is the argmax of its prediction (teacher
    forced)."""
    hit = (tail_logits.argmax(-1) == targets) | (mask == 0)
    return hit.all(1).float()


class CompletionTask(Task):
    """A format whose tail is a completion (prompt/completion rows, chats): ``eval/loss`` is the completion NLL per
    trained token, and ``eval/exact_match`` the share of rows whose every trained token is the argmax."""

    def eval_columns(self, model: torch.nn.Module, batch: dict[str, Tensor], tail_logits: Tensor, targets: Tensor,
                     spec: Any) -> list[Tensor]:
        return [exact_match(tail_logits, targets, batch["tail_mask"])]

    def summary(self, sums: list[float], n: int, spec: Any) -> dict[str, float]:
        return {"eval/exact_match": sums[0] / n}


class Rows(list):
    """The rows of one source as the registry read them (:func:`scale.data.tasks.load_rows`): a list of dicts that
    carries the format's :attr:`task`, decided once; a slice keeps it.

    Args:
        rows: checked rows (dicts).
        task: the task that read them and encodes them.
    """

    def __init__(self, rows: list[dict[str, Any]], task: Task) -> None:
        super().__init__(rows)
        self.task = task

    def __getitem__(self, i: Any) -> Any:
        got = super().__getitem__(i)
        return Rows(got, self.task) if isinstance(i, slice) else got
