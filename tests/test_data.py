"""Data pipeline: rendering, truncation, collation, and clear errors for bad input."""

from __future__ import annotations

import json

import pytest

from scale.config import ConfigError, DataConfig, LossConfig, load_config
from scale.data import Collator, DataError, build_splits, label_token_ids, load_rows, split_rows, tokenize_rows
from tests.conftest import SHARED_DATA, TINY_DATA, TINY_YAML


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


# ---- bad input: each error names the field and the fix ----

def test_short_row_error(tmp_path, tokenizer):
    rows = [{"text": "ok", "label": "positive"}]
    with pytest.raises(DataError, match=r"row 0 has \d+ tokens; loss.threshold=40 needs at least 41"):
        tokenize_rows(rows, tokenizer, DataConfig(max_length=64), LossConfig(threshold=40, target_position=-2))


def test_multi_token_label_error(tokenizer):
    with pytest.raises(DataError, match=r"data.labels: 'thumbs-up' renders as \d+ tokens .* must be a single token"):
        label_token_ids(tokenizer, DataConfig(labels=["negative", "thumbs-up"]))


def test_missing_column_error(tmp_path):
    path = _write(tmp_path / "d.jsonl", [{"review": "good", "label": "positive"}])
    with pytest.raises(DataError, match=r"data.text_column='text' is not a column of .*its columns are \['review', 'label'\]"):
        load_rows(DataConfig(), path)


def test_empty_file_error(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    with pytest.raises(DataError, match=r"data.path=.*empty.jsonl' is empty; it needs at least one labelled row"):
        load_rows(DataConfig(), str(path))


def test_non_utf8_file_error(tmp_path):
    path = tmp_path / "latin1.csv"
    path.write_bytes("text,label\ncaf\xe9 film,positive\n".encode("latin-1"))
    with pytest.raises(DataError, match=r"is not UTF-8 \(byte \d+\); re-encode it as UTF-8"):
        load_rows(DataConfig(), str(path))


def test_unknown_label_error(tmp_path):
    path = _write(tmp_path / "d.jsonl", [{"text": "meh", "label": "neutral"}])
    with pytest.raises(DataError, match=r"label 'neutral' is not in data.labels=\['negative', 'positive'\]"):
        load_rows(DataConfig(), path)


def test_unknown_config_key_error():
    with pytest.raises(ConfigError, match=r"unknown config key train.max_stpes; known keys in train: "):
        load_config(TINY_YAML, ["train.max_stpes=5"])
