"""Data pipeline: rendering, truncation, collation, and clear errors for bad input."""

from __future__ import annotations

import json

import pytest

from scale.config import DataConfig, LossConfig
from scale.data import Collator, build_splits, load_rows, split_rows, tokenize_rows
from tests.conftest import SHARED_DATA, TINY_DATA


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def test_rows_render_with_label_tail_and_collate(tokenizer):
    cfg = DataConfig(path=str(TINY_DATA), eval_size=32, max_length=12)
    splits = build_splits(cfg, LossConfig(), tokenizer, str(TINY_DATA), seed=0)
    assert len(splits.train) == 128 and len(splits.eval) == 32
    pos, neg = tokenizer.convert_tokens_to_ids(["Ġnegative", "Ġpositive"])
    assert splits.label_token_ids == [pos, neg]
    ex = splits.train[0]
    assert len(ex.input_ids) <= 12                     # truncated from the prompt side...
    assert ex.input_ids[-1] == tokenizer.eos_token_id  # ...so the answer tail survives
    assert ex.input_ids[-2] == ex.target_token and ex.target_token in splits.label_token_ids
    assert ex.type_indicator == splits.label_token_ids.index(ex.target_token)
    batch = Collator(tokenizer.pad_token_id, "left")(splits.train[:4])
    assert batch["input_ids"].shape[0] == 4 and batch["attention_mask"][:, -1].tolist() == [1, 1, 1, 1]
    assert batch["target_token"].tolist() == [e.target_token for e in splits.train[:4]]


def test_split_is_deterministic_by_seed():
    rows = list(range(100))
    assert split_rows(rows, 10, 1) == split_rows(rows, 10, 1)
    assert split_rows(rows, 10, 1) != split_rows(rows, 10, 2)
    train, held = split_rows(rows, 10, 1)
    assert sorted(train + held) == rows and len(held) == 10


def test_type_column(tmp_path, tokenizer):
    path = _write(tmp_path / "t.jsonl", [{"text": "fine film", "label": "positive", "kind": 3}] * 3)
    rows = load_rows(DataConfig(type_column="kind"), path)
    ex = tokenize_rows(rows, tokenizer, DataConfig(), LossConfig())
    assert [e.type_indicator for e in ex] == [3, 3, 3]


def test_headerless_tsv_from_shared_mr_data(tokenizer):
    path = SHARED_DATA / "mr_sentence_polarity.tsv"
    if not path.exists():
        pytest.skip("../shared/data is absent")
    cfg = DataConfig(column_names=["label", "text"], eval_size=400)
    rows = load_rows(cfg, str(path))
    assert len(rows) == 10662 and {r["label"] for r in rows} == {"positive", "negative"}
    ex = tokenize_rows(rows[:50], tokenizer, cfg, LossConfig())
    assert all(e.input_ids[-2] == e.target_token for e in ex)

# The bad-input catalogue (exact messages) is tests/test_bad_input.py.
