"""Where each trained assistant turn lies in a rendered conversation, from rendering positions only (never by
searching for the turn's text): its start after its own generation prompt, its end after its end-of-turn marker.
"""

from __future__ import annotations

from typing import Any

from scale.data.read import DataError
from scale.data.tasks.chat_rows import REASONING_KEYS
from scale.data.tasks.chat_template import render, special_strings


def _end_of_turn(text: str, specials: list[str]) -> int | None:
    """Where a rendered turn ends: right after its last special token when only whitespace follows it."""
    body = text.rstrip()
    for s in specials:
        if body.endswith(s):
            return len(body)
    return None


def _without_marker(text: str, specials: list[str]) -> str:
    """A turn's text without the special token that ends it (what the turn says)."""
    for s in specials:
        if text.endswith(s):
            return text[:-len(s)]
    return text


def first_difference(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _history_end(full: str, start: int, as_last: str, specials: list[str]) -> int | None:
    """Where a turn that the template renders differently in history ends in ``full``, from its own rendering.

    ``as_last`` is the turn as the template renders it when it is the last one (after its generation prompt). The
    history rendering at ``start`` is the shortest run ``full[start:p]`` ending with the same end-of-turn marker
    that is an end of ``as_last`` (a Qwen3-style template drops the ``<think>`` block in front of the answer).
    Returns ``p - start``, or ``None`` when no such run exists.
    """
    end = _end_of_turn(as_last, specials)
    if end is None:
        return None
    body = as_last[:end]
    marker = next(s for s in specials if body.endswith(s))
    p = full.find(marker, start)
    while p >= 0:
        if body.endswith(full[start:p + len(marker)]):
            return p + len(marker) - start
        p = full.find(marker, p + 1)
    return None


def _reasoning(message: dict[str, Any]) -> str:
    return next((str(message[k]).strip() for k in REASONING_KEYS if isinstance(message.get(k), str)
                 and message[k].strip()), "")


def spans(tokenizer: Any, template: str, messages: list[dict[str, Any]], i: int, train_on: str,
          first: int = 0, tools: list[dict[str, Any]] | None = None, kwargs: dict[str, Any] | None = None,
          name: str = "the chat template", notes: dict[str, int] | None = None
          ) -> tuple[str, list[tuple[int, int]], bool]:
    """Render a conversation and find the character spans of its trained assistant turns, from renderings only.

    Turn ``k`` starts where the generation prompt of ``messages[:k]`` ends (that prompt must be the start of the
    rendering; of an earlier turn's prompt, the part the rendering holds after the messages before it) and ends
    right after the special token that closes the rendered turn (or after its text, trailing whitespace dropped).
    A turn the template renders differently as history ends where :func:`_history_end` finds it. A turn that renders as nothing but its end-of-turn marker is not trained (``notes["empty_turns"]``);
    a trained turn's reasoning (``reasoning_content``/``thinking``) that the rendering lacks is counted
    (``history_reasoning_dropped`` when its last-turn rendering holds it, else ``reasoning_not_rendered``).

    Args:
        train_on: ``all_assistant`` or ``last_assistant``.
        first: only messages from this index on are trained (a conversational prompt/completion row).
        name: the template in words (:func:`template_name`), for messages.
        notes: counts to add to (see above); ``None``: not counted.

    Returns:
        ``(text, spans, append_eos)``: the rendered conversation, ``[(start, end)]`` ascending, and whether the
        last turn has no end-of-turn special token (EOS is then appended to it).

    Raises:
        DataError: the template raises, the generation prompt is not the start of the rendered last turn, the
            last turn renders as nothing, or an earlier turn has no exact location in the rendering (one line
            naming the template and the turn).
    """
    specials = special_strings(tokenizer)
    notes = {} if notes is None else notes
    full = render(tokenizer, template, messages, i, tools=tools, kwargs=kwargs)
    turns = [k for k, m in enumerate(messages) if m["role"] == "assistant" and k >= first]
    if train_on == "last_assistant":
        turns = turns[-1:]
    out: list[tuple[int, int]] = []
    add_eos = False
    for k in turns:
        last = k == len(messages) - 1
        prompt = render(tokenizer, template, messages[:k], i, generation=True, tools=tools, kwargs=kwargs)
        whole = full if last else render(tokenizer, template, messages[:k + 1], i, tools=tools, kwargs=kwargs)
        lo = out[-1][1] if out else 0
        if not whole.startswith(prompt) or last and not full.startswith(prompt):
            n = first_difference(prompt, whole)
            which = "last assistant turn" if last else f"assistant turn (message {k})"
            raise DataError(f"row {i}: the chat template's generation prompt is not the start of the rendered "
                            f"{which}: after {whole[max(0, n - 30):n]!r} the prompt continues "
                            f"{prompt[n:n + 40]!r} but the conversation {whole[n:n + 40]!r}; the model would be "
                            f"trained after a prompt inference never sends. Fix data.chat_template so that its "
                            f"generation prompt is what the rendered turn starts with")
        start, as_last = len(prompt), whole[len(prompt):]
        if not full.startswith(prompt) or start < lo:
            # The history rendering may hold only the start of the generation prompt (Qwen3 with enable_thinking:
            # false opens every generation with an empty <think> block that history turns lack): the turn then
            # starts after the part of its prompt the conversation holds, if all of the messages before it are.
            before = render(tokenizer, template, messages[:k], i, tools=tools, kwargs=kwargs)
            start = first_difference(prompt, full)
            if not full.startswith(before) or start < max(len(before), lo):
                raise DataError(f"row {i}: {name} renders the messages before assistant message {k} differently "
                                f"once later messages follow, so where that turn starts cannot be told from the "
                                f"template's own rendering; set data.train_on=all_assistant_as_last (every assistant "
                                f"turn the last of a row of its own) or data.train_on=last_assistant")
        if last or start == len(prompt) and full.startswith(whole):
            turn = as_last
        else:
            length = _history_end(full, start, as_last, specials)
            if length is None:
                raise DataError(f"row {i}: {name} renders assistant message {k} differently once later messages "
                                f"follow (as history), and its rendering there is no end of its rendering as the "
                                f"last turn, so its span has no exact location; set data.train_on="
                                f"all_assistant_as_last (every assistant turn the last of a row of its own) or "
                                f"data.train_on=last_assistant")
            turn = full[start:start + length]
        end = _end_of_turn(turn, specials)
        if end is None:
            end, add_eos = len(turn.rstrip()), last
        said = _without_marker(turn[:end], specials)
        if not said.strip():
            if last:
                raise DataError(f"row {i}: {name} renders the last assistant message ({k}) as no text but its "
                                f"end-of-turn marker, so nothing would be trained; check the row and "
                                f"data.chat_template")
            notes["empty_turns"] = notes.get("empty_turns", 0) + 1
            continue
        reasoning = _reasoning(messages[k])
        if reasoning and reasoning not in said:
            key = "history_reasoning_dropped" if reasoning in as_last else "reasoning_not_rendered"
            notes[key] = notes.get(key, 0) + 1
        out.append((start, start + end))
    for m in messages:
        if m["role"] == "system" and m["content"].strip() and m["content"].strip() not in full:
            notes["system_not_rendered"] = notes.get("system_not_rendered", 0) + 1
    return full, out, add_eos


def content_ranges(full: str, messages: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """Character ranges of the messages' text in the rendering (found in order; text the template changed is
    not found and not protected). Only for encoding special-token spellings as text, never for trained spans."""
    ranges, pos = [], 0
    for m in messages:
        content = m.get("content") or ""
        at = full.find(content, pos) if content else -1
        if at >= 0:
            ranges.append((at, at + len(content)))
            pos = at + len(content)
    return ranges


def find_all(text: str, s: str, a: int, z: int) -> list[int]:
    found, p = [], text.find(s, a)
    while 0 <= p and p + len(s) <= z:
        found.append(p)
        p = text.find(s, p + len(s))
    return found


def render_chat(tokenizer: Any, template: str, messages: list[dict[str, Any]], i: int,
                tools: list[dict[str, Any]] | None = None) -> tuple[str, str, bool]:
    """The last assistant turn of a conversation as ``(prompt_text, tail_text, append_eos)`` (see :func:`spans`).

    Raises:
        DataError: see :func:`spans`.
    """
    full, cut, add_eos = spans(tokenizer, template, messages, i, "last_assistant", tools=tools)
    (start, end), = cut
    return full[:start], full[start:end], add_eos
