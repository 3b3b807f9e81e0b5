"""``prompts``: what online RL (``loss.objective: grpo``) samples completions of. A row is a ``prompt``
(``data.prompt_column``), as text or as a list of messages (TRL's conversational prompt: rendered by the chat
template with its generation prompt), plus any other columns, which reach the reward functions by name
(:mod:`scale.objectives.rewards`). Nothing is trained from the row itself: its example is the prompt's tokens.

Text is tokenized as TRL's ``GRPOTrainer`` does (the tokenizer's own special tokens, e.g. a BOS, in front); a
conversation is rendered by ``data.chat_template`` (or the tokenizer's) with ``add_generation_prompt``, special-token
spellings inside message text encoded as text (as :mod:`scale.data.tasks.messages` does). A prompt longer than its
budget (``data.max_length - rl.max_completion_length`` tokens) loses its oldest tokens after the BOS
(``data.truncation: keep_end``) or is dropped (``drop``), counted in the log as other formats' rows are.
"""

from __future__ import annotations

import json
from typing import Any

from scale.config.schema import DataConfig, LossConfig
from scale.data.read import DataError
from scale.data.tasks.base import Builder, Task, encode, encode_literal
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


class Prompts(Task):
    """The ``prompts`` format (module docstring)."""

    name = "prompts"

    def columns(self, cfg: DataConfig) -> list[str]:
        return [cfg.prompt_column]

    def read(self, raw: dict[str, Any], cfg: DataConfig, i: int, path: str) -> dict[str, Any]:
        prompt = read_prompt(raw.get(cfg.prompt_column), cfg.prompt_column, i, path)
        columns = {k: v for k, v in raw.items() if k not in (cfg.prompt_column, cfg.tools_column)}
        return {"prompt": prompt, "columns": columns, **(read_tools(raw, cfg, i, path) if isinstance(prompt, list)
                                                         else {})}

    def prepare(self, tokenizer: Any, data_cfg: DataConfig, loss_cfg: LossConfig) -> None:
        self.data_cfg = data_cfg
        self.template: str | None = None
        self.kwargs = dict(data_cfg.chat_template_kwargs or {})

    def chat(self, tokenizer: Any) -> str:
        """The chat template, found on first use (a file of text prompts needs none)."""
        if self.template is None:
            self.template = chat_template(tokenizer, self.data_cfg)
        return self.template

    def fingerprint(self) -> str:
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
