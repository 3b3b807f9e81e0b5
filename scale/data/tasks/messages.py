"""``messages``: a conversation rendered by the chat template; its assistant turns are trained.

``data.train_on`` (default ``all_assistant``, as TRL, axolotl, torchtune and LLaMA-Factory do):

- ``all_assistant``: every assistant turn, in one row per conversation, each as the template renders it in that
  conversation (an earlier turn as history: a Qwen3-style template renders a ``<think>`` block for the last turn
  only, so the reasoning of earlier turns is not trained; counted, ``data/*_history_reasoning_dropped``);
- ``all_assistant_as_last``: every assistant turn in a row of its own (the conversation up to and including it),
  rendered as the last turn, as inference renders it (its reasoning kept); a conversation of n assistant turns
  is n rows;
- ``last_assistant``: the last turn only.

**Spans from rendering positions only.** A trained turn starts right after its own rendered prompt (the
template's generation prompt for the conversation before it, which must be the start of the rendering) and ends
right after the end-of-turn marker the template renders for it in this conversation. When the template renders
the turn differently as history, its span there is the longest end of its last-turn rendering that the
conversation holds at that start, through its end-of-turn marker; a turn whose span cannot be told that way is
one line naming the template and the turn. The turn's text is never searched for (an answer "Yes" that the user's
message also holds is trained where the answer is). A template without a special end-of-turn token gets EOS
appended to the last turn; the row is cut after the last assistant turn. The tail (:mod:`scale.data`) starts at
the first trained token; the user/tool tokens inside it weigh 0 (``Example.trained``). A turn that renders as no
text but its end-of-turn marker (an empty message) is not trained (counted).

**Tools.** Every message key passes to the template (``tool_calls``, a tool turn's ``name``/``tool_call_id``,
``reasoning_content``/``thinking``); a ``tools`` column (``data.tools_column``) is the template's ``tools``. A
tool call's ``arguments`` given as a JSON string (OpenAI's format) is decoded once into a mapping, as
transformers' templates expect. Tool calls or a ``tools`` column on a template that does not render them (plain
ChatML, SmolLM2's own) are refused with one line naming the shipped ``chatml_tools`` template.

**Truncation** (``data.truncation``): a conversation over ``data.max_length`` tokens is cut, never inside a
turn's markers: ``keep_end`` (default) drops its oldest exchanges (a user turn and the turns answering it) and
renders what is left again; if its last exchange alone is still too long, the start of that exchange's user text
goes (the turn's markers stay); the system turn is kept until nothing else helps. ``drop`` drops the
conversation. A conversation that cannot fit even so is an error naming it, or dropped with
``data.drop_long_completions``. What is removed (assistant turns, tool calls, system turns, the start of a user
text) is counted per split (``data/<split>_turns_cut``...) and named once in the start-up log.

Template hygiene, each with one outcome:

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
from typing import Any

from scale.config.schema import DataConfig, LossConfig
from scale.data.read import DataError
from scale.data.tasks.base import (BY_LONG_COMPLETIONS, BY_TRUNCATION, Builder, CompletionTask, Example, encode,
                                   encode_literal)
from scale.data.tasks.chat_rows import (LINKING_KEYS, LINKING_KEYS_OF_TOOL_MESSAGES, PLAIN_KEYS, REASONING_KEYS,
                                        TOOLS_TEMPLATE, read_messages, read_tools)
from scale.data.tasks.chat_spans import content_ranges, find_all, first_difference, spans
from scale.data.tasks.chat_template import ClockError, chat_template, render, special_strings, template_name
from scale.data.tasks.trl_pairs import CPO, prepend_bos

logger = logging.getLogger(__name__)

# What this format counts per split (data/<split>_<name>, scale.data): removed by truncation, or not rendered.
COUNTS = ("turns_cut", "tool_calls_cut", "system_cut", "user_text_cut", "empty_turns",
          "history_reasoning_dropped", "reasoning_not_rendered", "system_not_rendered")


def _cuts(messages: list[dict[str, Any]], shared: int | None = None) -> list[list[int]]:
    """The conversations ``data.truncation: keep_end`` tries, least cut first, as indices into ``messages``: the
    whole, then without its oldest exchanges (each cut starts at a user turn before message ``shared``, default
    the last message; a system turn kept), then the shortest without its system turn. Every one ends with the
    last (trained) assistant turn."""
    n = len(messages)
    system = [0] if messages[0]["role"] == "system" else []
    starts = [j for j in range(len(system) + 1, n - 1 if shared is None else shared) if messages[j]["role"] == "user"]
    out = [list(range(n))] + [system + list(range(j, n)) for j in starts]
    return out + [out[-1][1:]] if system else out


class Messages(CompletionTask):
    """The ``messages`` format (evaluation as prompt/completion: completion NLL and exact match)."""

    name = "messages"
    counted = CompletionTask.counted + COUNTS
    pair_rule: str | None = None  # see prepare()

    def columns(self, cfg: DataConfig) -> list[str]:
        return [cfg.messages_column]

    def optional_columns(self, cfg: DataConfig) -> list[str]:
        return [cfg.tools_column]

    def read(self, raw: dict[str, Any], cfg: DataConfig, i: int, path: str) -> dict[str, Any]:
        return {"messages": read_messages(raw.get(cfg.messages_column), cfg.messages_column, i, path),
                **read_tools(raw, cfg, i, path)}

    def prepare(self, tokenizer: Any, data_cfg: DataConfig, loss_cfg: LossConfig) -> None:
        self.template = chat_template(tokenizer, data_cfg)
        self.template_name = template_name(data_cfg)
        self.kwargs = dict(data_cfg.chat_template_kwargs or {})
        self.train_on = data_cfg.train_on
        self.specials = special_strings(tokenizer)
        # A preference pair's TRL tokens (data.pair_conventions=trl; set by scale.data.tasks.preference):
        # trl_pairs.DPO or trl_pairs.CPO trains the rendering to its end, every completion message, and (CPO) puts
        # BOS in front and EOS at the end as TRL's trainers do; None: as a chat trains.
        self.pair_rule: str | None = None

    def fingerprint(self) -> str:
        return json.dumps({"template": self.template, "kwargs": self.kwargs, "train_on": self.train_on,
                           **({"pair_rule": self.pair_rule} if self.pair_rule else {})}, sort_keys=True, default=str)

    def check(self, tokenizer: Any, rows: list[dict[str, Any]]) -> None:
        if rows:
            self.check_clock(tokenizer, rows[0])
            self.check_tools(tokenizer, rows)
            self.report_unused_keys(tokenizer, rows)

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

    def _renders(self, tokenizer: Any, row: dict[str, Any], messages: list[dict[str, Any]],
                 tools: list[dict[str, Any]] | None) -> bool:
        """Whether the row renders otherwise with ``messages``/``tools`` instead of its own (a template that
        refuses the changed row renders it otherwise)."""
        i = row.get("row", -1)
        own = render(tokenizer, self.template, row["messages"], i, tools=row.get("tools"), kwargs=self.kwargs)
        try:
            return render(tokenizer, self.template, messages, i, tools=tools, kwargs=self.kwargs) != own
        except DataError:
            return True

    def check_tools(self, tokenizer: Any, rows: list[dict[str, Any]]) -> None:
        """Refuse tool calls or a ``tools`` column that the template does not render (the call's assistant turn
        would train as an empty turn; the model would call tools it was never shown).

        Raises:
            DataError: one line naming the row, the template and the shipped tool-aware one.
        """
        fix = (f"set data.chat_template={TOOLS_TEMPLATE} (shipped: ChatML with <tools> and <tool_call>, as Qwen2.5 "
               f"and Hermes render them) or the tool-aware template of the model's family")
        row = next((r for r in rows if any(m.get("tool_calls") for m in r["messages"])), None)
        if row is not None:
            k = next(k for k, m in enumerate(row["messages"]) if m.get("tool_calls"))
            bare = [{x: v for x, v in m.items() if x != "tool_calls"} for m in row["messages"]]
            if not self._renders(tokenizer, row, bare, row.get("tools")):
                raise DataError(f"row {row.get('row', -1)}: {self.template_name} does not render tool calls "
                                f"(message {k} has tool_calls), so that assistant turn would train as an empty "
                                f"turn; {fix}")
        row = next((r for r in rows if r.get("tools")), None)
        if row is not None and not self._renders(tokenizer, row, row["messages"], None):
            raise DataError(f"row {row.get('row', -1)}: {self.template_name} does not render the "
                            f"{'tools'!r} column (tool schemas), so the model would learn to call tools it is "
                            f"never shown; {fix}")

    def report_unused_keys(self, tokenizer: Any, rows: list[dict[str, Any]]) -> None:
        """Report once the message keys the template does not render: the first row holding a key renders the
        same without it. A key that may carry text (a user's ``name``, any key of the data's own) is a warning;
        OpenAI's linking metadata (:data:`LINKING_KEYS`: ``tool_call_id``; a tool message's ``name``), which no
        common template renders, is an INFO line. (Tool calls and tools are checked by :meth:`check_tools`;
        reasoning is counted.)"""
        keys = sorted({k for r in rows for m in r["messages"] for k in m} - PLAIN_KEYS - {"tool_calls"}
                      - set(REASONING_KEYS))
        unused = []
        for key in keys:
            row = next(r for r in rows if any(key in m for m in r["messages"]))
            bare = [{x: v for x, v in m.items() if x != key} for m in row["messages"]]
            if not self._renders(tokenizer, row, bare, row.get("tools")):
                unused.append(key)
        linking = [k for k in unused if k in LINKING_KEYS or (k in LINKING_KEYS_OF_TOOL_MESSAGES and all(
            m.get("role") == "tool" for r in rows for m in r["messages"] if k in m))]
        content = [k for k in unused if k not in linking]
        if linking:
            logger.info("data: the chat template does not render the tool-call metadata %s (OpenAI's links between a "
                        "call and its result, no trained text; no common tool-aware template renders them)", linking)
        if content:
            logger.warning("data: the chat template does not render the message key(s) %s (a row renders the same "
                           "without them), so they are not part of the trained text; use a template that renders "
                           "them (data.chat_template) if they matter", content)

    def texts(self, row: dict[str, Any], cfg: DataConfig) -> list[str]:
        return []  # rendered per row, encoded in pieces

    def encode(self, row: dict[str, Any], b: Builder, loss_cfg: LossConfig) -> Example | list[Example] | None:
        messages, first = row["messages"], row.get("completion_from", 0)
        if self.train_on != "all_assistant_as_last":
            return self._encode(row, messages, first, self.train_on, b)
        out = []
        for k, m in enumerate(messages):
            if m["role"] != "assistant" or k < first:
                continue
            if not m["content"].strip() and not m.get("tool_calls"):
                b.notes["empty_turns"] = b.notes.get("empty_turns", 0) + 1
                continue
            e = self._encode(row, messages[:k + 1], first, "last_assistant", b)
            if e is not None:
                out.append(e)
        return out

    def _render(self, row: dict[str, Any], messages: list[dict[str, Any]], first: int, train_on: str, b: Builder,
                notes: dict[str, int]) -> tuple[str, list[int], bool, list[tuple[int, int]]]:
        """The conversation's text, the character bounds of its pieces (prompt, trained, gap, trained, ...,
        trained), whether EOS is appended, and the special-token spellings inside message text (kept as text)."""
        full, cut, add_eos = spans(b.tokenizer, self.template, messages, row.get("row", -1), train_on, first,
                                   row.get("tools"), self.kwargs, self.template_name, notes)
        protect = [(p, p + len(s)) for a, z in content_ranges(full[:cut[-1][1]], messages)
                   for s in self.specials for p in find_all(full, s, a, z)]
        if protect:
            notes["special_spellings_as_text"] = notes.get("special_spellings_as_text", 0) + len(protect)
        bounds = [0] + [x for s in cut for x in s]
        if self.pair_rule:  # TRL: the answer runs to the rendering's end (ChatML: the newline after <|im_end|>)
            bounds[-1], add_eos = len(full), self.pair_rule == CPO
        return full, bounds, add_eos, protect

    def _pieces(self, full: str, bounds: list[int], add_eos: bool, protect: list[tuple[int, int]],
                b: Builder) -> list[list[int]]:
        """The tokens of ``full`` between consecutive ``bounds``; EOS appended to the last piece if asked."""
        pieces = [self._encode_span(b.tokenizer, full, bounds[j], bounds[j + 1], protect)
                  for j in range(len(bounds) - 1)]
        if add_eos:
            pieces[-1] = b.with_eos(pieces[-1])
        if self.pair_rule == CPO:  # TRL's CPO/ORPOTrainer: BOS in front unless the rendering starts with it
            pieces[0] = prepend_bos(b.tokenizer, pieces[0])
        return pieces

    def _text_of(self, tokenizer: Any, row: dict[str, Any], messages: list[dict[str, Any]], u: int,
                 full: str) -> tuple[int, int]:
        """Where message ``u``'s text lies in ``full``, from renderings with other text in its place (it starts
        where they first differ and ends where they last differ), never by searching for it."""
        starts, ends = [], []
        for probe in ("a", "b"):  # two probes: one of them differs from the text's first and last character
            other = [dict(m, content=probe) if k == u else m for k, m in enumerate(messages)]
            alt = render(tokenizer, self.template, other, row.get("row", -1), tools=row.get("tools"),
                         kwargs=self.kwargs)
            starts.append(first_difference(full, alt))
            ends.append(len(full) - first_difference(full[::-1], alt[::-1]))
        return min(starts), max(ends)

    def _shorten(self, row: dict[str, Any], sides: list[list[dict[str, Any]]], first: int, train_on: str,
                 b: Builder) -> tuple[list[list[list[int]]], list[dict[str, int]]] | None:
        """The conversations ``sides`` (one, or the sides of a pair: a shared start, then each its own answer)
        with the start of their first user turn's text cut, by the same number of tokens in each, so that the
        longest fits ``data.max_length`` (the turn's markers and everything else kept); ``None`` when that cannot
        make it fit. Returns each side's pieces and counts."""
        got = []
        for messages in sides:
            u = next((k for k, m in enumerate(messages) if m["role"] == "user"), None)
            if u is None or not messages[u]["content"]:
                return None
            notes: dict[str, int] = {}
            full, bounds, add_eos, protect = self._render(row, messages, first, train_on, b, notes)
            a, z = self._text_of(b.tokenizer, row, messages, u, full)
            if not 0 < a < z <= bounds[1]:  # the text lies inside the prompt, after its first token
                return None
            got.append((self._pieces(full, [0, a, z] + bounds[1:], add_eos, protect, b), notes))
        excess = max(sum(map(len, pieces)) for pieces, _ in got) - b.cfg.max_length
        if any(excess >= len(pieces[1]) for pieces, _ in got):
            return None
        return ([[pieces[0] + pieces[1][excess:] + pieces[2], *pieces[3:]] for pieces, _ in got],
                [{**notes, "user_text_cut": 1} for _, notes in got])

    def _encode(self, row: dict[str, Any], messages: list[dict[str, Any]], first: int, train_on: str,
                b: Builder) -> Example | None:
        """One row's tokens; a conversation over ``data.max_length`` cut at message boundaries (then the start of
        its last user turn's text; ``data.truncation``, see the module docstring) or dropped."""
        got = self.encode_sides(row, [messages], first, train_on, b, len(messages) - 1)
        return None if got is None else got[0]

    def encode_sides(self, row: dict[str, Any], sides: list[list[dict[str, Any]]], first: int, train_on: str,
                     b: Builder, shared: int, names: tuple[str, ...] = ()) -> list[Example] | None:
        """Conversations that share their first ``shared`` messages, cut as one (``data.truncation``, module
        docstring): a chat alone (``shared``: all but its last message), or the sides of a preference pair (their
        common prompt, then each side's answer): every side loses the same oldest exchanges and the same number
        of tokens of its first user text, the least that lets the *longest* side fit, so the sides keep one prompt
        (the tokens before the trained tail) and are counted once (``rows_truncated`` and what went: the largest
        of the sides' counts). Dropped (``None``, once) when any side would be.

        Args:
            sides: each conversation's messages, the first ``shared`` equal.
            first: only messages from this index on are trained.
            names: each side's name for messages (``chosen``, ``rejected``); ``()`` for a chat alone.

        Raises:
            DataError: the sides do not fit even cut to their last exchange and its user text (names the row and
                the longest side), their shared prompt renders as different tokens, or nothing precedes the tail.
        """
        i, limit = row.get("row", -1), b.cfg.max_length
        trained = [[k for k, m in enumerate(side) if m["role"] == "assistant" and k >= first] for side in sides]
        if train_on == "last_assistant":
            trained = [t[-1:] for t in trained]
        # The cuts, as indices kept of each side: the same removed start for every side (cut starts lie in the
        # shared messages, so every side's list of cuts is as long and its c-th cut removes the same messages).
        options = [_cuts(side, shared) for side in sides]
        system = sides[0][0]["role"] == "system"

        rendered: dict[int, int] = {}  # tokens of the longest side of each cut tried whole (0: uncut)
        tails: list[int] = []  # each side's trained tail uncut (tokens), for the error line

        def attempt(c: int, shorten: bool = False) -> tuple[list[list[list[int]]], list[dict[str, int]]] | None:
            convs = [[side[k] for k in opts[c]] for side, opts in zip(sides, options)]
            at = sum(k < first for k in options[0][c])
            if shorten:
                return self._shorten(row, convs, at, train_on, b)
            notes = [{} for _ in convs]
            pieces = [self._pieces(*self._render(row, conv, at, train_on, b, n), b) for conv, n in zip(convs, notes)]
            rendered[c] = max(sum(map(len, p)) for p in pieces)
            if c == 0:
                tails.extend(sum(map(len, p[1:])) for p in pieces)
            return (pieces, notes) if rendered[c] <= limit else None

        got, chosen = attempt(0), 0
        if got is None and b.cfg.truncation == "keep_end":
            with_system = len(options[0]) - 1 if system else len(options[0])
            lo, hi = 1, with_system - 1  # the longest that fits without its oldest exchanges, system kept
            while lo <= hi:
                mid = (lo + hi) // 2
                found = attempt(mid)
                if found is None:
                    lo = mid + 1
                else:
                    got, chosen, hi = found, mid, mid - 1
            # Then the last exchange with its user text cut; the system turn goes last.
            last = len(options[0]) - 1
            tries = [(with_system - 1, True)] + ([(last, False), (last, True)] if system else [])
            for c, shorten in tries if got is None else []:
                got, chosen = attempt(c, shorten), c
                if got is not None:
                    break
        if got is None:
            if b.cfg.truncation == "drop" or b.cfg.drop_long_completions:
                b.drop(i, rendered[0], BY_TRUNCATION if b.cfg.truncation == "drop" else BY_LONG_COMPLETIONS)
                return None
            if names:
                s = max(range(len(sides)), key=lambda j: tails[j])
                raise DataError(f"row {i}: the {names[s]} answer is {tails[s]} tokens (through its end-of-turn "
                                f"marker), and the pair does not fit in data.max_length={limit} tokens even with "
                                f"its shared prompt cut to its last exchange and the start of that exchange's user "
                                f"text (data.truncation=keep_end never cuts inside a turn's markers). Raise "
                                f"data.max_length, or set data.drop_long_completions=true to drop such pairs "
                                f"(counted in the log).")
            raise DataError(f"row {i}: the conversation does not fit in data.max_length={limit} tokens even cut to "
                            f"its last exchange with the start of its user turn's text cut (data.truncation=keep_end "
                            f"never cuts inside a turn's markers). Raise data.max_length, or set "
                            f"data.drop_long_completions=true to drop such rows (counted in the log).")
        pieces, notes = got
        for key in {k for n in notes for k in n}:
            b.count(key, max(n.get(key, 0) for n in notes))
        if chosen or any(n.get("user_text_cut") for n in notes):
            b.count("rows_truncated")
            # what went, the largest count of the sides (a pair's cuts lie in its shared prompt: the same)
            gone = [sorted(set(range(len(side))) - set(opts[chosen])) for side, opts in zip(sides, options)]
            b.count("turns_cut", max(sum(k in t for k in g) for t, g in zip(trained, gone)))
            b.count("tool_calls_cut", max(sum(len(side[k].get("tool_calls") or []) for k in g)
                                          for side, g in zip(sides, gone)))
            b.count("system_cut", max(sum(side[k]["role"] == "system" for k in g) for side, g in zip(sides, gone)))
        if not pieces[0][0]:
            raise DataError(f"row {i}: nothing precedes the tail, so its first token has no prediction; "
                            f"give the row a prompt")
        if any(p[0] != pieces[0][0] for p in pieces[1:]):
            n = first_difference(pieces[0][0], pieces[1][0])  # type: ignore[arg-type]
            raise DataError(f"row {i}: {self.template_name} renders the shared prompt differently before the "
                            f"{names[0]} and the {names[1]} answer (from token {n} on), so the two sides would be "
                            f"scored on different prompts; use a template whose rendering of the messages before "
                            f"the answer does not depend on the answer (data.chat_template)")
        out = []
        for p in pieces:
            tail = [t for q in p[1:] for t in q]
            flags = [int(j % 2 == 1 or bool(self.pair_rule)) for j, q in enumerate(p) for _ in q][len(p[0]):]
            out.append(Example(p[0] + tail, len(tail), int(row.get("type", 0)), 0, -1, i,
                               None if all(flags) else flags))
        return out

    @staticmethod
    def _encode_span(tok: Any, full: str, a: int, z: int, protect: list[tuple[int, int]]) -> list[int]:
        ids, pos = [], a
        for p, q in sorted(x for x in protect if a <= x[0] and x[1] <= z):
            ids += encode(tok, full[pos:p]) if p > pos else []
            ids += encode_literal(tok, full[p:q])
            pos = q
        return ids + (encode(tok, full[pos:z]) if z > pos else [])
