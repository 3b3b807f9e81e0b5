"""``preference``: pairs of answers to one prompt, ``chosen`` preferred over ``rejected`` (DPO and its family).

A row is a *pair*: ``prompt`` (optional), ``chosen`` and ``rejected`` (``data.prompt_column``,
``data.chosen_column``, ``data.rejected_column``), in TRL's two conventions
(https://huggingface.co/docs/trl/dataset_formats#preference):

- **explicit prompt**: ``prompt`` holds the prompt, ``chosen``/``rejected`` the two completions. As text (the
  prompt's tokens, then the completion's tokens + EOS, as ``prompt_completion`` encodes a row), or as lists of
  messages (the prompt's messages, then the completion's, rendered by the chat template; the completion's
  assistant turns are trained, each through its end-of-turn marker, as :mod:`scale.data.tasks.messages` trains a
  chat; a ``tools`` column is the template's ``tools``).
- **implicit prompt**: no prompt column (or a text prompt beside conversational sides, which TRL also ignores):
  ``chosen``/``rejected`` are whole texts or conversations and the prompt is their longest common prefix
  (``trl.extract_prompt``: messages compared one by one; a text compared character by character, a space before
  the first difference going to the completions).

**Tokens** (``data.pair_conventions``): ``scale`` (default) as above; ``trl``: the tokens TRL 1.16's trainer of the
objective makes (DPOTrainer for ``dpo``, CPO/ORPOTrainer for ``simpo``/``orpo``; :mod:`scale.data.tasks.trl_pairs`:
prompt and answer encoded as one text, their BOS and EOS, a chat's rendering trained to its end).

Each pair becomes **two examples**, chosen then rejected, adjacent and in that order, each with the pair's row
index: the trained tail of each side is its completion, end-of-turn included; the prompt is shared. Every later
stage keeps them together: :class:`PairedExamples` shows a split as pairs (what samplers, packers and the
accumulation windows count), :class:`PairCollator` lays each micro-batch's pairs out as rows ``2p`` (chosen) and
``2p + 1`` (rejected), so a pair is never split across ranks or accumulation windows.

**Length** (``data.max_length``, ``data.truncation``): both sides of a pair keep one prompt, the one that lets the
*longer* side fit: a text pair the prompt's last tokens; a conversational pair is cut as one chat
(:meth:`scale.data.tasks.messages.Messages.encode_sides`: both sides lose the same oldest exchanges of the shared
prompt, then the same start of its user text, the longer side exactly as a chat of its own would be cut). ``drop``
drops a pair whose longer side is over the limit; an answer that cannot fit with its prompt cut is an error naming
the row and the side, or dropped with ``data.drop_long_completions``; a pair either side of which would be dropped
is dropped whole. A dropped pair counts once in ``data/dropped_long_rows``, a pair whose prompt was cut once in
``data/<split>_rows_truncated`` (and what it lost: the larger of its sides' counts).

Bad input stops with one line naming the row: a missing or empty side, chosen identical to rejected, sides of
different kinds (text and messages), conversations whose prompts differ (after the common prefix a side does not
continue with an assistant turn), a pair that does not fit (above).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from scale.config.schema import DataConfig, LossConfig
from scale.data.read import DataError
from scale.data.tasks.base import BY_LONG_COMPLETIONS, Builder, Example, Task, encode
from scale.data.tasks.chat_rows import read_messages, read_tools
from scale.data.tasks.messages import COUNTS, Messages
from scale.data.tasks.trl_pairs import text_pair, trainer_rule, trl_texts

SIDES = ("chosen", "rejected")


def _cell(raw: dict[str, Any], column: str) -> Any:
    """A side as the file holds it: text, a list of messages, or a CSV cell holding a JSON list."""
    value = raw.get(column)
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            parsed = json.loads(value)
            if isinstance(parsed, list):
                return parsed
        except json.JSONDecodeError:
            pass
    return value


def _empty(value: Any) -> bool:
    return value is None or (isinstance(value, str) and not value.strip()) or (isinstance(value, list) and not value)


def common_prefix(chosen: Sequence[Any], rejected: Sequence[Any]) -> int:
    """Length of the shared prompt of an implicit-prompt pair, as ``trl.extract_prompt`` finds it: the longest
    common prefix (of messages, or of characters; for text, a space just before the first difference belongs to
    the completions)."""
    idx = min(len(chosen), len(rejected))
    for j in range(idx):
        if chosen[j] != rejected[j]:
            idx = j - 1 if j > 0 and chosen[j - 1] == " " else j
            break
    return idx


class Preference(Task):
    """The ``preference`` format: a row is a pair; it encodes as two examples, chosen then rejected."""

    name = "preference"
    #: the examples a row becomes, in order (``--show-rows`` names them)
    sides: ClassVar[tuple[str, ...]] = SIDES
    counted = Task.counted + COUNTS

    def __init__(self) -> None:
        super().__init__()
        self.chat: Messages | None = None
        self.rule: str | None = None  # data.pair_conventions=trl: the TRL trainer whose tokens (trl_pairs.DPO/CPO)
        self.eos_text = ""

    def columns(self, cfg: DataConfig) -> list[str]:
        return [cfg.chosen_column, cfg.rejected_column]

    def optional_columns(self, cfg: DataConfig) -> list[str]:
        return [cfg.prompt_column, cfg.tools_column]

    def read(self, raw: dict[str, Any], cfg: DataConfig, i: int, path: str) -> dict[str, Any]:
        """Check one pair.

        Returns:
            ``{"prompt": str, "chosen": str, "rejected": str}`` (text), or ``{"prompt": [messages], "chosen":
            [messages], "rejected": [messages]}`` (+ ``tools``) for a conversational pair, the prompt extracted for
            an implicit-prompt pair.

        Raises:
            DataError: a missing or empty side, chosen == rejected, sides of different kinds, conversations whose
                prompts differ, an empty implicit prompt, messages that are not valid (see
                :func:`scale.data.tasks.messages.read_messages`).
        """
        where = f"row {i} of {path}"
        sides = {s: _cell(raw, getattr(cfg, f"{s}_column")) for s in SIDES}
        for s, value in sides.items():
            if _empty(value):
                raise DataError(f"{where}: the {s} side ({getattr(cfg, f'{s}_column')!r}) is missing or empty; every "
                                f"preference pair needs a chosen and a rejected answer: add the {s} answer to the "
                                f"row, or remove the row")
        chosen, rejected = sides["chosen"], sides["rejected"]
        if isinstance(chosen, list) != isinstance(rejected, list) or not isinstance(chosen, (str, list)) or \
                not isinstance(rejected, (str, list)):
            raise DataError(f"{where}: chosen is {type(chosen).__name__} and rejected is {type(rejected).__name__}; "
                            f"both sides are text or both are lists of messages")
        if chosen == rejected:
            raise DataError(f"{where}: chosen and rejected are identical, so the pair prefers nothing; fix or remove "
                            f"the row")
        prompt = _cell(raw, cfg.prompt_column)
        if isinstance(chosen, str):
            if prompt is None:  # implicit prompt: the common start of both texts
                k = common_prefix(chosen, rejected)
                prompt, chosen, rejected = chosen[:k], chosen[k:], rejected[k:]
            elif not isinstance(prompt, str):
                raise DataError(f"{where}: the prompt is {type(prompt).__name__} but the sides are text; write the "
                                f"prompt as text too")
            if not prompt.strip():
                raise DataError(f"{where}: the pair has no prompt (empty {cfg.prompt_column!r}, or no common start of "
                                f"chosen and rejected); nothing precedes the answers")
            if not chosen.strip() or not rejected.strip():
                raise DataError(f"{where}: after the shared prompt, one side is empty; every side needs an answer")
            return {"prompt": prompt, "chosen": chosen, "rejected": rejected}
        return self._read_chat(raw, cfg, prompt, chosen, rejected, where, i, path)

    def _read_chat(self, raw: dict[str, Any], cfg: DataConfig, prompt: Any, chosen: list[Any], rejected: list[Any],
                   where: str, i: int, path: str) -> dict[str, Any]:
        if not isinstance(prompt, list):  # implicit prompt (a text prompt beside conversations is ignored, as TRL)
            k = common_prefix(chosen, rejected)
            prompt, chosen, rejected = chosen[:k], chosen[k:], rejected[k:]
        if not prompt:
            raise DataError(f"{where}: the conversations have no prompt (no {cfg.prompt_column!r} list and no common "
                            f"first messages); nothing precedes the answers")
        for s, side in zip(SIDES, (chosen, rejected)):
            if not side or not isinstance(side[0], dict) or side[0].get("role") != "assistant":
                first = side[0].get("role") if side and isinstance(side[0], dict) else None
                raise DataError(f"{where}: the prompts of chosen and rejected differ: after their {len(prompt)} "
                                f"common message(s) the {s} side continues with {first!r}, not an assistant turn; "
                                f"both sides must share every message before the answers")
        out = {"prompt": read_messages(prompt + chosen, cfg.chosen_column, i, path)[:len(prompt)],
               "chosen": read_messages(prompt + chosen, cfg.chosen_column, i, path)[len(prompt):],
               "rejected": read_messages(prompt + rejected, cfg.rejected_column, i, path)[len(prompt):]}
        return {**out, **read_tools(raw, cfg, i, path)}

    def prepare(self, tokenizer: Any, data_cfg: DataConfig, loss_cfg: LossConfig) -> None:
        """Prepare the chat task that renders conversational pairs, when there is a chat template (its text enters
        the fingerprint, as for chats); text pairs need none. ``data.pair_conventions: trl`` picks the TRL trainer
        whose tokens the pairs get (:mod:`scale.data.tasks.trl_pairs`, by ``loss.objective``)."""
        self.rule = trainer_rule(loss_cfg.objective) if data_cfg.pair_conventions == "trl" else None
        self.eos_text = tokenizer.eos_token or ""
        self.chat, self._missing = Messages(), None
        try:
            self.chat.prepare(tokenizer, data_cfg, loss_cfg)
            self.chat.pair_rule = self.rule
        except DataError as e:
            self.chat, self._missing = None, e

    def _chat(self) -> Messages:
        """The chat task that renders conversational pairs.

        Raises:
            DataError: there is no chat template (the message of :func:`scale.data.tasks.messages.chat_template`).
        """
        if self.chat is None:
            raise self._missing or DataError("the preference format was not prepared")
        return self.chat

    def check(self, tokenizer: Any, rows: list[dict[str, Any]]) -> None:
        chats = [self._as_chat(r, "chosen") for r in rows if isinstance(r["chosen"], list)]
        if chats:
            self._chat().check(tokenizer, chats)

    @staticmethod
    def _as_chat(row: dict[str, Any], side: str) -> dict[str, Any]:
        chat = {"messages": row["prompt"] + row[side], "completion_from": len(row["prompt"]), "row": row.get("row", -1)}
        return {**chat, **({"tools": row["tools"]} if row.get("tools") else {}),
                **({"type": row["type"]} if "type" in row else {})}

    def fingerprint(self) -> str:
        return self.chat.fingerprint() if self.chat is not None else ""

    def texts(self, row: dict[str, Any], cfg: DataConfig) -> list[str]:
        if not isinstance(row["chosen"], str):
            return []
        if self.rule:
            return trl_texts(self.rule, row["prompt"], row["chosen"], row["rejected"], self.eos_text)
        return [row["prompt"], row["chosen"], row["rejected"]]

    def encode(self, row: dict[str, Any], b: Builder, loss_cfg: LossConfig) -> list[Example] | None:
        """The pair as ``[chosen, rejected]`` (each with the pair's row index), or ``None`` when it is dropped
        (``data.truncation=drop`` or ``data.drop_long_completions``).

        Raises:
            DataError: a completion that cannot fit in ``data.max_length`` (names the row).
        """
        if isinstance(row["chosen"], list):
            return self._encode_chat(row, b)
        i = row.get("row", -1)
        if self.rule:  # TRL's tokens: per side (front, prompt, answer); DPOTrainer's prompt is shared
            sides = text_pair(b, self.rule, row["prompt"], (row["chosen"], row["rejected"]))
        else:
            prefix, prompt = b.front(encode(b.tokenizer, row["prompt"]))
            sides = [(prefix, prompt, b.with_eos(encode(b.tokenizer, row[s]))) for s in SIDES]
        # The longer side decides how many prompt tokens both lose: one prompt, and the pair counts once.
        longest = max(range(len(SIDES)), key=lambda s: sum(map(len, sides[s])))
        front, prompt, tail = sides[longest]
        ids = b.assemble(front, prompt, tail, i, f"the {SIDES[longest]} answer (its completion + EOS)", "pair")
        if ids is None:
            return None
        cut = len(front) + len(prompt) + len(tail) - len(ids)
        t = int(row.get("type", 0))
        out = [Example(f + p[cut:] + a, len(a), t, 0, -1, i) for f, p, a in sides]
        bare = [s for s, e in zip(SIDES, out) if len(e.input_ids) == e.tail_len]  # a TRL side's prompt, 1 shorter
        if bare:
            if b.cfg.drop_long_completions:
                b.drop(i, max(len(f) + len(p) + len(a) for f, p, a in sides), BY_LONG_COMPLETIONS)
                return None
            raise DataError(f"row {i}: cut to data.max_length={b.cfg.max_length}, the {bare[0]} answer keeps no prompt "
                            f"token before it; raise data.max_length, or set data.drop_long_completions=true to drop "
                            f"such pairs (counted in the log)")
        return out

    def _encode_chat(self, row: dict[str, Any], b: Builder) -> list[Example] | None:
        """A conversational pair: both sides cut as one (:meth:`scale.data.tasks.messages.Messages.encode_sides`):
        the cut of their shared prompt that lets the longer side fit, so both keep the same prompt tokens."""
        prompt = row["prompt"]
        return self._chat().encode_sides(self._as_chat(row, "chosen"), [prompt + row[s] for s in SIDES], len(prompt),
                                         "all_assistant", b, len(prompt), SIDES)

    def info(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        return {"pairs": True}


class Pair(list):
    """One pair of a preference split: ``[chosen, rejected]`` examples, and ``ref`` ``[2]`` float64, the pair's
    precomputed reference log-probabilities (``None`` when the run computes them in the step)."""

    def __init__(self, chosen: Example, rejected: Example, ref: Tensor | None = None) -> None:
        super().__init__([chosen, rejected])
        self.ref = ref


class PairedExamples(Sequence):
    """A preference split seen as pairs: item ``p`` is the :class:`Pair` of examples ``2p`` and ``2p + 1`` (the
    order :meth:`Preference.encode` made them in). Samplers, packers and the loader deal in these items, so the
    two sides of a pair always share a micro-batch.

    Args:
        examples: the split's examples (a list or a cached :class:`scale.data.token_table.TokenTable`), an even
            number, sides adjacent.
        ref_logps: ``[2 x pairs]`` float64, the reference log-probabilities of example ``2p + s`` (side ``s`` of
            pair ``p``), from :func:`scale.objectives.preference.reference_logps`; ``None``: computed in the step.

    Raises:
        ValueError: an odd number of examples, or ``ref_logps`` of another length.
    """

    def __init__(self, examples: Sequence[Example], ref_logps: Tensor | None = None) -> None:
        if len(examples) % 2:
            raise ValueError(f"a preference split holds pairs of examples, got {len(examples)} examples")
        if ref_logps is not None and ref_logps.shape != (len(examples),):
            raise ValueError(f"ref_logps has shape {tuple(ref_logps.shape)}, the split {len(examples)} examples")
        self.examples = examples
        self.ref_logps = ref_logps
        self.task = getattr(examples, "task", None)

    def __len__(self) -> int:
        return len(self.examples) // 2

    def __getitem__(self, p: int) -> Pair:  # type: ignore[override]
        if not 0 <= p < len(self):
            raise IndexError(f"pair {p} of {len(self)}")
        ref = None if self.ref_logps is None else self.ref_logps[2 * p:2 * p + 2]
        return Pair(self.examples[2 * p], self.examples[2 * p + 1], ref)

    def lengths(self) -> list[int]:
        """Tokens of each pair's longer side (what length grouping sorts by)."""
        return [max(len(c.input_ids), len(r.input_ids)) for c, r in self]


class PairCollator:
    """Collate a micro-batch of pairs: the ``P`` pairs' examples, chosen then rejected, become the ``2P`` rows of
    the inner collator's batch (padded :class:`scale.data.collate.Collator` or padding-free), row ``2p`` the chosen
    and ``2p + 1`` the rejected side of pair ``p``. The batch also gets ``pair_row`` ``[P]`` int64 (the pair's
    data-file row) and, when the pairs carry them (:class:`Pair`), ``ref_logps`` ``[2P]`` float64, in row order.

    Args:
        inner: the collator of examples.

    Raises:
        ValueError: a pair whose sides come from different rows (the examples were not in pairs), or pairs of
            which only some carry reference log-probabilities.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __call__(self, pairs: list[Pair]) -> dict[str, Tensor]:
        if any(c.row != r.row for c, r in pairs):
            raise ValueError("a pair's two sides come from different rows; the split's examples are not in pairs")
        batch = self.inner([e for pair in pairs for e in pair])
        batch["pair_row"] = torch.tensor([c.row for c, _ in pairs], dtype=torch.long)
        refs = [getattr(p, "ref", None) for p in pairs]
        if any(r is not None for r in refs):
            if any(r is None for r in refs):
                raise ValueError("some pairs of the micro-batch carry reference log-probabilities and some do not")
            batch["ref_logps"] = torch.cat(refs).to(torch.float64)
        return batch


class PackedPairCollator(PairCollator):
    """Collate a micro-batch of *bins* of pairs (``data.packing``: :class:`scale.data.order.PackedRows` over
    :class:`PairedExamples`, bins of :func:`pair_capacity` tokens): the bins' pairs, in order, collated by
    :class:`PairCollator` around a padding-free collator (:class:`scale.data.collate.PaddingFreeCollator`), so the
    micro-batch is one packed row ``[1, L]`` whose examples are the sides of its pairs, chosen then rejected,
    each with its own segment (``seq_lens``) and restarting ``position_ids``: each side's tail log-probability is
    summed over its own segment. A bin never splits a pair, so a pair never spans two ranks or two accumulation
    windows.

    Args:
        inner: the padding-free collator of examples.
    """

    def __call__(self, bins: list[list[Pair]]) -> dict[str, Tensor]:  # type: ignore[override]
        return super().__call__([pair for b in bins for pair in b])


def pair_capacity(max_length: int) -> int:
    """Tokens per bin when pairs are packed (``data.packing``): ``2 x data.max_length``, so that every pair fits
    whole (each of its sides is at most ``data.max_length`` tokens) and no pair is ever cut or refused by
    packing."""
    return 2 * max_length
