"""Rows -> token sequences with a trained *tail* -> padded batches. No device placement, no distributed code, no
format names: each data format is a module of :mod:`scale.tasks` and says how its rows become tokens.

Every row becomes ``input_ids`` whose last ``tail_len`` tokens are the tail: the tokens whose next-token
cross-entropy is trained and evaluated. The tail is always a suffix of the row and starts with a trained token;
tokens inside it that are not trained (a chat's user/tool turns between two assistant turns) weigh 0.

Tokens are encoded without the tokenizer's special tokens; the ones its post-processor puts *before* the
text (a BOS) are added once at the front (never a second time), the ones it puts after (an EOS of its own,
markers) are not: EOS is appended by us, once. A row longer than ``data.max_length`` loses prompt tokens after
that front, so the tail and a BOS survive; a tail that cannot fit is an error naming the row (or dropped with
``data.drop_long_completions``). Batches are dicts:

- ``input_ids`` ``[B, T]`` int64, ``attention_mask`` ``[B, T]`` int64 (left or right padded);
- ``tail_mask`` ``[B, N]`` int64, ``N`` the longest tail in the batch: 1 on each row's trained tail tokens,
  right-aligned (column ``N - 1`` is every row's last real token; a row's tail spans from its first 1);
- ``type_indicator`` ``[B]`` int64: ``data.type_column``, the label's index, or 0;
- ``target_token`` ``[B]`` int64: a single-token label's id, or the ``target`` column's token (0 when none);
- ``label`` ``[B]`` int64: the label's index in ``data.labels`` (-1 without);
- ``row`` ``[B]`` int64: index of each example's row in the data file (error messages name it).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from scale import tasks
from scale.config import DataConfig, LossConfig
from scale.formats import DataError, row_key, with_line
from scale.sources import eval_source_of
from scale.tasks import load_rows, row_format
from scale.tasks.base import Builder, Example, special_affixes
from scale.tasks.classification import label_candidates, label_sequences, label_token_ids, render_template
from scale.tasks.messages import chat_template, render_chat

__all__ = ["Collator", "DataError", "Example", "Splits", "build_splits", "chat_template", "label_candidates",
           "label_sequences", "label_token_ids", "load_rows", "render_chat", "render_template", "special_affixes",
           "split_rows", "tokenize_rows"]

logger = logging.getLogger(__name__)


def tokenize_rows(rows: list[dict[str, Any]], tokenizer: Any, data_cfg: DataConfig,
                  loss_cfg: LossConfig) -> list[Example]:
    """Render, tokenize and left-truncate every row; find its tail (the format's :meth:`Task.encode`).

    Raises:
        DataError: see the formats in :mod:`scale.tasks`.
    """
    if not rows:
        return []
    task = tasks.get(row_format(rows[0]))
    task.prepare(tokenizer, data_cfg, loss_cfg)
    return _tokenize(rows, task, Builder(tokenizer, data_cfg), loss_cfg)


def _tokenize(rows: list[dict[str, Any]], task: Any, b: Builder, loss_cfg: LossConfig) -> list[Example]:
    """Every row's examples (a format may make none, one or several of a row), and ``b.notes["trained_tokens"]``
    counts their trained tokens."""
    out: list[Example] = []
    for r in rows:
        e = task.encode(r, b, loss_cfg)
        out.extend(e if isinstance(e, list) else [] if e is None else [e])
    b.count("trained_tokens", sum(sum(e.trained) if e.trained is not None else e.tail_len for e in out))
    return out


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


def tail_flags(e: Example) -> Tensor:
    """``[tail_len]`` int64: 1 on the example's trained tail tokens."""
    return torch.tensor(e.tail_flags(), dtype=torch.long) if e.trained is not None else torch.ones(e.tail_len,
                                                                                                   dtype=torch.long)


PER_EXAMPLE = ("type_indicator", "target_token", "label", "row")


def per_example_fields(examples: list[Example]) -> dict[str, Tensor]:
    """The per-example ``[B]`` long tensors every batch carries beside its tokens: ``type_indicator``,
    ``target_token``, ``label`` (index into ``data.labels``, -1 without) and ``row`` (data-file row)."""
    return {k: torch.tensor([getattr(e, k) for e in examples], dtype=torch.long) for k in PER_EXAMPLE}


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
        N = max(e.tail_len for e in examples)
        ids = torch.full((len(examples), T), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(examples), T), dtype=torch.long)
        tail = torch.zeros((len(examples), N), dtype=torch.long)
        for b, e in enumerate(examples):
            n = len(e.input_ids)
            span = slice(T - n, T) if self.padding_side == "left" else slice(0, n)
            ids[b, span] = torch.tensor(e.input_ids, dtype=torch.long)
            mask[b, span] = 1
            tail[b, N - e.tail_len:] = tail_flags(e)
        return {"input_ids": ids, "attention_mask": mask, "tail_mask": tail, **per_example_fields(examples)}


@dataclass
class Splits:
    """Tokenized train and eval examples plus what the loss and evaluation need to know about them.

    Attributes:
        train, eval: the examples.
        format: the data format (a name in :data:`scale.tasks.TASKS`).
        label_token_ids: a token per label when every label is one token (classification), else ``None``.
        label_seqs: the tokens of each label (classification), else ``[]``.
        has_target: the text format's rows carry a ``target`` token.
        stats: counts for the log: ``data/train_rows``, ``data/eval_rows``, ``data/duplicates_removed``,
            ``data/eval_rows_in_train``, ``data/dropped_long_rows``.
        types_are_labels: a row's type id is its label's index (``loss.type_weights`` needs one per label).
        fingerprint: sha256 of every token id and trained flag of both splits: what a resumed run must train.
        template_sha256: sha256 of what decides the tokens besides the data file and config (the chat template
            text and its variables); '' when nothing does.
    """

    train: list[Example]
    eval: list[Example]
    label_token_ids: list[int] | None
    format: str = tasks.DEFAULT
    label_seqs: list[list[int]] = field(default_factory=list)
    has_target: bool = False
    stats: dict[str, int] = field(default_factory=dict)
    types_are_labels: bool = False
    fingerprint: str = ""
    template_sha256: str = ""

    def task_info(self, pad_token_id: int = 0) -> dict[str, Any]:
        """The keyword arguments of :meth:`scale.loss.LossSpec.from_config` that describe the data."""
        return {"format": self.format, "label_seqs": self.label_seqs, "has_target": self.has_target,
                "pad_token_id": pad_token_id}


def deduplicate(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """Keep the first of each group of exact duplicate rows (same content); return them and how many went."""
    seen: set[str] = set()
    kept = []
    for r in rows:
        key = row_key(r)
        if key not in seen:
            seen.add(key)
            kept.append(r)
    return kept, len(rows) - len(kept)


def token_fingerprint(examples: Iterable[Example]) -> str:
    """sha256 over every example's token ids, tail length and trained flags (in order)."""
    digest = hashlib.sha256()
    for e in examples:
        digest.update(fingerprint_bytes(e))
    return digest.hexdigest()


def fingerprint_bytes(e: Example) -> bytes:
    """What :func:`token_fingerprint` hashes of one example (:mod:`scale.cache`'s workers make it per chunk)."""
    return repr((e.input_ids, e.tail_len, e.trained)).encode()


def count_copies(eval_rows: list[dict[str, Any]], train_rows: list[dict[str, Any]]) -> int:
    """How many eval rows are exact copies of a train row (:func:`scale.formats.row_key`). Only the train rows
    whose text cells match an eval row's are keyed (a row_key is a JSON dump: ~30 us a row) [issue 18]."""
    def cells(r: dict[str, Any]) -> tuple:
        return tuple(v for k, v in sorted(r.items()) if isinstance(v, str))

    probe = {cells(r) for r in eval_rows}
    in_train = {row_key(r) for r in train_rows if cells(r) in probe}
    return sum(row_key(r) in in_train for r in eval_rows)


def _split(data_cfg: DataConfig, rows: list[dict[str, Any]], fmt: str, path: str, seed: int
           ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]], int]:
    """One source: de-duplicate, filter, split (or read ``data.eval_path``/``data.eval_split``), cap the train
    rows at ``data.max_train_examples``. Returns ``(rows kept, train_rows, eval_rows, duplicates_removed)``."""
    removed = 0
    if data_cfg.deduplicate:
        rows, removed = deduplicate(rows)
    if data_cfg.max_text_chars is not None:
        rows = [r for r in rows if len(r.get("text", "")) <= data_cfg.max_text_chars]
    # [issue 18] data.eval_path / data.eval_split: eval rows from their own source, none carved out of `path`;
    # read by the format's row checks (Task.read in load_rows), checked with the train rows (Task.check) later.
    eval_source = eval_source_of(data_cfg, path)
    if eval_source is None:
        train_rows, eval_rows = split_rows(rows, data_cfg.eval_size, seed)
    else:
        eval_cfg, eval_path = eval_source
        (train_rows, _), eval_rows = split_rows(rows, 0, seed), load_rows(eval_cfg, eval_path)
        if row_format(eval_rows[0]) != fmt:
            raise DataError(f"the eval rows of {eval_path} are {row_format(eval_rows[0])} rows, the train rows "
                            f"of {path} {fmt} rows; give both sources the same columns (or set data.format)")
        eval_rows, dropped = deduplicate(eval_rows) if data_cfg.deduplicate else (eval_rows, 0)
        removed += dropped
        if data_cfg.max_text_chars is not None:
            eval_rows = [r for r in eval_rows if len(r.get("text", "")) <= data_cfg.max_text_chars]
    if data_cfg.max_train_examples is not None:
        train_rows = train_rows[: data_cfg.max_train_examples]
    return rows, train_rows, eval_rows, removed


def build_splits(data_cfg: DataConfig, loss_cfg: LossConfig, tokenizer: Any, path: str, seed: int,
                 tokenize: Any = None, fingerprint_of: Any = None) -> Splits:
    """Load, de-duplicate (optionally), filter, split and tokenize: the whole data pipeline up to the DataLoader.

    Args:
        tokenize: ``tokenize(name, rows, task, builder) -> Sequence[Example]`` (``name``: train/eval; ``task``: the
            prepared :class:`scale.tasks.base.Task`; dropped rows go to ``builder.dropped``); default in memory.
            :mod:`scale.cache` writes the token cache with it [issue 18].
        fingerprint_of: ``fingerprint_of(train, eval) -> str``, :func:`token_fingerprint` of both splits in order
            (default: computed here; the cache's workers hash their chunks as they tokenize).

    Raises:
        DataError: see :func:`scale.tasks.load_rows`, :func:`split_rows` and the format's :meth:`Task.encode`.
    """
    if data_cfg.datasets:  # [issue 18] several sources mixed by weight (scale/mixing.py); `path` is not read
        from scale.mixing import read_mixture

        mix = read_mixture(data_cfg, seed)
        rows, fmt, task, removed, train_rows, eval_rows = mix.rows, mix.format, mix.task, mix.removed, mix.train, \
            mix.eval
    else:
        mix = None
        rows = load_rows(data_cfg, path)
        lines = rows if eval_source_of(data_cfg, path) is None else None  # the eval rows' numbers are another file's
        fmt = row_format(rows[0])
        task = tasks.get(fmt)
        rows, train_rows, eval_rows, removed = _split(data_cfg, rows, fmt, path, seed)
    if not task.uses_threshold and (loss_cfg.threshold, loss_cfg.target_position) != (2, -2):
        logger.warning("loss.threshold=%s and loss.target_position=%d apply to the text format only; the %s format "
                       "trains each row's own tail (see scale/data.py)", loss_cfg.threshold, loss_cfg.target_position,
                       fmt)
    overlap = count_copies(eval_rows, train_rows)
    task.prepare(tokenizer, data_cfg, loss_cfg)
    builder = Builder(tokenizer, data_cfg)
    tokenize = tokenize or (lambda name, part, t, b: _tokenize(part, t, b, loss_cfg))  # [issue 18] the cache's seam
    try:
        task.check(tokenizer, train_rows + eval_rows)
        train = tokenize("train", train_rows, task, builder)
        train_notes = dict(builder.notes)
        held = tokenize("eval", eval_rows, task, builder)
    except DataError as e:  # name the line an editor shows the row on
        raise DataError(with_line(str(e), lines if mix is None else None)) from None
    if not train or not held:
        raise DataError(f"data.drop_long_completions dropped every {'train' if not train else 'eval'} row; raise "
                        f"data.max_length")
    stats = {"data/train_rows": len(train), "data/eval_rows": len(held), "data/duplicates_removed": removed,
             "data/eval_rows_in_train": overlap, "data/dropped_long_rows": len(builder.dropped)}
    for name in ("trained_tokens", *task.counted):  # per split: the train split's notes, then what eval added
        stats[f"data/train_{name}"] = train_notes.get(name, 0)
        stats[f"data/eval_{name}"] = builder.notes.get(name, 0) - train_notes.get(name, 0)
    if mix is not None:  # per source: rows read, train rows mixed in, eval rows, rows dropped [issue 18]
        from scale.mixing import dropped_per_source

        stats.update(mix.stats)
        stats.update(dropped_per_source(builder.notes, mix.names))
    if builder.dropped:  # which rows: once, when they are tokenized (the start-up log says how many, every start)
        logger.info("data: dropped data-file rows %s%s (data.max_length=%d)", builder.dropped[:20],
                    " ..." if len(builder.dropped) > 20 else "", data_cfg.max_length)
    if builder.notes.get("special_spellings_as_text"):
        logger.warning("data: %d special-token spellings inside message text (e.g. a quoted end-of-turn marker) "
                       "were encoded as text, not as control tokens", builder.notes["special_spellings_as_text"])
    info = task.info(rows)
    extra = task.fingerprint()
    return Splits(train=train, eval=held, label_token_ids=info.get("label_token_ids"), format=fmt,
                  label_seqs=info.get("label_seqs", []), has_target=info.get("has_target", False), stats=stats,
                  types_are_labels=task.types_are_labels, fingerprint=(fingerprint_of or (
                      lambda a, b: token_fingerprint(itertools.chain(a, b))))(train, held),
                  template_sha256=hashlib.sha256(extra.encode()).hexdigest() if extra else "")


_MAIN_STATS = ("data/train_rows", "data/eval_rows", "data/duplicates_removed", "data/eval_rows_in_train",
               "data/dropped_long_rows")


def _per_split(stats: dict[str, int], name: str) -> tuple[int, int]:
    return stats.get(f"data/train_{name}", 0), stats.get(f"data/eval_{name}", 0)


def stats_line(stats: dict[str, int]) -> str:
    """The start-up log's data line: the row counts, the trained tokens per row of each split, and every other
    count that is not 0 (``data/*`` of :attr:`Splits.stats`; all of them are in ``metrics.jsonl`` at step 0)."""
    main = [f"{k.removeprefix('data/')}={stats[k]}" for k in _MAIN_STATS if k in stats]
    per_row = [f"{split} {stats[f'data/{split}_trained_tokens'] / stats[f'data/{split}_rows']:.1f}"
               for split in ("train", "eval") if stats.get(f"data/{split}_rows") and
               f"data/{split}_trained_tokens" in stats]
    rest = [f"{k.removeprefix('data/')}={v}" for k, v in stats.items() if k not in _MAIN_STATS and v
            and not k.endswith("_trained_tokens")]
    return " ".join(main + rest) + (f"; trained tokens per row: {', '.join(per_row)}" if per_row else "")


def removed_lines(stats: dict[str, int], data_cfg: DataConfig) -> list[str]:
    """One line for each kind of thing the chat template or ``data.truncation`` removed from the rows (counted per
    split in ``stats``), naming the option that keeps it; ``[]`` when nothing was removed."""
    out = []
    cut, dropped = _per_split(stats, "rows_truncated"), stats.get("data/dropped_long_rows", 0)
    if sum(cut):
        lost = [f"{sum(n)} {what}" for key, what in (("turns_cut", "assistant turn(s), not trained"),
                                                      ("tool_calls_cut", "tool call(s)"),
                                                      ("system_cut", "system turn(s)"),
                                                      ("user_text_cut", "user text start(s)"))
                if sum(n := _per_split(stats, key))]
        out.append(f"data.max_length={data_cfg.max_length} cut the start of {cut[0]} train and {cut[1]} eval rows "
                   f"(data.truncation=keep_end)" + (f", removing {', '.join(lost)}" if lost else "") +
                   "; a larger data.max_length keeps them, data.truncation=drop drops such rows")
    if dropped:
        out.append(f"dropped {dropped} rows over data.max_length={data_cfg.max_length} (data.truncation="
                   f"{data_cfg.truncation}, data.drop_long_completions={str(data_cfg.drop_long_completions).lower()})"
                   f"; a larger data.max_length keeps them")
    if sum(n := _per_split(stats, "history_reasoning_dropped")):
        out.append(f"{sum(n)} reasoning blocks of earlier assistant turns are not trained ({n[0]} train, {n[1]} eval): "
                   f"the chat template renders those turns as history, without it; data.train_on="
                   f"all_assistant_as_last trains each turn as the last of its own row, with its reasoning")
    if sum(n := _per_split(stats, "reasoning_not_rendered")):
        out.append(f"the chat template does not render {sum(n)} reasoning blocks of trained turns ({n[0]} train, "
                   f"{n[1]} eval); a template that renders reasoning_content (data.chat_template) keeps them")
    if sum(n := _per_split(stats, "system_not_rendered")):
        out.append(f"the chat template does not render {sum(n)} system turns ({n[0]} train, {n[1]} eval); a "
                   f"template that renders them (data.chat_template) keeps them")
    if sum(n := _per_split(stats, "empty_turns")):
        out.append(f"{sum(n)} assistant turns render as no text but their end-of-turn marker (an empty message) and "
                   f"are not trained ({n[0]} train, {n[1]} eval)")
    return out


TRAINED_OPEN, TRAINED_CLOSE = "[[", "]]"


def show_legend() -> str:
    """How :func:`show_example` marks the trained tokens."""
    return f"trained tokens between {TRAINED_OPEN} and {TRAINED_CLOSE}"


def show_example(tokenizer: Any, e: Example) -> str:
    """The example's text as the model reads it, each run of trained tokens between ``[[`` and ``]]``.

    Tokens are decoded one run at a time (special tokens spelled out), so the text is the row's exactly.
    """
    flags = [0] * (len(e.input_ids) - e.tail_len) + e.tail_flags()
    out, start = [], 0
    for j in range(1, len(flags) + 1):
        if j == len(flags) or flags[j] != flags[start]:
            text = tokenizer.decode(e.input_ids[start:j])
            out.append(f"{TRAINED_OPEN}{text}{TRAINED_CLOSE}" if flags[start] else text)
            start = j
    return "".join(out)
