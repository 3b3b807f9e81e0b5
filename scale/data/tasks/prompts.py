"""``prompts``: what online RL (``loss.objective: grpo``) samples completions of. A row is a ``prompt``
(``data.prompt_column``), as text or as a list of messages (TRL's conversational prompt: rendered by the chat
template with its generation prompt), or text built from the row's columns by ``data.prompt_template``
(``"Review: {text}\nSentiment:"``); every other column reaches the reward functions by name
(:mod:`scale.objectives.rewards`). Nothing of the row itself is trained: its example is the prompt's tokens
(``tail_len`` 0) and the row's prompt and columns as JSON (``Example.extra``, kept by the token cache).

Text is tokenized as TRL's ``GRPOTrainer`` does (the tokenizer's own special tokens, e.g. a BOS, in front); a
conversation is rendered by ``data.chat_template`` (or the tokenizer's) with ``add_generation_prompt``, special-token
spellings inside message text encoded as text (as :mod:`scale.data.tasks.messages` does). A prompt over
``data.max_length`` tokens loses its oldest tokens after the BOS (``data.truncation: keep_end``, counted) or is
dropped (``drop``); at sampling time a prompt longer than ``data.max_length - rl.max_completion_length`` is cut the
same way (:func:`fit_prompt`).
"""

from __future__ import annotations

import json
import re
from typing import Any

from scale.config.schema import DataConfig, LossConfig
from scale.data.read import DataError
from scale.data.tasks.base import Builder, Example, Task, encode, encode_literal
from scale.data.tasks.chat_rows import ROLES, read_tools
from scale.data.tasks.chat_spans import content_ranges
from scale.data.tasks.chat_template import chat_template, render


def read_prompt(value: Any, column: str, i: int, path: str) -> str | list[dict[str, Any]]:
    """One row's prompt: non-empty text, or a non-empty list of ``{role, content}`` messages that does not end with
    an assistant turn (the completion is what is sampled).

    Raises:
        DataError: anything else, naming the row and the column.
    """
    if isinstance(value, str) and value.strip().startswith("[") and column:
        try:
            value = json.loads(value)  # a CSV cell holding a JSON conversation
        except json.JSONDecodeError:
            pass
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"row {i} of {path}: empty {column!r}; every prompt needs text or messages")
        return value
    if not isinstance(value, list) or not value:
        raise DataError(f"row {i} of {path}: {column!r} must be text or a non-empty list of {{role, content}} "
                        f"messages, got {type(value).__name__}")
    for j, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise DataError(f"row {i} of {path}: message {j} of {column!r} must be {{'role': one of {list(ROLES)}, "
                            f"'content': text}}, got {m!r}"[:400])
    if value[-1]["role"] == "assistant":
        raise DataError(f"row {i} of {path}: the prompt ends with an assistant message; a prompt ends before the "
                        f"answer that is sampled (drop its last turn)")
    return [dict(m) for m in value]


_FIELD = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


def template_columns(template: str) -> list[str]:
    """The columns ``data.prompt_template`` names (``{name}``), in order, once each."""
    return list(dict.fromkeys(_FIELD.findall(template)))


def render_prompt(template: str, raw: dict[str, Any], i: int, path: str) -> str:
    """``template`` with each ``{name}`` replaced by the row's column ``name`` (its text); other braces literal.

    Raises:
        DataError: a named column is missing or empty in the row.
    """
    def cell(m: re.Match) -> str:
        value = raw.get(m.group(1))
        if value is None or isinstance(value, (dict, list)) or not str(value).strip():
            raise DataError(f"row {i} of {path}: data.prompt_template names {{{m.group(1)}}} and the row's "
                            f"{m.group(1)!r} is empty or not text")
        return str(value)

    return _FIELD.sub(cell, template)


class Prompts(Task):
    """The ``prompts`` format (module docstring)."""

    name = "prompts"

    @property
    def unit(self) -> str:
        """A row of this format is a prompt (log lines count prompts)."""
        return "prompts"

    def columns(self, cfg: DataConfig) -> list[str]:
        return template_columns(cfg.prompt_template) if cfg.prompt_template else [cfg.prompt_column]

    def read(self, raw: dict[str, Any], cfg: DataConfig, i: int, path: str) -> dict[str, Any]:
        if cfg.prompt_template:
            prompt: str | list[dict[str, Any]] = render_prompt(cfg.prompt_template, raw, i, path)
            columns = dict(raw)
        else:
            prompt = read_prompt(raw.get(cfg.prompt_column), cfg.prompt_column, i, path)
            columns = {k: v for k, v in raw.items() if k not in (cfg.prompt_column, cfg.tools_column)}
        return {"prompt": prompt, "columns": columns, **(read_tools(raw, cfg, i, path) if isinstance(prompt, list)
                                                         else {})}

    def encode(self, row: dict[str, Any], b: Builder, loss_cfg: LossConfig) -> Example | None:
        ids = self.prompt_ids(row, b)
        i = row.get("row", -1)
        if len(ids) > b.cfg.max_length:
            if b.cfg.truncation == "drop":
                b.drop(i, len(ids), "data.truncation=drop")
                return None
            b.count("rows_truncated")
            ids = fit_prompt(ids, len(b.prefix) if ids[:len(b.prefix)] == b.prefix else 0, b.cfg.max_length, "keep_end")
        extra = json.dumps({"prompt": row["prompt"], "columns": row["columns"]}, ensure_ascii=False, default=str)
        return Example(ids, 0, int(row.get("type", 0)), 0, -1, i, None, extra)

    def prepare(self, tokenizer: Any, data_cfg: DataConfig, loss_cfg: LossConfig) -> None:
        self.data_cfg = data_cfg
        self.template: str | None = None
        self.kwargs = dict(data_cfg.chat_template_kwargs or {})

    def check(self, tokenizer: Any, rows: list[dict[str, Any]]) -> None:
        """Find the chat template when some prompt is a conversation (a file of text prompts needs none).

        Raises:
            DataError: conversations and no chat template.
        """
        if any(isinstance(r["prompt"], list) for r in rows):
            self.chat(tokenizer)

    def chat(self, tokenizer: Any) -> str:
        """The chat template (found by :meth:`check`, or on first use)."""
        if self.template is None:
            self.template = chat_template(tokenizer, self.data_cfg)
        return self.template

    def fingerprint(self) -> str:
        """The chat template and its variables when conversations are rendered; '' for text prompts."""
        if self.template is None:
            return ""
        return json.dumps({"template": self.template, "kwargs": self.kwargs}, sort_keys=True, default=str)

    def prompt_ids(self, row: dict[str, Any], b: Builder) -> list[int]:
        """The prompt's tokens as the model reads them (module docstring), before any cut."""
        prompt = row["prompt"]
        if isinstance(prompt, str):
            prefix, ids = b.front(encode(b.tokenizer, prompt))
            return prefix + ids
        text = render(b.tokenizer, self.chat(b.tokenizer), prompt, row.get("row", -1), generation=True,
                      tools=row.get("tools"), kwargs=self.kwargs)
        ids, pos = [], 0
        for a, z in content_ranges(text, prompt):  # message text: special-token spellings stay text
            ids += (encode(b.tokenizer, text[pos:a]) if a > pos else []) + encode_literal(b.tokenizer, text[a:z])
            pos = z
        return ids + (encode(b.tokenizer, text[pos:]) if pos < len(text) else [])


def fit_prompt(ids: list[int], prefix_len: int, budget: int, truncation: str) -> list[int] | None:
    """``ids`` within ``budget`` tokens: unchanged when it fits; else its oldest tokens after the first
    ``prefix_len`` (a BOS) dropped (``keep_end``), or ``None`` (``drop``)."""
    if len(ids) <= budget:
        return ids
    if truncation == "drop" or budget <= prefix_len:
        return None
    return ids[:prefix_len] + ids[len(ids) - (budget - prefix_len):]
