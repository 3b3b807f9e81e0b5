"""Data pipeline: formats, rendering, tails, truncation, special tokens, collation, files read as text."""

from __future__ import annotations

import copy
import json

import pytest

from scale.config.schema import DataConfig, LossConfig
from scale.data import (Collator, build_splits, label_sequences, load_rows, render_template, special_affixes,
                        split_rows, tokenize_rows)
from tests.conftest import ROOT, SHARED_DATA, TINY_DATA

TINY_COMPLETIONS = ROOT / "configs" / "data" / "tiny_completions.jsonl"


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def _enc(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def bos_eos_tokenizer(tokenizer):
    """SmolLM2's tokenizer with a post-processor that adds BOS and EOS of its own (as Llama-2 + add_eos_token)."""
    from tokenizers.processors import TemplateProcessing

    tok = copy.deepcopy(tokenizer)
    tok._tokenizer.post_processor = TemplateProcessing(single="<|endoftext|> $A <|im_end|>",
                                                       special_tokens=[("<|endoftext|>", 0), ("<|im_end|>", 2)])
    tok.bos_token = "<|endoftext|>"
    assert tok("hi")["input_ids"] == [0, *_enc(tok, "hi"), 2] and special_affixes(tok) == ([0], [2])
    return tok


def test_rows_render_with_label_tail_and_collate(tokenizer):
    cfg = DataConfig(path=str(TINY_DATA), eval_size=32, max_length=12)
    splits = build_splits(cfg, LossConfig(), tokenizer, str(TINY_DATA), seed=0)
    assert len(splits.train) == 128 and len(splits.eval) == 32 and splits.format == "classification"
    pos, neg = tokenizer.convert_tokens_to_ids(["Ġnegative", "Ġpositive"])
    assert splits.label_token_ids == [pos, neg] and splits.label_seqs == [[pos], [neg]]
    ex = splits.train[0]
    assert len(ex.input_ids) <= 12                     # truncated from the prompt side...
    assert ex.input_ids[-1] == tokenizer.eos_token_id  # ...so the answer tail survives
    assert ex.input_ids[-2] == ex.target_token and ex.target_token in splits.label_token_ids and ex.tail_len == 2
    assert ex.type_indicator == splits.label_token_ids.index(ex.target_token) == ex.label
    batch = Collator(tokenizer.pad_token_id, "left")(splits.train[:4])
    assert batch["input_ids"].shape[0] == 4 and batch["attention_mask"][:, -1].tolist() == [1, 1, 1, 1]
    assert batch["target_token"].tolist() == [e.target_token for e in splits.train[:4]]
    assert batch["tail_mask"].tolist() == [[1, 1]] * 4
    assert splits.stats == {"data/train_rows": 128, "data/eval_rows": 32, "data/duplicates_removed": 0,
                            "data/eval_rows_in_train": 25, "data/dropped_long_rows": 0,
                            "data/train_trained_tokens": 256, "data/eval_trained_tokens": 64,   # label + EOS a row
                            "data/train_rows_truncated": 128, "data/eval_rows_truncated": 32}  # every row > 12


def test_split_is_deterministic_by_seed():
    rows = list(range(100))
    assert split_rows(rows, 10, 1) == split_rows(rows, 10, 1)
    assert split_rows(rows, 10, 1) != split_rows(rows, 10, 2)
    train, held = split_rows(rows, 10, 1)
    assert sorted(train + held) == rows and len(held) == 10


def test_deduplicate_before_the_split(tokenizer):
    """Issue 11 item 6: the tiny data holds 78 distinct rows of 160; 25 of the 32 eval rows copy training rows."""
    cfg = DataConfig(eval_size=32, deduplicate=True)
    splits = build_splits(cfg, LossConfig(), tokenizer, str(TINY_DATA), seed=0)
    assert splits.stats["data/duplicates_removed"] == 82 and splits.stats["data/eval_rows_in_train"] == 0
    assert len(splits.train) == 46 and len(splits.eval) == 32
    train_ids = {tuple(e.input_ids) for e in splits.train}
    assert not any(tuple(e.input_ids) in train_ids for e in splits.eval)


def test_type_column(tmp_path, tokenizer):
    path = _write(tmp_path / "t.jsonl", [{"text": "fine film", "label": "positive", "kind": 3}] * 3)
    rows = load_rows(DataConfig(type_column="kind"), path)
    ex = tokenize_rows(rows, tokenizer, DataConfig(), LossConfig())
    assert [e.type_indicator for e in ex] == [3, 3, 3]


@pytest.mark.parametrize("columns, fmt", [
    ({"text": "a b c d"}, "text"),
    ({"text": "a b c d", "type": 1, "target": " c"}, "text"),
    ({"text": "a b", "label": "positive"}, "classification"),
    ({"prompt": "Q", "completion": " A", "id": 3}, "prompt_completion"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}, "messages"),
])
def test_format_is_detected_from_the_columns(tmp_path, columns, fmt):
    rows = load_rows(DataConfig(), _write(tmp_path / "d.jsonl", [columns]))
    assert rows.task.name == fmt and rows[:1].task is rows.task   # decided once; a slice keeps it


def test_text_format_tail_is_the_last_threshold_tokens(tmp_path, tokenizer):
    path = _write(tmp_path / "t.jsonl", [{"text": "one two three four five six", "type": 1, "target": " five"}])
    rows = load_rows(DataConfig(), path)
    (ex,) = tokenize_rows(rows, tokenizer, DataConfig(max_length=5), LossConfig(threshold=3, target_position=-3))
    ids = _enc(tokenizer, "one two three four five six") + [tokenizer.eos_token_id]
    assert ex.input_ids == ids[-5:] and ex.tail_len == 3 and ex.type_indicator == 1
    assert ex.target_token == _enc(tokenizer, " five")[0] == ex.input_ids[-3]


def test_multi_token_labels(tmp_path, tokenizer):
    cfg = DataConfig(labels=["very negative", "negative", "thumbs-up"])
    seqs = label_sequences(tokenizer, cfg)
    assert [[tokenizer.decode([t]) for t in s] for s in seqs] == [[" very", " negative"], [" negative"],
                                                                   [" thumbs", "-", "up"]]
    rows = load_rows(cfg, _write(tmp_path / "d.jsonl", [{"text": "bad", "label": "very negative"},
                                                         {"text": "good", "label": "thumbs-up"}]))
    a, b = tokenize_rows(rows, tokenizer, cfg, LossConfig())
    assert a.input_ids[-3:] == [*seqs[0], tokenizer.eos_token_id] and a.tail_len == 3 and a.label == 0
    assert b.input_ids[-4:] == [*seqs[2], tokenizer.eos_token_id] and b.tail_len == 4 and b.label == 2
    assert a.target_token == b.target_token == 0     # no single-token fast path
    assert a.input_ids[:-3] == _enc(tokenizer, "Review: bad\nSentiment:")


def test_labels_with_spaces_in_the_config(tmp_path, tokenizer):
    """Issue 11 item 12: data.labels=[' negative',' positive'] and the file's labels normalize the same way."""
    cfg = DataConfig(labels=[" negative", " positive"])
    rows = load_rows(cfg, _write(tmp_path / "d.jsonl", [{"text": "fine", "label": "positive "}]))
    (ex,) = tokenize_rows(rows, tokenizer, cfg, LossConfig())
    assert rows[0]["label"] == "positive" and ex.label == 1
    assert ex.input_ids == _enc(tokenizer, "Review: fine\nSentiment: positive") + [tokenizer.eos_token_id]


def test_template_braces_render_literally(tmp_path, tokenizer):
    template = 'JSON {"review": "{text}", "n": {0}} {{x}}\nLabel: {label}'
    assert render_template(template, "a {label} b", "positive") == \
        'JSON {"review": "a {label} b", "n": {0}} {{x}}\nLabel: positive'
    cfg = DataConfig(template=template)
    rows = load_rows(cfg, _write(tmp_path / "d.jsonl", [{"text": "fine", "label": "positive"}]))
    (ex,) = tokenize_rows(rows, tokenizer, cfg, LossConfig())
    assert tokenizer.decode(ex.input_ids) == 'JSON {"review": "fine", "n": {0}} {{x}}\nLabel: positive<|im_end|>'


def test_prompt_completion_tail_and_truncation(tmp_path, tokenizer):
    rows = load_rows(DataConfig(), _write(tmp_path / "d.jsonl", [
        {"prompt": "Say the capital of France.", "completion": " Paris is the capital."}]))
    (ex,) = tokenize_rows(rows, tokenizer, DataConfig(), LossConfig())
    completion = _enc(tokenizer, " Paris is the capital.") + [tokenizer.eos_token_id]
    assert ex.input_ids == _enc(tokenizer, "Say the capital of France.") + completion
    assert ex.tail_len == len(completion) == 6 and ex.label == -1
    (short,) = tokenize_rows(rows, tokenizer, DataConfig(max_length=8), LossConfig())
    assert short.input_ids == _enc(tokenizer, "Say the capital of France.")[-2:] + completion   # prompt loses tokens
    # A completion that already ends with EOS gets no second one.
    rows[0]["completion"] = " Paris<|im_end|>"
    (own,) = tokenize_rows(rows, tokenizer, DataConfig(), LossConfig())
    assert own.input_ids[-2:] == [_enc(tokenizer, " Paris")[0], tokenizer.eos_token_id] and own.tail_len == 2


def test_post_processor_special_tokens_are_not_doubled(tmp_path, bos_eos_tokenizer):
    """A tokenizer that adds BOS and EOS itself: one BOS in front, one EOS at the end, the label in place, and
    truncation keeps BOS."""
    tok, eos = bos_eos_tokenizer, bos_eos_tokenizer.eos_token_id
    cfg = DataConfig(max_length=64)
    rows = load_rows(cfg, _write(tmp_path / "d.jsonl", [{"text": "a fine film", "label": "positive"}]))
    (ex,) = tokenize_rows(rows, tok, cfg, LossConfig())
    assert ex.input_ids == [0, *_enc(tok, "Review: a fine film\nSentiment: positive"), eos]
    assert ex.input_ids[-2] == ex.target_token == _enc(tok, " positive")[0]
    (cut,) = tokenize_rows(rows, tok, DataConfig(max_length=5), LossConfig())
    assert cut.input_ids == [0, *_enc(tok, "Review: a fine film\nSentiment: positive")[-3:], eos]
    pc = load_rows(cfg, _write(tmp_path / "p.jsonl", [{"prompt": "one two three four", "completion": " five"}]))
    (ex,) = tokenize_rows(pc, tok, DataConfig(max_length=4), LossConfig())
    assert ex.input_ids == [0, _enc(tok, "one two three four")[-1], *_enc(tok, " five"), eos] and ex.tail_len == 2
    text = load_rows(cfg, _write(tmp_path / "t.jsonl", [{"text": "one two three four"}]))
    (ex,) = tokenize_rows(text, tok, DataConfig(max_length=4), LossConfig())
    assert ex.input_ids == [0, *_enc(tok, "one two three four")[-2:], eos]


def test_messages_tail_is_every_assistant_turn_or_the_last(tmp_path, tokenizer):
    """Issue 17: by default every assistant turn is trained, from its first content token through its end-of-turn
    marker; the user turn between them sits inside the tail with weight 0. last_assistant trains the last only."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris."}]
    rows = load_rows(DataConfig(), _write(tmp_path / "d.jsonl", [{"messages": messages}]))
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert rendered.endswith("<|im_start|>assistant\nParis.<|im_end|>\n")
    (ex,) = tokenize_rows(rows, tokenizer, DataConfig(max_length=256), LossConfig())
    assert tokenizer.decode(ex.input_ids) == rendered[:-1]          # cut right after the end-of-turn marker
    tail = ex.input_ids[-ex.tail_len:]
    trained = [t for t, f in zip(tail, ex.trained) if f]
    assert tokenizer.decode(tail).startswith("Hello.<|im_end|>") and ex.trained[0] == 1
    assert trained == _enc(tokenizer, "Hello.<|im_end|>") + _enc(tokenizer, "Paris.<|im_end|>")
    assert tokenizer.decode([t for t, f in zip(tail, ex.trained) if not f]) == \
        "\n<|im_start|>user\nCapital of France?<|im_end|>\n<|im_start|>assistant\n"
    last = DataConfig(max_length=256, train_on="last_assistant")
    (ex,) = tokenize_rows(rows, tokenizer, last, LossConfig())
    assert ex.input_ids[-ex.tail_len:] == _enc(tokenizer, "Paris.<|im_end|>") and ex.trained is None
    # too little room: the oldest exchange goes whole (never part of a turn); the rest is rendered again
    alone = tokenizer.apply_chat_template(messages[2:], tokenize=False)
    room = len(_enc(tokenizer, alone.rstrip("\n")))
    for train_on in ("last_assistant", "all_assistant"):
        (cut,) = tokenize_rows(rows, tokenizer, DataConfig(max_length=room, train_on=train_on), LossConfig())
        assert tokenizer.decode(cut.input_ids) == alone.rstrip("\n") and cut.trained is None
        assert cut.input_ids[-cut.tail_len:] == _enc(tokenizer, "Paris.<|im_end|>")


def test_messages_with_a_chat_template_file(tmp_path, tokenizer):
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}assistant:{% endif %}")
    cfg = DataConfig(chat_template=str(template))
    rows = load_rows(cfg, _write(tmp_path / "d.jsonl", [{"messages": [{"role": "user", "content": "Hi"},
                                                                       {"role": "assistant", "content": "Yo"}]}]))
    (ex,) = tokenize_rows(rows, tokenizer, cfg, LossConfig())
    # No end-of-turn special token in this template: the tail is the content + EOS.
    assert tokenizer.decode(ex.input_ids) == "user: Hi\nassistant: Yo<|im_end|>"
    assert ex.input_ids[-ex.tail_len:] == [*_enc(tokenizer, " Yo"), tokenizer.eos_token_id]


def test_csv_cells_are_text_never_missing_values(tmp_path, tokenizer):
    """Issue 11 item 4: `NA` text and a `None` label stay strings."""
    path = tmp_path / "d.csv"
    path.write_text('text,label\nNA,None\nnull,positive\n"a, quoted ""cell""",None\n', encoding="utf-8")
    rows = load_rows(DataConfig(labels=["None", "positive"]), str(path))
    assert [(r["text"], r["label"]) for r in rows] == [("NA", "None"), ("null", "positive"),
                                                       ('a, quoted "cell"', "None")]


def test_jsonl_text_with_unicode_line_separators(tmp_path):
    """U+2028, U+0085 and form feeds inside a JSON string do not end the line (real review data holds them)."""
    path = tmp_path / "d.jsonl"
    texts = ["one\u2028two", "three\x85four\x0cfive"]
    path.write_text("".join(json.dumps({"text": t, "label": "positive"}, ensure_ascii=False) + "\r\n" for t in texts),
                    encoding="utf-8")
    assert [r["text"] for r in load_rows(DataConfig(), str(path))] == texts


def test_tsv_quotes_are_characters(tmp_path):
    path = tmp_path / "d.tsv"
    path.write_text('label\ttext\npositive\t" extreme ops " exceeds expectations\nnegative\tso "bad\n'
                    'positive\tgood\n', encoding="utf-8")
    rows = load_rows(DataConfig(), str(path))
    assert [r["text"] for r in rows] == ['" extreme ops " exceeds expectations', 'so "bad', "good"]


def test_headerless_tsv_from_shared_mr_data(tokenizer):
    path = SHARED_DATA / "mr_sentence_polarity.tsv"
    if not path.exists():
        pytest.skip("../shared/data is absent")
    cfg = DataConfig(column_names=["label", "text"], eval_size=400)
    rows = load_rows(cfg, str(path))
    assert len(rows) == 10662 and {r["label"] for r in rows} == {"positive", "negative"}
    assert rows[123]["text"].startswith('" extreme ops " exceeds expectations')   # quotes kept, as written
    ex = tokenize_rows(rows[:50], tokenizer, cfg, LossConfig())
    assert all(e.input_ids[-2] == e.target_token for e in ex)


def test_tiny_completions_file(tokenizer):
    cfg = DataConfig(path=str(TINY_COMPLETIONS), eval_size=32, max_length=64)
    splits = build_splits(cfg, LossConfig(), tokenizer, cfg.path, seed=0)
    assert splits.format == "prompt_completion" and splits.label_token_ids is None
    assert sorted({e.tail_len for e in splits.train}) == list(range(2, 13))   # 1-6 words + EOS
    batch = Collator(tokenizer.pad_token_id, "right")(splits.train[:8])
    assert batch["tail_mask"].shape[1] == max(e.tail_len for e in splits.train[:8])
    assert batch["tail_mask"].sum(1).tolist() == [e.tail_len for e in splits.train[:8]]

# The bad-input catalogue (exact messages) is tests/test_bad_input.py.


def test_embedded_dialog_data_of_the_sft_job(tokenizer):
    """The SFT job's data: the chatterbot-corpus wheel's English corpus as messages rows (fetched once)."""
    from scale.config.load import load_config
    from scale.utils.assets import resolve_data

    path = resolve_data("chatterbot-english")
    rows = load_rows(DataConfig(), path)
    assert len(rows) == 2025 and all(r["messages"][-1]["role"] == "assistant" for r in rows)
    assert rows[0]["messages"] == [{"role": "user", "content": "What is AI?"}, {
        "role": "assistant", "content": "Artificial Intelligence is the branch of engineering and science devoted to "
                                        "constructing machines that think."}]
    cfg = load_config(ROOT / "configs" / "train" / "sft.yaml", [f"data.chat_template={ROOT}/configs/chat/chatml.jinja"])
    splits = build_splits(cfg.data, cfg.loss, tokenizer, path, cfg.train.seed)
    # 17 rows dropped: 15 whose answer alone is over 128 tokens, 2 (data-file rows 151, 184) whose answer leaves no
    # room for the user turn's markers (the prompt was cut inside them before); 3 chats lost their oldest exchanges
    # (12 assistant turns not trained) and 2 (rows 142, 185) the start of their user text, the markers kept
    assert splits.format == "messages" and {k: v for k, v in splits.stats.items() if v} == {
        "data/train_rows": 783, "data/eval_rows": 98, "data/duplicates_removed": 1127, "data/dropped_long_rows": 17,
        "data/train_trained_tokens": 12491, "data/eval_trained_tokens": 1663, "data/train_rows_truncated": 4,
        "data/eval_rows_truncated": 1, "data/train_turns_cut": 11, "data/eval_turns_cut": 1,
        "data/train_user_text_cut": 2}
    ex = splits.eval[0]
    assert tokenizer.decode(ex.input_ids[-ex.tail_len:]) == "Classical<|im_end|>"
