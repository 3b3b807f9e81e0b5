"""``prompt_completion``: the prompt's tokens, then the trained completion's tokens + EOS.

A *conversational* row (TRL's format: ``prompt`` and ``completion`` are lists of messages) becomes a chat
(:mod:`scale.data.tasks.messages`) whose completion's assistant turns are trained, rendered by the chat template;
a file of such rows is encoded by the chat task (:meth:`PromptCompletion.for_rows`).
Evaluation: ``eval/loss`` is the completion NLL per token; ``eval/exact_match``: every completion token is the
argmax (teacher forced).
"""

from __future__ import annotations

from typing import Any

from scale.config.schema import DataConfig, LossConfig
from scale.data.read import text_cell
from scale.data.tasks.base import Builder, CompletionTask, Example, Task, encode
from scale.data.tasks.chat_rows import conversational_row
from scale.data.tasks.messages import Messages


class PromptCompletion(CompletionTask):
    """The ``prompt_completion`` format (text prompt and completion)."""

    name = "prompt_completion"

    def columns(self, cfg: DataConfig) -> list[str]:
        return [cfg.prompt_column, cfg.completion_column]

    def read(self, raw: dict[str, Any], cfg: DataConfig, i: int, path: str) -> dict[str, Any]:
        prompt, completion = raw.get(cfg.prompt_column), raw.get(cfg.completion_column)
        if isinstance(prompt, list) or isinstance(completion, list):
            return conversational_row(raw, cfg, i, path)
        return {"prompt": text_cell(raw, cfg.prompt_column, i, path, strip=False),
                "completion": text_cell(raw, cfg.completion_column, i, path, strip=False)}

    def for_rows(self, rows: list[dict[str, Any]]) -> Task:
        return Messages() if rows and "messages" in rows[0] else self

    def texts(self, row: dict[str, Any], cfg: DataConfig) -> list[str]:
        return [row["prompt"], row["completion"]]

    def encode(self, row: dict[str, Any], b: Builder, loss_cfg: LossConfig) -> Example | None:
        completion = b.with_eos(encode(b.tokenizer, row["completion"]))
        prefix, prompt = b.front(encode(b.tokenizer, row["prompt"]))
        ids = b.assemble(prefix, prompt, completion, row.get("row", -1))
        if ids is None:
            return None
        return Example(ids, len(completion), int(row.get("type", 0)), 0, -1, row.get("row", -1))
