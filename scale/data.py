"""Rows -> token sequences with a trained *tail* -> padded batches. No device placement, no distributed code.

Every row becomes ``input_ids`` whose last ``tail_len`` tokens are the tail: the tokens whose next-token
cross-entropy is trained and evaluated. The tail is always a suffix of the row (formats: :mod:`scale.formats`):

- ``text``: the last ``loss.threshold`` tokens of ``text`` + EOS;
- ``classification``: ``data.template`` rendered with the row (only ``{text}`` and ``{label}`` are fields;
  other braces are literal); the tail is the label's tokens + EOS;
- ``prompt_completion``: prompt tokens, then the tail: completion tokens + EOS;
- ``messages``: the conversation rendered by the chat template and cut right after the end-of-turn marker
  that closes the last assistant turn; the tail is that turn's rendered content through the marker.

Tokens are encoded without the tokenizer's special tokens; the ones its post-processor puts *before* the
text (a BOS) are added once at the front, the ones it puts after (an EOS of its own, markers) are not: EOS is
appended by us, once. A row longer than ``data.max_length`` loses prompt tokens after that front, so the
tail and a BOS survive; a tail that cannot fit is an error naming the row (or dropped with
``data.drop_long_completions``). Batches are dicts:

- ``input_ids`` ``[B, T]`` int64, ``attention_mask`` ``[B, T]`` int64 (left or right padded);
- ``tail_mask`` ``[B, N]`` int64, ``N`` the longest tail in the batch: 1 on each row's tail, right-aligned
  (column ``N - 1`` is every row's last real token);
- ``type_indicator`` ``[B]`` int64: ``data.type_column``, the label's index, or 0;
- ``target_token`` ``[B]`` int64: a single-token label's id, or the ``target`` column's token (0 when none);
- ``label`` ``[B]`` int64: the label's index in ``data.labels`` (-1 outside classification);
- ``row`` ``[B]`` int64: index of each example's row in the data file (error messages name it).
"""

from __future__ import annotations

import logging
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from scale.config import DataConfig, LossConfig
from scale.formats import DataError, load_rows, normalize_label, row_format, row_key
from scale.sources import eval_source_of

__all__ = ["Collator", "DataError", "Example", "Splits", "build_splits", "label_candidates", "label_sequences",
           "label_token_ids", "load_rows", "render_template", "split_rows", "tokenize_rows"]

logger = logging.getLogger(__name__)
_FIELD = re.compile(r"\{(text|label)\}")


def render_template(template: str, text: str, label: str) -> str:
    """``template`` with ``{text}`` and ``{label}`` replaced; every other character (braces too) is literal."""
    return _FIELD.sub(lambda m: text if m.group(1) == "text" else label, template)


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


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def label_sequences(tokenizer: Any, cfg: DataConfig) -> list[list[int]]:
    """The tokens of each label as it appears at the end of the rendered template (EOS not included).

    Returns:
        One token list per entry of ``data.labels`` (one token for a word like ``positive``).

    Raises:
        DataError: a label's tokens merge with the template text before it, or two labels share tokens.
    """
    prompt = render_template(cfg.template, "x", "").rstrip()
    base = _encode(tokenizer, prompt)
    seqs = []
    for label in (normalize_label(x) for x in cfg.labels):
        full = _encode(tokenizer, render_template(cfg.template, "x", label))
        if full[:len(base)] != base or tokenizer.decode(full[len(base):]).strip() != label:
            raise DataError(f"data.labels: {label!r} does not tokenize apart from the template text before it "
                            f"in data.template={cfg.template!r}; put a space or a newline before '{{label}}'")
        seqs.append(full[len(base):])
    if len({tuple(s) for s in seqs}) != len(seqs):
        raise DataError(f"data.labels={cfg.labels} map to repeated tokens {seqs}; use distinct labels")
    return seqs


def label_token_ids(tokenizer: Any, cfg: DataConfig) -> list[int] | None:
    """Token id of each label when every label is one token (the fast accuracy path), else ``None``."""
    seqs = label_sequences(tokenizer, cfg)
    return [s[0] for s in seqs] if all(len(s) == 1 for s in seqs) else None


@dataclass
class Example:
    """One tokenized row.

    Attributes:
        input_ids: the row's tokens, no padding.
        tail_len: how many of the last tokens are trained (``1 <= tail_len < len(input_ids)``).
        type_indicator: the row's type (selects its weight in ``loss.type_weights``).
        target_token: a single-token label's id, or the ``target`` column's token; 0 when none.
        label: index of the label in ``data.labels``; -1 outside classification.
        row: index of the row in the data file (for error messages); -1 when unknown.
    """

    input_ids: list[int]
    tail_len: int
    type_indicator: int = 0
    target_token: int = 0
    label: int = -1
    row: int = -1


def _target_id(tokenizer: Any, target: int | str, i: int) -> int:
    if isinstance(target, int):
        if target >= len(tokenizer):
            raise DataError(f"row {i}: target token id {target} is outside the vocabulary ({len(tokenizer)} ids)")
        return target
    ids = _encode(tokenizer, target)
    if len(ids) != 1:
        raise DataError(f"row {i}: target {target!r} is {len(ids)} tokens "
                        f"{[tokenizer.decode([t]) for t in ids]}; give the text of one token (or its id)")
    return ids[0]


class _Builder:
    """Shared pieces of tokenization: special tokens, EOS, the length limit and what it dropped."""

    def __init__(self, tokenizer: Any, data_cfg: DataConfig) -> None:
        if tokenizer.eos_token_id is None:
            raise DataError("the tokenizer has no EOS token; set one (tokenizer.eos_token) before training")
        self.tokenizer = tokenizer
        self.cfg = data_cfg
        self.eos = tokenizer.eos_token_id
        self.prefix, _ = special_affixes(tokenizer)
        self.dropped: list[int] = []

    def with_eos(self, ids: list[int]) -> list[int]:
        return ids if ids and ids[-1] == self.eos else ids + [self.eos]

    def assemble(self, prefix: list[int], prompt: list[int], tail: list[int], i: int) -> list[int] | None:
        """``prefix + prompt + tail``, losing prompt tokens after ``prefix`` to fit ``data.max_length``."""
        room = self.cfg.max_length - len(prefix) - len(tail)
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


def tokenize_rows(rows: list[dict[str, Any]], tokenizer: Any, data_cfg: DataConfig,
                  loss_cfg: LossConfig) -> list[Example]:
    """Render, tokenize and left-truncate every row; find its tail (see the module docstring).

    Raises:
        DataError: a ``text`` row shorter than ``loss.threshold + 1`` tokens, a classification row whose
            label tokens differ from the label's own, a tail that cannot fit in ``data.max_length``, a chat
            template that is missing or does not render the last assistant turn, a target that is not one token.
    """
    return _tokenize(rows, _Builder(tokenizer, data_cfg), loss_cfg)


def _tokenize(rows: list[dict[str, Any]], b: _Builder, loss_cfg: LossConfig) -> list[Example]:
    if not rows:
        return []
    fmt = row_format(rows[0])
    tok, cfg = b.tokenizer, b.cfg
    seqs = label_sequences(tok, cfg) if fmt == "classification" else []
    labels = [normalize_label(x) for x in cfg.labels]
    chat = chat_template(tok, cfg) if fmt == "messages" else None
    examples = []
    for r in rows:
        i = r.get("row", -1)  # report the row of the data file, not of the split
        label, target = -1, 0
        if fmt == "text":
            ids = b.with_eos(b.prefix + _encode(tok, r["text"]))
            ids = ids[:len(b.prefix)] + ids[len(b.prefix):][-(cfg.max_length - len(b.prefix)):]
            need = loss_cfg.threshold + 1
            if len(ids) < need:
                raise DataError(f"row {i} has {len(ids)} tokens; loss.threshold={loss_cfg.threshold} needs at "
                                f"least {need}. Lower loss.threshold, raise data.max_length or drop the row.")
            tail_len = loss_cfg.threshold
            if "target" in r:
                target = _target_id(tok, r["target"], i)
        elif fmt == "classification":
            label = labels.index(r["label"])
            full = _encode(tok, render_template(cfg.template, r["text"], r["label"]))
            seq = seqs[label]
            if full[-len(seq):] != seq:
                got = [tok.decode([t]) for t in full[-len(seq):]]
                raise DataError(f"row {i}: the label {r['label']!r} tokenizes as {got} at the end of this row, not "
                                f"as {[tok.decode([t]) for t in seq]}; put a space or newline before '{{label}}' "
                                f"in data.template")
            tail = b.with_eos(seq)
            ids = b.assemble(b.prefix, full[:-len(seq)], tail, i)
            tail_len = len(tail)
            target = seq[0] if len(seq) == 1 else 0
        elif fmt == "prompt_completion":
            completion = b.with_eos(_encode(tok, r["completion"]))
            ids = b.assemble(b.prefix, _encode(tok, r["prompt"]), completion, i)
            tail_len = len(completion)
        else:
            prompt_text, tail_text, add_eos = render_chat(tok, chat, r["messages"], i)
            prompt, tail = _encode(tok, prompt_text), _encode(tok, tail_text)
            tail = b.with_eos(tail) if add_eos else tail
            front = prompt[:1] if prompt[:1] == b.prefix[:1] and b.prefix else []  # a BOS the template rendered
            ids = b.assemble(front, prompt[len(front):], tail, i)
            tail_len = len(tail)
        if ids is None:
            continue
        examples.append(Example(ids, tail_len, int(r.get("type", max(label, 0))), target, label, i))
    return examples


def chat_template(tokenizer: Any, cfg: DataConfig) -> str:
    """The chat template (Jinja text): ``data.chat_template``'s file, else the tokenizer's own.

    Raises:
        DataError: the file does not exist, or there is no template at all.
    """
    if cfg.chat_template is not None:
        path = Path(cfg.chat_template)
        if not path.is_file():
            raise DataError(f"data.chat_template={cfg.chat_template!r} is not a file; point it at a Jinja "
                            f"chat-template file")
        return path.read_text(encoding="utf-8")
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise DataError("the messages format needs a chat template and this tokenizer has none; set "
                        "data.chat_template to a Jinja file (e.g. the chat_template of a tokenizer_config.json "
                        "of the same model family), or write the data as prompt/completion columns")
    return template


def _special_strings(tokenizer: Any) -> list[str]:
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    specials = set(tokenizer.all_special_tokens) | {t.content for t in added.values() if getattr(t, "special", False)}
    return [s for s in specials if s]


def render_chat(tokenizer: Any, template: str, messages: list[dict[str, str]], i: int) -> tuple[str, str, bool]:
    """Render a conversation and split it into ``(prompt_text, tail_text, append_eos)``.

    The tail starts where the generation prompt of the earlier messages ends (or, if the template renders
    history differently, at the last assistant content) and ends right after the first special token that
    follows the content: the end-of-turn marker. A template without such a marker gets EOS appended.

    Raises:
        DataError: the rendered conversation does not hold the last assistant message's content.
    """
    kw = {"tokenize": False, "chat_template": template}
    full = tokenizer.apply_chat_template(messages, **kw)
    prompt = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True, **kw)
    content = messages[-1]["content"].strip()
    start = len(prompt) if full.startswith(prompt) else full.rfind(content)
    at = full.find(content, max(start, 0))
    if start < 0 or at < 0:
        raise DataError(f"row {i}: the chat template does not render the last assistant message's content as "
                        f"written, so its tokens cannot be found; check data.chat_template")
    end = at + len(content)
    markers = [(full.find(s, end), s) for s in _special_strings(tokenizer)]
    markers = [(pos, s) for pos, s in markers if pos >= 0 and not full[end:pos].strip()]
    if markers:
        pos, marker = min(markers)
        return full[:start], full[start:pos + len(marker)], False
    return full[:start], full[start:end], True


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
            tail[b, N - e.tail_len:] = 1
        return {"input_ids": ids, "attention_mask": mask, "tail_mask": tail, **per_example_fields(examples)}


def label_candidates(batch: dict[str, Tensor], label_seqs: list[list[int]], collate: Collator) -> list[dict[str, Tensor]]:
    """For log-likelihood ranking: each row's prompt (the row without its tail) followed by every label.

    Args:
        batch: a classification batch (any device).
        label_seqs: the tokens of each label (:func:`label_sequences`).
        collate: pads the candidates (same padding side as the batch).

    Returns:
        One batch per label, on the batch's device: row ``b`` is ``prompt_b + label_seqs[l]`` with the label's
        tokens as its tail. A host copy of the batch (evaluation only).
    """
    device = batch["input_ids"].device
    ids, mask = batch["input_ids"].tolist(), batch["attention_mask"].tolist()
    tails = batch["tail_mask"].sum(1).tolist()
    prompts = [[t for t, m in zip(r, mk) if m][:sum(mk) - n] for r, mk, n in zip(ids, mask, tails)]
    out = []
    for seq in label_seqs:
        cand = collate([Example(p + seq, len(seq)) for p in prompts])
        out.append({k: v.to(device) for k, v in cand.items()})
    return out


@dataclass
class Splits:
    """Tokenized train and eval examples plus what the loss and evaluation need to know about them.

    Attributes:
        train, eval: the examples.
        format: the data format (:mod:`scale.formats`).
        label_token_ids: a token per label when every label is one token (classification), else ``None``.
        label_seqs: the tokens of each label (classification), else ``[]``.
        has_target: the text format's rows carry a ``target`` token.
        stats: counts for the log: ``data/train_rows``, ``data/eval_rows``, ``data/duplicates_removed``,
            ``data/eval_rows_in_train``, ``data/dropped_long_rows``.
    """

    train: list[Example]
    eval: list[Example]
    label_token_ids: list[int] | None
    format: str = "classification"
    label_seqs: list[list[int]] = field(default_factory=list)
    has_target: bool = False
    stats: dict[str, int] = field(default_factory=dict)


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


def build_splits(data_cfg: DataConfig, loss_cfg: LossConfig, tokenizer: Any, path: str, seed: int,
                 tokenize: Any = None) -> Splits:
    """Load, de-duplicate (optionally), filter, split and tokenize: the whole data pipeline up to the DataLoader.

    Args:
        tokenize: ``tokenize(name, rows, builder) -> Sequence[Example]`` (``name``: train/eval; dropped rows go to
            ``builder.dropped``); default in memory. :mod:`scale.cache` writes the token cache with it [issue 18].

    Raises:
        DataError: see :func:`scale.formats.load_rows`, :func:`split_rows`, :func:`tokenize_rows`.
    """
    rows = load_rows(data_cfg, path)
    fmt = row_format(rows[0])
    if fmt != "text" and (loss_cfg.threshold, loss_cfg.target_position) != (2, -2):
        logger.warning("loss.threshold=%d and loss.target_position=%d apply to the text format only; the %s format "
                       "trains each row's own tail (see scale/data.py)", loss_cfg.threshold, loss_cfg.target_position,
                       fmt)
    removed = 0
    if data_cfg.deduplicate:
        rows, removed = deduplicate(rows)
    if data_cfg.max_text_chars is not None and fmt in ("text", "classification"):
        rows = [r for r in rows if len(r["text"]) <= data_cfg.max_text_chars]
    # [issue 18] data.eval_path / data.eval_split: eval rows from their own source, none carved out of `path`.
    eval_source = eval_source_of(data_cfg, path)
    if eval_source is None:
        train_rows, eval_rows = split_rows(rows, data_cfg.eval_size, seed)
    else:
        (train_rows, _), eval_rows = split_rows(rows, 0, seed), load_rows(*eval_source)
        if row_format(eval_rows[0]) != fmt:
            raise DataError(f"the eval rows of {eval_source[1]} are {row_format(eval_rows[0])} rows, the train rows "
                            f"of {path} {fmt} rows; give both sources the same columns (or set data.format)")
        eval_rows, dropped = deduplicate(eval_rows) if data_cfg.deduplicate else (eval_rows, 0)
        removed += dropped
        if data_cfg.max_text_chars is not None and fmt in ("text", "classification"):
            eval_rows = [r for r in eval_rows if len(r["text"]) <= data_cfg.max_text_chars]
    if data_cfg.max_train_examples is not None:
        train_rows = train_rows[: data_cfg.max_train_examples]
    in_train = {row_key(r) for r in train_rows}
    overlap = sum(row_key(r) in in_train for r in eval_rows)
    builder = _Builder(tokenizer, data_cfg)
    tokenize = tokenize or (lambda name, part, b: _tokenize(part, b, loss_cfg))  # [issue 18] the cache's seam
    train, held = tokenize("train", train_rows, builder), tokenize("eval", eval_rows, builder)
    if not train or not held:
        raise DataError(f"data.drop_long_completions dropped every {'train' if not train else 'eval'} row; raise "
                        f"data.max_length")
    seqs = label_sequences(tokenizer, data_cfg) if fmt == "classification" else []
    stats = {"data/train_rows": len(train), "data/eval_rows": len(held), "data/duplicates_removed": removed,
             "data/eval_rows_in_train": overlap, "data/dropped_long_rows": len(builder.dropped)}
    if builder.dropped:
        logger.warning("data.drop_long_completions: dropped %d rows whose tail does not fit in data.max_length=%d "
                       "(data-file rows %s)", len(builder.dropped), data_cfg.max_length, builder.dropped[:20])
    return Splits(train=train, eval=held,
                  label_token_ids=[s[0] for s in seqs] if seqs and all(len(s) == 1 for s in seqs) else None,
                  format=fmt, label_seqs=seqs, has_target=fmt == "text" and "target" in rows[0], stats=stats)
