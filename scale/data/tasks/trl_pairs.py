"""TRL's token conventions for preference pairs (``data.pair_conventions: trl``): the tokens TRL 1.16's trainers
make of a pair, so that a run on the same data and model gives TRL's numbers. Plain lists, no torch.

Which trainer: ``loss.objective: dpo`` follows ``trl.DPOTrainer``; ``simpo`` follows
``trl.experimental.cpo.CPOTrainer`` (``loss_type="simpo"``) and ``orpo`` ``trl.experimental.orpo.ORPOTrainer``,
which share one tokenizer (``build_tokenized_answer`` and ``tokenize_row``, identical in both). Where they differ
from scale's default (``data.pair_conventions: scale``, :mod:`scale.data.tasks.preference`):

- **The prompt's last token** (text pairs). scale encodes the prompt on its own, then each answer: a prompt that
  ends in a space keeps that space as a token (``Answer:`` ``Ġ`` ``William``). TRL encodes prompt + answer as one
  text and the answer starts where those tokens and the prompt's own part (``Answer:`` ``ĠWilliam``).
  DPOTrainer (``_prepare_dataset``): the shared prompt is the tokens the prompt alone has in common with *both*
  prompt + answer encodings (``common_prefix_length``); the rest of each is its answer. CPO/ORPO: per side, the
  answer starts after the prompt's tokens, one earlier when the last one merged (``build_tokenized_answer``), so
  the two sides' prompts may differ in that token.
- **BOS and EOS** (text pairs). DPOTrainer encodes with the tokenizer's own special tokens (SmolLM2 adds none,
  Llama's adds BOS) and appends the EOS *text* to an answer not ending in it. CPO/ORPO encode without special
  tokens, then put the tokenizer's ``bos_token_id`` in front of each side unless it already starts with it (for
  SmolLM2, ``<|im_start|>``) and append ``eos_token_id`` unless the answer ends with it.
- **Chats** (lists of messages). DPOTrainer tokenizes the template's rendering of the prompt (with its generation
  prompt) and of prompt + answer; the answer is everything after the shared prompt tokens: the end-of-turn marker
  *and what the template writes after it* (ChatML's newline), every completion message trained, nothing appended.
  CPO/ORPO render the chat to text and tokenize that as a text pair: the rendering after the end-of-turn marker is
  trained too, BOS goes in front unless the rendering starts with it, and EOS is appended unless the rendering's
  last token is EOS (ChatML + SmolLM2: ``<|im_end|>`` ``\\n`` ``<|im_end|>``).
  These are carried out by :class:`scale.data.tasks.messages.Messages` (its ``pair_rule``).

ORPO's NLL term (the chosen row's every token after the first, pooled over the micro-batch) is in
:mod:`scale.objectives.preference`; what stays scale's under ``trl`` (length rules, special-token spellings) is in
``docs/preference.md``.
"""

from __future__ import annotations

from typing import Any

from scale.data.tasks.base import Builder, encode

DPO, CPO = "dpo", "cpo"
"""The two tokenizations of TRL 1.16: DPOTrainer's, and CPOTrainer's (= ORPOTrainer's)."""


def trainer_rule(objective: str) -> str:
    """Which TRL tokenization ``loss.objective`` follows: :data:`DPO` for ``dpo``, :data:`CPO` for ``simpo`` and
    ``orpo`` (TRL's CPOTrainer and ORPOTrainer)."""
    return DPO if objective == "dpo" else CPO


def common_prefix_length(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share (``trl.data_utils.common_prefix_length``)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def dpo_answer_text(answer: str, eos_token: str) -> str:
    """The answer as DPOTrainer encodes it: with the EOS *text* appended unless it ends with it (``add_eos``)."""
    return answer if answer.endswith(eos_token) else answer + eos_token


def trl_texts(rule: str, prompt: str, chosen: str, rejected: str, eos_token: str) -> list[str]:
    """The texts :func:`text_pair` passes to ``tokenizer(text, add_special_tokens=False)`` (for the token cache's
    batched encode)."""
    if rule == DPO:
        return [prompt] + [prompt + dpo_answer_text(a, eos_token) for a in (chosen, rejected)]
    return [prompt, prompt + chosen, prompt + rejected]


def text_pair(b: Builder, rule: str, prompt: str,
              answers: tuple[str, str]) -> list[tuple[list[int], list[int], list[int]]]:
    """A text pair's tokens as TRL 1.16 makes them, per side ``(front, prompt, answer)``: ``front`` the special
    token(s) that always lead (kept when the prompt is cut), then the side's prompt tokens, then its trained answer.

    Args:
        b: the builder (its tokenizer; ``b.eos``).
        rule: :data:`DPO` or :data:`CPO` (:func:`trainer_rule`).
        prompt: the pair's prompt text.
        answers: ``(chosen, rejected)`` texts.

    Returns:
        ``[chosen, rejected]``, each ``(front, prompt_ids, answer_ids)``. DPO: one shared prompt. CPO: each side's
        own (they can differ in their last token).
    """
    tok = b.tokenizer
    if rule == DPO:
        prefix, suffix = b.prefix, b.suffix
        alone = prefix + encode(tok, prompt) + suffix
        whole = [prefix + encode(tok, prompt + dpo_answer_text(a, tok.eos_token)) + suffix for a in answers]
        n = min(common_prefix_length(alone, w) for w in whole)   # the prompt tokens both sides keep
        front = prefix[:n]
        return [(front, alone[len(front):n], w[n:]) for w in whole]
    alone, out = encode(tok, prompt), []
    for a in answers:
        whole = encode(tok, prompt + a)
        start = len(alone) - (whole[:len(alone)] != alone)   # one earlier: the prompt's last token merged
        side, answer = prepend_bos(tok, whole[:start]), whole[start:]
        if not answer or answer[-1] != b.eos:
            answer = answer + [b.eos]
        front = side[:1] if tok.bos_token_id is not None and side[:1] == [tok.bos_token_id] else []
        out.append((front, side[len(front):], answer))
    return out


def prepend_bos(tokenizer: Any, ids: list[int]) -> list[int]:
    """``ids`` with the tokenizer's ``bos_token_id`` in front unless they start with it or it has none
    (CPO/ORPOTrainer's ``add_bos_token_if_needed``)."""
    bos = tokenizer.bos_token_id
    return ids if bos is None or ids[:1] == [bos] else [bos] + ids
