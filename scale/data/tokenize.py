"""Tokenization: the rows of a run -> token sequences with a trained *tail*, the splits every later stage reads.
No device placement, no distributed code, no format names: each data format is a module of
:mod:`scale.data.tasks` and says how its rows become tokens.

Every row becomes ``input_ids`` whose last ``tail_len`` tokens are the tail: the tokens whose next-token
cross-entropy is trained and evaluated. The tail is always a suffix of the row and starts with a trained token;
tokens inside it that are not trained (a chat's user/tool turns between two assistant turns) weigh 0: every
example carries that per-token mask (``Example.tail_flags()``), and every collator copies it
(:mod:`scale.data.collate`).

Tokens are encoded without the tokenizer's special tokens; the ones its post-processor puts *before* the
text (a BOS) are added once at the front (never a second time), the ones it puts after (an EOS of its own,
markers) are not: EOS is appended by us, once. A row longer than ``data.max_length`` loses prompt tokens after
that front, so the tail and a BOS survive; a tail that cannot fit is an error naming the row (or dropped with
``data.drop_long_completions``).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from scale.config.schema import DataConfig, LossConfig
from scale.config.validation import ConfigError
from scale.data.mixing import dropped_per_source, read_rows
from scale.data.read import DataError
from scale.data.split import count_copies
from scale.data.tasks.base import BY_TRUNCATION, Builder, Example, Rows, Task

logger = logging.getLogger(__name__)


def tokenize_rows(rows: Rows, tokenizer: Any, data_cfg: DataConfig, loss_cfg: LossConfig) -> list[Example]:
    """Render, tokenize and left-truncate every row; find its tail (the format's :meth:`Task.encode`).

    Args:
        rows: rows as :func:`scale.data.tasks.load_rows` returned them (or a slice): they carry their task.

    Raises:
        DataError: see the formats in :mod:`scale.data.tasks`.
    """
    if not rows:
        return []
    task = rows.task
    task.prepare(tokenizer, data_cfg, loss_cfg)
    return _tokenize(rows, task, Builder(tokenizer, data_cfg), loss_cfg)


class BatchEncoded:
    """The tokenizer, except that ``tokenizer(text, add_special_tokens=False)`` for a text of ``texts`` is
    answered from one batched encode (Rust, no per-call Python overhead). The ids are those of one call each. The
    token cache's workers tokenize through it (:mod:`scale.data.cache`)."""

    def __init__(self, tokenizer: Any, texts: list[str]) -> None:
        self._tok = tokenizer
        unique = list(dict.fromkeys(texts))
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if not unique:
            encoded = []
        elif backend is not None and backend.truncation is None and backend.padding is None \
                and hasattr(backend, "encode_batch_fast"):
            # What tokenizer(text, add_special_tokens=False) runs, minus transformers' per-text Python
            # (offsets, BatchEncoding): the same Rust encode, so the same ids (tests/test_data_scale.py).
            encoded = [e.ids for e in backend.encode_batch_fast(unique, add_special_tokens=False)]
        else:
            encoded = tokenizer(unique, add_special_tokens=False)["input_ids"]
        self._memo = dict(zip(unique, encoded))

    def __call__(self, text: Any, *args: Any, add_special_tokens: bool = True, **kw: Any) -> Any:
        if not args and not kw and not add_special_tokens and isinstance(text, str) and text in self._memo:
            return {"input_ids": self._memo[text]}
        return self._tok(text, *args, add_special_tokens=add_special_tokens, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)

    def __len__(self) -> int:
        return len(self._tok)


def _tokenize(rows: list[dict[str, Any]], task: Any, b: Builder, loss_cfg: LossConfig) -> list[Example]:
    """Every row's examples (a format may make none, one or several of a row), and ``b.notes["trained_tokens"]``
    counts their trained tokens."""
    out: list[Example] = []
    for r in rows:
        try:
            e = task.encode(r, b, loss_cfg)
        except DataError as err:  # which source of a mixture the row named in the message is from (None: one)
            err.source = r.get("source")  # type: ignore[attr-defined]  # pickled with the error (a worker's)
            raise
        out.extend(e if isinstance(e, list) else [] if e is None else [e])
    b.count("trained_tokens", sum(sum(e.trained) if e.trained is not None else e.tail_len for e in out))
    return out


class Examples(list):
    """A split's tokenized examples, in memory, with the prepared task that evaluates them (``.task``).

    Args:
        examples: the examples.
        task: the prepared task (:class:`scale.data.tasks.base.Task`, its ``found`` set).
    """

    def __init__(self, examples: Iterable[Example], task: Task) -> None:
        super().__init__(examples)
        self.task = task


def with_task(examples: Sequence[Example], task: Task) -> Sequence[Example]:
    """``examples`` carrying ``task``: a list becomes :class:`Examples`, a cached split gets the attribute."""
    if isinstance(examples, list):
        return Examples(examples, task)
    examples.task = task  # type: ignore[attr-defined]
    return examples


@dataclass
class Splits:
    """Tokenized train and eval examples, the task that made them, and what a resumed run checks.

    Attributes:
        train, eval: the examples (:class:`Examples` in memory, a memory-mapped
            :class:`scale.data.token_table.TokenTable` from the cache); each carries the prepared task (``.task``).
        stats: counts for the log: ``data/train_rows``, ``data/eval_rows``, ``data/duplicates_removed``,
            ``data/eval_rows_in_train``, ``data/dropped_long_rows`` (and per source of a mixture).
        fingerprint: sha256 of every token id and trained flag of both splits: what a resumed run must train.
        template_sha256: sha256 of what decides the tokens besides the data file and config (the chat template
            text and its variables); '' when nothing does.
    """

    train: Sequence[Example]
    eval: Sequence[Example]
    stats: dict[str, int] = field(default_factory=dict)
    fingerprint: str = ""
    template_sha256: str = ""

    @property
    def task(self) -> Task:
        """The prepared task of the format that evaluates the splits (a mixture's evaluating format)."""
        return self.eval.task  # type: ignore[attr-defined]

    @property
    def format(self) -> str:
        """The data format (a name in :data:`scale.data.tasks.TASKS`)."""
        return self.task.name

    @property
    def label_token_ids(self) -> list[int] | None:
        """A token per label when every label is one token (classification), else ``None``."""
        return self.task.found.get("label_token_ids")

    @property
    def label_seqs(self) -> list[list[int]]:
        """The tokens of each label (classification), else ``[]``."""
        return self.task.found.get("label_seqs", [])

    @property
    def has_target(self) -> bool:
        """The text format's rows carry a ``target`` token."""
        return self.task.found.get("has_target", False)

    @property
    def types_are_labels(self) -> bool:
        """A row's type id is its label's index (``loss.type_weights`` needs one per label)."""
        return self.task.types_are_labels


def token_fingerprint(examples: Iterable[Example]) -> str:
    """sha256 over every example's token ids, tail length and trained flags (in order)."""
    digest = hashlib.sha256()
    for e in examples:
        digest.update(fingerprint_bytes(e))
    return digest.hexdigest()


def fingerprint_bytes(e: Example) -> bytes:
    """What :func:`token_fingerprint` hashes of one example (:mod:`scale.data.cache`'s workers make it per chunk)."""
    return repr((e.input_ids, e.tail_len, e.trained) + ((e.extra,) if e.extra is not None else ())).encode()


def check_objective_fits(loss_cfg: LossConfig, task: Task) -> None:
    """A preference objective (:meth:`scale.config.schema.LossConfig.trains_pairs`) trains preference pairs, and pairs
    train only under one. Checked as soon as the format is known (before tokenizing), and again on the splits a run gets
    from the token cache (:func:`scale.training.parts.data.build_data`).

    Args:
        loss_cfg: the loss section (``loss.objective``).
        task: the format that evaluates the data (``Splits.task``; a pair format has two ``sides``).

    Raises:
        ConfigError: the objective and the data format do not go together.
    """
    if loss_cfg.samples_online() != (task.name == "prompts"):
        raise ConfigError(f"loss.objective={loss_cfg.objective} with data.format={task.name}: "
                          + ("prompts are sampled from under loss.objective=grpo" if task.name == "prompts" else
                             "loss.objective=grpo samples completions of prompts (data.format=prompts: a prompt "
                             "column, or data.prompt_template over the columns)"))
    pairs = bool(task.sides)
    if loss_cfg.trains_pairs() != pairs:
        raise ConfigError(f"loss.objective={loss_cfg.objective} with data.format={task.name}: "
                          + ("preference pairs train under loss.objective=dpo, simpo or orpo" if pairs else
                             "a preference objective needs pairs (data.format=preference: prompt/chosen/rejected)"))


def build_splits(data_cfg: DataConfig, loss_cfg: LossConfig, tokenizer: Any, path: str, seed: int,
                 tokenize: Any = None, fingerprint_of: Any = None, check_objective: bool = False) -> Splits:
    """Read, split (or mix) and tokenize: the whole data pipeline up to the DataLoader.

    Args:
        tokenize: ``tokenize(name, rows, task, builder) -> Sequence[Example]`` (``name``: train/eval; ``task``: the
            prepared :class:`scale.data.tasks.base.Task` that encodes the rows; dropped rows go to
            ``builder.dropped``); default in memory. :mod:`scale.data.cache` writes the token cache with it.
        fingerprint_of: ``fingerprint_of(train, eval) -> str``, :func:`token_fingerprint` of both splits in order
            (default: computed here; the cache's workers hash their chunks as they tokenize).
        check_objective: refuse a ``loss.objective`` the format does not train (:func:`check_objective_fits`) as soon
            as the format is known, before any row is tokenized (a run's token cache); off for what only reads the
            data (``scale-plan``, ``--show-rows``).

    Raises:
        DataError: see :func:`scale.data.mixing.read_rows` and the format's :meth:`Task.encode`.
        ConfigError: with ``check_objective``, ``loss.objective`` does not fit the data's format.
    """
    mix = read_rows(data_cfg, path, seed)
    if check_objective:
        check_objective_fits(loss_cfg, mix.evaluating)
    task = mix.task
    if not task.uses_threshold and (loss_cfg.threshold, loss_cfg.target_position) != (2, -2):
        logger.warning("loss.threshold=%s and loss.target_position=%d apply to the text format only; the %s format "
                       "trains each row's own tail (see the README's format table)", loss_cfg.threshold,
                       loss_cfg.target_position, mix.evaluating.name)
    overlap = count_copies(mix.eval, mix.train)
    task.prepare(tokenizer, data_cfg, loss_cfg)
    builder = Builder(tokenizer, data_cfg)
    tokenize = tokenize or (lambda name, part, t, b: _tokenize(part, t, b, loss_cfg))  # the token cache's seam
    split = "check"  # the checks see every row: a row number names a row of the one source, if there is one
    try:
        task.check(tokenizer, mix.train + mix.eval)
        split = "train"
        train = tokenize(split, mix.train, task, builder)
        train_notes, train_drops = dict(builder.notes), len(builder.drop_info)
        split = "eval"
        held = tokenize(split, mix.eval, task, builder)
    except DataError as e:  # name the file and the line an editor shows the row on
        raise DataError(mix.locate(str(e), split, getattr(e, "source", None))) from None
    if not train:
        raise DataError(emptied_split("train", builder.drop_info[:train_drops], data_cfg))
    if not held:
        raise DataError(emptied_split("eval", builder.drop_info[train_drops:], data_cfg))
    per_row = max(len(task.sides), 1)  # a preference row (a pair) is two examples: rows are counted as rows
    stats = {"data/train_rows": len(train) // per_row, "data/eval_rows": len(held) // per_row,
             "data/duplicates_removed": mix.removed,
             "data/eval_rows_in_train": overlap, "data/dropped_long_rows": len(builder.dropped),
             # a mixture, per source: rows read, train rows mixed in, eval rows, rows dropped
             **mix.stats, **dropped_per_source(builder.notes, mix.names)}
    for name in ("trained_tokens", *task.counted):  # per split: the train split's notes, then what eval added
        stats[f"data/train_{name}"] = train_notes.get(name, 0)
        stats[f"data/eval_{name}"] = builder.notes.get(name, 0) - train_notes.get(name, 0)
    if builder.dropped:  # which rows: once, when they are tokenized (the start-up log says how many, every start)
        logger.info("data: dropped data-file rows %s%s (data.max_length=%d)", builder.dropped[:20],
                    " ..." if len(builder.dropped) > 20 else "", data_cfg.max_length)
    if builder.notes.get("special_spellings_as_text"):
        logger.warning("data: %d special-token spellings inside message text (e.g. a quoted end-of-turn marker) "
                       "were encoded as text, not as control tokens", builder.notes["special_spellings_as_text"])
    mix.evaluating.restore(task.info(mix.rows))
    extra = task.fingerprint()
    return Splits(train=with_task(train, mix.evaluating), eval=with_task(held, mix.evaluating), stats=stats,
                  fingerprint=(fingerprint_of or (lambda a, b: token_fingerprint(itertools.chain(a, b))))(train, held),
                  template_sha256=hashlib.sha256(extra.encode()).hexdigest() if extra else "")


def emptied_split(split: str, drops: list[tuple[int, str]], data_cfg: DataConfig) -> str:
    """The one-line error for a split that tokenization left empty: the setting that dropped its rows, how many, the
    shortest and longest as rendered, and the fix.

    One setting drops the rows of a run: ``data.truncation=drop`` drops every row over ``data.max_length``, so
    ``data.drop_long_completions`` (rows whose trained tail cannot fit once the prompt is cut) acts only under
    ``data.truncation=keep_end``.

    Args:
        split: ``train`` or ``eval``.
        drops: the split's dropped rows as :attr:`scale.data.tasks.base.Builder.drop_info` holds them:
            ``(rendered length in tokens, setting)``.

    >>> emptied_split("train", [(30, "data.truncation=drop"), (14, "data.truncation=drop")],
    ...               DataConfig(max_length=12, truncation="drop"))  # doctest: +ELLIPSIS
    'data.truncation=drop dropped every train row: 2 rows of 14-30 tokens, over data.max_length=12; raise ...'
    """
    if not drops:
        return (f"no {split} row is left after tokenization (the data format made no example of its rows); check "
                f"the data file and data.format")
    setting, lengths = drops[0][1], sorted(n for n, _ in drops)
    size = f"{lengths[0]}" if lengths[0] == lengths[-1] else f"{lengths[0]}-{lengths[-1]}"
    rows = f"{len(lengths)} row{'s' * (len(lengths) != 1)} of {size} tokens"
    if setting == BY_TRUNCATION:
        return (f"{setting} dropped every {split} row: {rows}, over data.max_length={data_cfg.max_length}; raise "
                f"data.max_length (to {lengths[0]} keeps the shortest), or set data.truncation=keep_end to cut "
                f"over-long rows instead of dropping them")
    return (f"{setting} dropped every {split} row: {rows}, whose trained tails cannot fit in data.max_length="
            f"{data_cfg.max_length} even with the prompt cut; raise data.max_length")


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


def removed_lines(stats: dict[str, int], data_cfg: DataConfig, unit: str = "rows") -> list[str]:
    """One line for each kind of thing the chat template or ``data.truncation`` removed from the rows (counted per
    split in ``stats``), naming the option that keeps it; ``[]`` when nothing was removed. ``unit``: what a row is
    (``pairs`` for preference pairs, each counted once: both sides keep one prompt)."""
    out = []
    cut, dropped = _per_split(stats, "rows_truncated"), stats.get("data/dropped_long_rows", 0)
    if sum(cut):
        lost = [f"{sum(n)} {what}" for key, what in (("turns_cut", "assistant turn(s), not trained"),
                                                      ("tool_calls_cut", "tool call(s)"),
                                                      ("system_cut", "system turn(s)"),
                                                      ("user_text_cut", "user text start(s)"))
                if sum(n := _per_split(stats, key))]
        shared = ", the same prompt cut on both sides of a pair" if unit == "pairs" else ""
        out.append(f"data.max_length={data_cfg.max_length} cut the start of {cut[0]} train and {cut[1]} eval {unit} "
                   f"(data.truncation=keep_end{shared})" + (f", removing {', '.join(lost)}" if lost else "") +
                   f"; a larger data.max_length keeps them, data.truncation=drop drops such {unit}")
    if dropped:
        out.append(f"dropped {dropped} {unit} over data.max_length={data_cfg.max_length} (data.truncation="
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
