"""``text``: plain text rows; the last ``loss.threshold`` tokens (+ EOS) are trained, or with ``loss.threshold:
all`` every token after the first (the whole row: TRL's ``dataset_text_field``, axolotl's ``type: completion``).

Columns: ``text``, optional ``type`` (``data.type_column``) and ``target`` (a token id or the text of one token:
``eval/target_nll`` is its NLL at ``loss.target_position``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from scale.config.schema import DataConfig, LossConfig
from scale.data.read import DataError, target_cell, text_cell
from scale.data.tasks.base import Builder, Example, Task, encode
from scale.data.tasks.classification import target_stats


def _target_id(tokenizer: Any, target: int | str, i: int) -> int:
    if isinstance(target, int):
        if target >= len(tokenizer):
            raise DataError(f"row {i}: target token id {target} is outside the vocabulary ({len(tokenizer)} ids)")
        return target
    ids = encode(tokenizer, target)
    if len(ids) != 1:
        raise DataError(f"row {i}: target {target!r} is {len(ids)} tokens "
                        f"{[tokenizer.decode([t]) for t in ids]}; give the text of one token (or its id)")
    return ids[0]


class Text(Task):
    """The ``text`` format (the fallback of detection)."""

    name = "text"
    uses_threshold = True

    def columns(self, cfg: DataConfig) -> list[str]:
        return [cfg.text_column]

    def optional_columns(self, cfg: DataConfig) -> list[str]:
        return [cfg.type_column or "type", cfg.target_column]

    def read(self, raw: dict[str, Any], cfg: DataConfig, i: int, path: str) -> dict[str, Any]:
        row: dict[str, Any] = {"text": text_cell(raw, cfg.text_column, i, path)}
        if cfg.target_column in raw:
            row["target"] = target_cell(raw.get(cfg.target_column), cfg.target_column, i, path)
        return row

    def prepare(self, tokenizer: Any, data_cfg: DataConfig, loss_cfg: LossConfig) -> None:
        self.target_position = loss_cfg.target_position

    def texts(self, row: dict[str, Any], cfg: DataConfig) -> list[str]:
        return [row["text"]]

    def encode(self, row: dict[str, Any], b: Builder, loss_cfg: LossConfig) -> Example | None:
        i, cfg = row.get("row", -1), b.cfg
        prefix, body = b.front(encode(b.tokenizer, row["text"]))
        body = b.with_eos(body)
        if b.too_long(i, len(prefix) + len(body)):
            return None
        ids = prefix + body[-(cfg.max_length - len(prefix)):]
        tail = len(ids) - 1 if loss_cfg.threshold == "all" else loss_cfg.threshold
        if len(ids) < tail + 1 or tail < 1:
            raise DataError(f"row {i} has {len(ids)} tokens; loss.threshold={loss_cfg.threshold} needs at "
                            f"least {max(tail, 1) + 1}. Lower loss.threshold, raise data.max_length or drop the row.")
        target = _target_id(b.tokenizer, row["target"], i) if "target" in row else 0
        return Example(ids, tail, int(row.get("type", 0)), target, -1, i)

    def info(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        return {"has_target": "target" in rows[0]}

    def eval_columns(self, model: torch.nn.Module, batch: dict[str, Tensor], tail_logits: Tensor, targets: Tensor,
                     spec: Any) -> list[Tensor]:
        if not self.found.get("has_target"):
            return []
        return [target_stats(tail_logits, batch["target_token"], None, self.target_position).logprob]

    def summary(self, sums: list[float], n: int, spec: Any) -> dict[str, float]:
        return {"eval/target_nll": -sums[0] / n} if self.found.get("has_target") else {}
