"""``messages``: a conversation rendered by the chat template; its assistant turns are trained.

``data.train_on=all_assistant`` (default, as TRL, axolotl, torchtune and LLaMA-Factory do) trains every assistant
turn; ``last_assistant`` only the last. Each trained turn runs from its first content token (where the template's
generation prompt for the conversation so far ends) through the end-of-turn marker the template renders after it;
a template without a special end-of-turn token gets EOS appended to the last turn. The row is cut after the last
assistant turn. The tail (:mod:`scale.data.tokenize`) starts at the first trained token; the user/tool tokens
inside it weigh 0 (``Example.trained``).

Every message key passes to the template (``tool_calls``, a tool turn's ``name``/``tool_call_id``,
``reasoning_content``/``thinking``); a ``tools`` column (``data.tools_column``) is the template's ``tools``;
``data.chat_template_kwargs`` are passed as template variables. Template hygiene, each with one outcome:

- a template that raises (``raise_exception``): one line naming the row and the template's message;
- the generation prompt must be the start of the rendered last turn (else one line showing where they differ);
- a special-token spelling inside message text is encoded as text, never as a control token (counted in the log);
- the template's own BOS is kept once, the tokenizer's is never added again;
- a template that reads the clock (``strftime_now``) is refused unless ``data.chat_template_kwargs`` pins what
  it renders (e.g. ``date_string``); the template text enters the resume fingerprint (:mod:`scale.data.tokenize`).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

from scale.config import DataConfig, LossConfig
from scale.data.read import DataError
from scale.data.tasks.base import Builder, CompletionTask, Example, encode, encode_literal

logger = logging.getLogger(__name__)
ROLES = ("system", "user", "assistant", "tool")
_PLAIN_KEYS = {"role", "content"}


def read_messages(value: Any, column: str, i: int, path: str) -> list[dict[str, Any]]:
    """Check one row's conversation; every key of a message is kept (the template decides what it renders).

    Raises:
        DataError: not a non-empty list of messages, a role outside :data:`ROLES`, content that is not text (an
            assistant turn with ``tool_calls`` may have none), no assistant turn, a last turn that is not the
            assistant's or is empty.
    """
    if isinstance(value, str):  # a CSV cell holding JSON
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            pass
    if not isinstance(value, list) or not value:
        raise DataError(f"row {i} of {path}: {column!r} must be a non-empty list of {{role, content}} messages, "
                        f"got {type(value).__name__}")
    messages = []
    for j, m in enumerate(value):
        calls = isinstance(m, dict) and m.get("role") == "assistant" and bool(m.get("tool_calls"))
        if not isinstance(m, dict) or m.get("role") not in ROLES or not (
                isinstance(m.get("content"), str) or calls and m.get("content") is None):
            raise DataError(f"row {i} of {path}: message {j} must be {{'role': one of {list(ROLES)}, 'content': "
                            f"text}}, got {m!r}"[:400])
        messages.append({**m, "content": m.get("content") or ""})
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"row {i} of {path}: no assistant message; the messages format trains the last "
                        f"assistant turn, so every conversation needs one")
    if messages[-1]["role"] != "assistant":
        raise DataError(f"row {i} of {path}: the last message is from {messages[-1]['role']!r}, not "
                        f"'assistant'; the messages format trains the last assistant turn, so end every "
                        f"conversation with it")
    if not messages[-1]["content"].strip() and not messages[-1].get("tool_calls"):
        raise DataError(f"row {i} of {path}: the last assistant message is empty")
    return messages


def _tools(raw: dict[str, Any], cfg: DataConfig, i: int, path: str) -> dict[str, Any]:
    tools = raw.get(cfg.tools_column)
    if isinstance(tools, str) and tools.strip():
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError:
            pass
    if tools in (None, "", []):
        return {}
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise DataError(f"row {i} of {path}: {cfg.tools_column!r} must be a list of tool (function) schemas, got "
                        f"{type(tools).__name__}")
    return {"tools": tools}


def conversational_row(raw: dict[str, Any], cfg: DataConfig, i: int, path: str) -> dict[str, Any]:
    """A TRL conversational prompt/completion row (both lists of messages) as a chat whose completion's
    assistant turns are the trained ones (``completion_from``: the index of the completion's first message)."""
    prompt, completion = raw.get(cfg.prompt_column), raw.get(cfg.completion_column)
    if not isinstance(prompt, list) or not isinstance(completion, list) or not completion:
        raise DataError(f"row {i} of {path}: a conversational row needs {cfg.prompt_column!r} and "
                        f"{cfg.completion_column!r} both as lists of messages (the completion non-empty); got "
                        f"{type(prompt).__name__} and {type(completion).__name__}")
    messages = read_messages(prompt + completion, f"{cfg.prompt_column} + {cfg.completion_column}", i, path)
    return {"messages": messages, "completion_from": len(prompt), **_tools(raw, cfg, i, path)}


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


def special_strings(tokenizer: Any) -> list[str]:
    """The spellings of the tokenizer's special (control) tokens."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    specials = set(tokenizer.all_special_tokens) | {t.content for t in added.values() if getattr(t, "special", False)}
    return sorted((s for s in specials if s), key=len, reverse=True)


class ClockError(Exception):
    """The template called ``strftime_now`` (raised by the probe to stop the render)."""


def render(tokenizer: Any, template: str, messages: list[dict[str, Any]], i: int, generation: bool = False,
           tools: list[dict[str, Any]] | None = None, kwargs: dict[str, Any] | None = None) -> str:
    """The chat template's text for ``messages`` (``tokenize=False``).

    Raises:
        DataError: the template raised (``raise_exception`` or any error): one line naming the row and the
            template's own message.
    """
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=False,
                                             add_generation_prompt=generation, **(kwargs or {}))
    except ClockError:
        raise
    except Exception as e:  # noqa: BLE001 - jinja2's TemplateError, or a template's own TypeError/KeyError
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"row {i}: the chat template refuses this conversation ({type(e).__name__}: {msg}); fix "
                        f"the row or data.chat_template") from None


def render_chat(tokenizer: Any, template: str, messages: list[dict[str, Any]], i: int,
                tools: list[dict[str, Any]] | None = None) -> tuple[str, str, bool]:
    """The last assistant turn of a conversation as ``(prompt_text, tail_text, append_eos)`` (see :func:`spans`).

    Raises:
        DataError: see :func:`spans`.
    """
    full, cut, add_eos = spans(tokenizer, template, messages, i, "last_assistant", tools=tools)
    (start, end), = cut
    return full[:start], full[start:end], add_eos


def _end_of_turn(text: str, specials: list[str]) -> int | None:
    """Where a rendered turn ends: right after its last special token when only whitespace follows it."""
    body = text.rstrip()
    for s in specials:
        if body.endswith(s):
            return len(body)
    return None


def _first_difference(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def spans(tokenizer: Any, template: str, messages: list[dict[str, Any]], i: int, train_on: str,
          first: int = 0, tools: list[dict[str, Any]] | None = None, kwargs: dict[str, Any] | None = None
          ) -> tuple[str, list[tuple[int, int]], bool]:
    """Render a conversation and find the character spans of its trained assistant turns.

    Turn ``k`` starts where the generation prompt of ``messages[:k]`` ends, and ends right after the special
    token that closes the rendered turn (or after its text, trailing whitespace dropped). An earlier turn the
    template renders differently in the history (reasoning dropped) starts at its content and ends at the first
    special token after it.

    Args:
        train_on: ``all_assistant`` or ``last_assistant``.
        first: only messages from this index on are trained (a conversational prompt/completion row).

    Returns:
        ``(text, spans, append_eos)``: the rendered conversation, ``[(start, end)]`` ascending, and whether the
        last turn has no end-of-turn special token (EOS is then appended to it).

    Raises:
        DataError: the template raises, the generation prompt is not the start of the rendered last turn, or a
            turn's content cannot be found in the rendering.
    """
    specials = special_strings(tokenizer)
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
        if whole.startswith(prompt) and full.startswith(whole) and len(prompt) >= lo:
            start, turn = len(prompt), whole[len(prompt):]
            end = _end_of_turn(turn, specials)
            if end is None:
                end, add_eos = len(turn.rstrip()), last
            if end == 0:
                raise DataError(f"row {i}: the chat template renders assistant message {k} as nothing; check "
                                f"data.chat_template")
            out.append((start, start + end))
            continue
        if last:
            n = _first_difference(prompt, full)
            raise DataError(f"row {i}: the chat template's generation prompt is not the start of the rendered last "
                            f"assistant turn: after {full[max(0, n - 30):n]!r} the prompt continues "
                            f"{prompt[n:n + 40]!r} but the conversation {full[n:n + 40]!r}; the model would be "
                            f"trained after a prompt inference never sends. Fix data.chat_template so that its "
                            f"generation prompt is what the rendered turn starts with")
        content = messages[k]["content"].strip()
        at = full.find(content, lo) if content else -1
        if at < 0:
            raise DataError(f"row {i}: the chat template does not render assistant message {k}'s content as "
                            f"written, so its tokens cannot be found; check data.chat_template, or set "
                            f"data.train_on=last_assistant")
        end = at + len(content)
        markers = [p + len(s) for s in specials if (p := full.find(s, end)) >= 0 and not full[end:p].strip()]
        out.append((at, min(markers) if markers else end))
    return full, out, add_eos


def _content_ranges(full: str, messages: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """Character ranges of the messages' text in the rendering (found in order; text the template changed is
    not found and not protected)."""
    ranges, pos = [], 0
    for m in messages:
        content = m.get("content") or ""
        at = full.find(content, pos) if content else -1
        if at >= 0:
            ranges.append((at, at + len(content)))
            pos = at + len(content)
    return ranges


class Messages(CompletionTask):
    """The ``messages`` format (evaluation as prompt/completion: completion NLL and exact match)."""

    name = "messages"

    def columns(self, cfg: DataConfig) -> list[str]:
        return [cfg.messages_column]

    def optional_columns(self, cfg: DataConfig) -> list[str]:
        return [cfg.tools_column]

    def read(self, raw: dict[str, Any], cfg: DataConfig, i: int, path: str) -> dict[str, Any]:
        return {"messages": read_messages(raw.get(cfg.messages_column), cfg.messages_column, i, path),
                **_tools(raw, cfg, i, path)}

    def prepare(self, tokenizer: Any, data_cfg: DataConfig, loss_cfg: LossConfig) -> None:
        self.template = chat_template(tokenizer, data_cfg)
        self.kwargs = dict(data_cfg.chat_template_kwargs or {})
        self.train_on = data_cfg.train_on
        self.specials = special_strings(tokenizer)
        self.reported: set[str] = set()

    def fingerprint(self) -> str:
        return json.dumps({"template": self.template, "kwargs": self.kwargs, "train_on": self.train_on},
                          sort_keys=True, default=str)

    def check(self, tokenizer: Any, rows: list[dict[str, Any]]) -> None:
        if rows:
            self.check_clock(tokenizer, rows[0])
            self.report_unused_keys(rows)

    def check_clock(self, tokenizer: Any, row: dict[str, Any]) -> None:
        """Refuse a template that reads the clock (the rows would change with the day a run starts or resumes).

        Raises:
            DataError: the template called ``strftime_now`` with ``data.chat_template_kwargs`` as given.
        """
        # transformers' strftime_now() reads chat_template_utils.datetime.now() when called: swap in a clock that
        # stops the render (template variables cannot carry a function: they are converted to plain data).
        import transformers.utils.chat_template_utils as ctu

        class Probe:
            @staticmethod
            def now(*_: Any) -> Any:
                raise ClockError

        real = ctu.datetime
        try:
            ctu.datetime = Probe
            render(tokenizer, self.template, row["messages"], row.get("row", -1), tools=row.get("tools"),
                   kwargs=self.kwargs)
        except ClockError:
            ctu.datetime = real
            raise DataError("data.chat_template reads the clock (strftime_now): every row would hold the day the run "
                            "starts, so a resume on another day trains other tokens. Pin what it renders with "
                            "data.chat_template_kwargs (e.g. data.chat_template_kwargs={date_string: '26 Jul "
                            "2024'} for Llama-3 templates)") from None
        finally:
            ctu.datetime = real

    def report_unused_keys(self, rows: list[dict[str, Any]]) -> None:
        """Warn once about message keys (and a ``tools`` column) the template never reads."""
        keys = {k for r in rows for m in r["messages"] for k in m} - _PLAIN_KEYS
        if any("tools" in r for r in rows):
            keys.add("tools")
        unused = sorted(k for k in keys if not re.search(rf"\b{re.escape(k)}\b", self.template))
        if unused:
            logger.warning("data: the chat template never reads %s, so that part of the rows is not rendered (nor "
                           "trained); use a template that renders it (data.chat_template)", unused)

    def texts(self, row: dict[str, Any], cfg: DataConfig) -> list[str]:
        return []  # rendered per row, encoded in pieces

    def encode(self, row: dict[str, Any], b: Builder, loss_cfg: LossConfig) -> Example | None:
        i, tok = row.get("row", -1), b.tokenizer
        full, cut, add_eos = spans(tok, self.template, row["messages"], i, self.train_on,
                                   row.get("completion_from", 0), row.get("tools"), self.kwargs)
        protect = [(p, p + len(s)) for a, z in _content_ranges(full[:cut[-1][1]], row["messages"])
                   for s in self.specials for p in _find_all(full, s, a, z)]
        if protect:
            b.notes["special_spellings_as_text"] = b.notes.get("special_spellings_as_text", 0) + len(protect)
        bounds = [0] + [x for s in cut for x in s]
        pieces = [self._encode(tok, full, bounds[j], bounds[j + 1], protect) for j in range(len(bounds) - 1)]
        if add_eos:
            pieces[-1] = b.with_eos(pieces[-1])
        # pieces: prompt, trained, gap, trained, ..., trained. Turns that do not fit become prompt, oldest first.
        prompt = pieces[0]
        front = prompt[:1] if b.prefix and prompt[:1] == b.prefix[:1] else []   # a BOS the template rendered
        start = 1
        while start < len(pieces) - 1 and len(front) + sum(map(len, pieces[start:])) + 1 > b.cfg.max_length:
            start += 2
        tail = [t for p in pieces[start:] for t in p]
        flags = [int((start + j) % 2 == 1) for j, p in enumerate(pieces[start:]) for _ in p]
        before = [t for p in pieces[:start] for t in p][len(front):]
        ids = b.assemble(front, before, tail, i)
        if ids is None:
            return None
        return Example(ids, len(tail), int(row.get("type", 0)), 0, -1, i,
                       None if all(flags) else flags)

    @staticmethod
    def _encode(tok: Any, full: str, a: int, z: int, protect: list[tuple[int, int]]) -> list[int]:
        ids, pos = [], a
        for p, q in sorted(x for x in protect if a <= x[0] and x[1] <= z):
            ids += encode(tok, full[pos:p]) if p > pos else []
            ids += encode_literal(tok, full[p:q])
            pos = q
        return ids + (encode(tok, full[pos:z]) if z > pos else [])


def _find_all(text: str, s: str, a: int, z: int) -> list[int]:
    found, p = [], text.find(s, a)
    while 0 <= p and p + len(s) <= z:
        found.append(p)
        p = text.find(s, p + len(s))
    return found
