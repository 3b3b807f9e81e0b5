"""Issue 18: any source, tokenized once into a memory-mapped cache that every rank and every resume reads."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path

import pytest

from scale.config.schema import DataConfig, LossConfig
from scale.data import DataError, build_splits
from tests.conftest import ROOT, TINY_DATA, tiny_cfg

TINY_COMPLETIONS = ROOT / "configs" / "data" / "tiny_completions.jsonl"


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _same(a, b) -> bool:
    """Two splits hold the same examples (every Example field, ``trained`` included) in the same order, and the
    same metadata (every other Splits field: format, label tokens, counts, token fingerprint, template hash...)."""
    meta = [f.name for f in dataclasses.fields(a) if f.name not in ("train", "eval")]
    return (len(a.train) == len(b.train) and len(a.eval) == len(b.eval)
            and all(x == y for x, y in zip(a.train, b.train)) and all(x == y for x, y in zip(a.eval, b.eval))
            and [getattr(a, m) for m in meta] == [getattr(b, m) for m in meta])


def _builds(cache: Path) -> list[dict]:
    path = cache / "builds.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """tiny_reviews.jsonl as every other source kind: parquet, save_to_disk, a glob of jsonl shards, a directory
    of parquet shards."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("sources")
    rows = _rows(TINY_DATA)
    pq.write_table(pa.Table.from_pylist(rows), root / "reviews.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(root / "disk"))
    (root / "jsonl").mkdir()
    (root / "pq").mkdir()
    for k, start in enumerate(range(0, len(rows), 70)):  # 3 shards: 70, 70, 20 rows
        part = rows[start:start + 70]
        (root / "jsonl" / f"part-{k:02d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
        pq.write_table(pa.Table.from_pylist(part), root / "pq" / f"part-{k:02d}.parquet")
    return {"parquet": root / "reviews.parquet", "save_to_disk": root / "disk",
            "glob of jsonl shards": f"{root}/jsonl/part-*.jsonl", "directory of parquet shards": root / "pq"}


@pytest.mark.parametrize("kind", ["parquet", "save_to_disk", "glob of jsonl shards", "directory of parquet shards"])
def test_every_source_kind_builds_the_splits_of_the_jsonl_file(sources, tokenizer, kind):
    cfg = DataConfig(eval_size=32)
    ref = build_splits(cfg, LossConfig(), tokenizer, str(TINY_DATA), seed=0)
    got = build_splits(cfg, LossConfig(), tokenizer, str(sources[kind]), seed=0)
    assert len(got.train) == 128 and _same(ref, got)


def test_save_to_disk_dataset_dict_takes_data_split(tmp_path, tokenizer):
    import datasets

    rows = _rows(TINY_DATA)
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:100]),
                          "test": datasets.Dataset.from_list(rows[100:])}).save_to_disk(str(tmp_path / "dd"))
    splits = build_splits(DataConfig(eval_split="test"), LossConfig(), tokenizer, str(tmp_path / "dd"), seed=0)
    assert (len(splits.train), len(splits.eval)) == (100, 60)
    assert sorted(e.row for e in splits.eval) == list(range(60))  # rows of the test split, all of them
    with pytest.raises(DataError, match=r"data.split='validation' is not a split of .*; its splits are "
                                        r"\['train', 'test'\]"):
        build_splits(DataConfig(split="validation"), LossConfig(), tokenizer, str(tmp_path / "dd"), seed=0)


def test_eval_path_evaluates_its_own_rows_and_trains_on_every_row(tmp_path, tokenizer):
    rows = _rows(TINY_DATA)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:120]))
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[120:]))
    cfg = DataConfig(eval_path=str(tmp_path / "eval.jsonl"))
    splits = build_splits(cfg, LossConfig(), tokenizer, str(tmp_path / "train.jsonl"), seed=0)
    carved = build_splits(DataConfig(eval_size=40), LossConfig(), tokenizer, str(TINY_DATA), seed=0)
    assert (len(splits.train), len(splits.eval)) == (120, 40)  # data.eval_size=400 does not apply
    assert sorted(e.row for e in splits.train) == list(range(120))
    by_text = {tuple(e.input_ids) for e in carved.train} | {tuple(e.input_ids) for e in carved.eval}
    assert [e.row for e in splits.eval] == list(range(40))  # the eval file in its order
    assert all(tuple(e.input_ids) in by_text for e in splits.eval)


def test_long_csv_cell_is_read(tmp_path, tokenizer):
    """A cell over csv's default 131,072-character limit is text, not an 'unclosed quote' error."""
    from scale.data.tasks import load_rows

    long = "word " * 40_000  # 200,000 characters
    (tmp_path / "long.csv").write_text(f'text,label\n"{long}",positive\nshort,negative\nNA,positive\n')
    rows = load_rows(DataConfig(), str(tmp_path / "long.csv"))
    assert [len(r["text"]) for r in rows] == [len(long.strip()), 5, 2] and rows[2]["text"] == "NA"


def test_hub_id_offline_is_one_line(monkeypatch):
    from scale.data.tasks import load_rows

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(DataError) as err:
        load_rows(DataConfig(), "no-such-org/no-such-dataset")
    msg = str(err.value)
    assert msg.startswith("data.path='no-such-org/no-such-dataset' is not a local file or directory, so it was read "
                          "as a hub data set, and that failed: ")
    assert "the hub is offline (HF_HUB_OFFLINE/HF_DATASETS_OFFLINE is set)" in msg and "\n" not in msg


@pytest.mark.parametrize("drift", ["extra column", "integer label", "missing column"])
def test_parquet_shards_that_differ_name_the_shard_and_column(tmp_path, drift):
    """Shards written at different times: one line naming the shard and the column, before anything is read (an
    integer label would otherwise be cast to the text '1' without a word, an extra column stop datasets'
    reader with a DatasetGenerationError naming neither)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from scale.data.tasks import load_rows

    rows = _rows(TINY_DATA)
    later = {"extra column": [{**r, "source": "web"} for r in rows[80:]],
             "integer label": [{"text": r["text"], "label": int(r["label"] == "positive")} for r in rows[80:]],
             "missing column": [{"text": r["text"]} for r in rows[80:]]}[drift]
    pq.write_table(pa.Table.from_pylist(rows[:80]), tmp_path / "part-00000.parquet")
    pq.write_table(pa.Table.from_pylist(later), tmp_path / "part-00001.parquet")
    with pytest.raises(DataError) as err:
        load_rows(DataConfig(), str(tmp_path))
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"data.path={str(tmp_path)!r}: ")
    assert {"extra column": "shard part-00001.parquet has the column(s) ['source'] that part-00000.parquet lacks",
            "integer label": "column 'label' is int64 in shard part-00001.parquet but string in part-00000.parquet",
            "missing column": "shard part-00001.parquet has no column(s) ['label']"}[drift] in msg


# ---- the token cache ----

def _cfg(tmp_path, *overrides):
    return tiny_cfg(tmp_path / "out", f"data.cache_dir={tmp_path / 'cache'}", *overrides)


@pytest.mark.parametrize("data", ["reviews", "completions", "messages"])
def test_cache_holds_the_in_memory_splits_and_a_hit_does_not_tokenize(tmp_path, tokenizer, monkeypatch, data, caplog):
    """Same seed -> the same examples in the same order as build_splits; the pool path (chunks of 16 rows,
    2 workers) is exact; the second load is a hit (one build in the record)."""
    import scale.data.cache as cache
    from scale.data.token_table import column, longest_first

    over = {"reviews": [], "completions": [f"data.path={TINY_COMPLETIONS}", "data.eval_size=16"],
            "messages": [f"data.path={tmp_path / 'chat.jsonl'}", "data.eval_size=8", "data.max_length=128",
                         f"data.chat_template={ROOT / 'configs' / 'chat' / 'chatml.jinja'}"]}[data]
    if data == "messages":
        (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": [
            {"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["completion"].strip()}]})
            + "\n" for r in _rows(TINY_COMPLETIONS)[:40]))
    monkeypatch.setattr(cache, "CHUNK_ROWS", 16)
    cfg = _cfg(tmp_path, "data.num_proc=2", *over)
    ref = build_splits(cfg.data, cfg.loss, tokenizer, cfg.data.path, cfg.train.seed)
    with caplog.at_level(logging.INFO, logger="scale.data.cache"):
        built = cache.load_splits(cfg, tokenizer, cfg.data.path)
        hit = cache.load_splits(cfg, tokenizer, cfg.data.path)
    assert isinstance(hit.train, cache.TokenTable) and _same(ref, built) and _same(ref, hit)
    assert [b["num_proc"] for b in _builds(tmp_path / "cache")] == [2]
    assert sum("data cache: hit" in r.message for r in caplog.records) == 1
    assert column(hit.train, "length").tolist() == [len(e.input_ids) for e in ref.train]
    assert list(longest_first(hit.eval)) == sorted(ref.eval, key=lambda e: -len(e.input_ids))


def test_multi_turn_chats_round_trip_the_cache_exactly(tmp_path, tokenizer, monkeypatch):
    """configs/data/tiny_chats.jsonl (1-3 exchanges per chat, every assistant turn trained): the cache (pool path:
    chunks of 8 rows, 2 workers) and a hit give the in-memory splits exactly, the tails' 0/1 ``trained`` flags and
    ``None`` included; the token fingerprint and template hash (the resume check) come back without a rebuild."""
    import scale.data.cache as cache
    from scale.data.tasks.base import Example

    monkeypatch.setattr(cache, "CHUNK_ROWS", 8)
    cfg = _cfg(tmp_path, "data.num_proc=2", f"data.path={ROOT / 'configs' / 'data' / 'tiny_chats.jsonl'}",
               "data.max_length=128", f"data.chat_template={ROOT / 'configs' / 'chat' / 'chatml.jinja'}")
    ref = build_splits(cfg.data, cfg.loss, tokenizer, cfg.data.path, cfg.train.seed)
    built = cache.load_splits(cfg, tokenizer, cfg.data.path)
    with monkeypatch.context() as m:  # a hit reads no token: rows_sha256 and the template hash come from meta.json
        m.setattr(cache.TokenTable, "__getitem__", lambda *a: pytest.fail("a hit read a token"))
        hit = cache.load_splits(cfg, tokenizer, cfg.data.path)
    assert isinstance(hit.train, cache.TokenTable) and _same(ref, built) and _same(ref, hit)
    assert len(_builds(tmp_path / "cache")) == 1
    # Not vacuous: some tails hold untrained (user-turn) tokens between two assistant turns.
    multi = [e for e in ref.train if e.trained is not None and 0 in e.trained]
    assert multi and all(hit.train[i].trained == e.trained for i, e in enumerate(ref.train))
    assert hit.format == "messages" and len(hit.fingerprint) == 64 and len(hit.template_sha256) == 64
    # Every Example field is stored: a new field must be added to the cache's columns.
    stored = {"input_ids", *cache.SCALARS, *cache.LISTS, *cache.TEXTS} - {"length"}
    assert {f.name for f in dataclasses.fields(Example)} == stored


def test_the_cache_key_reads_every_module_that_shapes_tokens():
    """The token cache's code hash (TOKEN_MODULES) reads every stage of scale/data/ up to the cache, every format
    module included: a change to any is a new entry. Only the stages that batch (collation, order, the
    sequence-parallel shards of a micro-batch) and the package's face are left out."""
    from scale.data import cache

    here = ROOT / "scale" / "data"
    hashed = {f.relative_to(here).as_posix() for m in cache.TOKEN_MODULES for f in here.glob(m)}
    every = {f.relative_to(here).as_posix() for f in here.rglob("*.py")}
    assert every - hashed == {"__init__.py", "collate.py", "order.py", "sequence.py"} and hashed <= every
    assert {"tasks/messages.py", "tasks/base.py", "split.py", "mixing.py", "tokenize.py"} <= hashed


def test_chat_template_inputs_change_the_fingerprint(tmp_path, tokenizer):
    """The chat-template inputs the messages format reads (data.chat_template_kwargs, data.train_on, the template
    file's text) are part of the cache key."""
    from scale.data.cache import fingerprint

    template = tmp_path / "chat.jinja"
    template.write_text((ROOT / "configs" / "chat" / "chatml.jinja").read_text())
    base = [f"data.path={ROOT / 'configs' / 'data' / 'tiny_chats.jsonl'}", f"data.chat_template={template}"]
    key = fingerprint(_cfg(tmp_path, *base), tokenizer, str(ROOT / "configs" / "data" / "tiny_chats.jsonl"))[0]
    for extra in (["data.train_on=last_assistant"], ["data.chat_template_kwargs={date_string: 09 Jan 2026}"]):
        cfg = _cfg(tmp_path, *base, *extra)
        assert fingerprint(cfg, tokenizer, cfg.data.path)[0] != key, extra
    template.write_text(template.read_text().replace("<|im_start|>", "<|im_start|> "))
    assert fingerprint(_cfg(tmp_path, *base), tokenizer, str(ROOT / "configs" / "data" / "tiny_chats.jsonl"))[0] != key


def test_a_changed_input_is_a_new_entry(tmp_path, tokenizer):
    """Data file, tokenizer, chat template and token-shaping keys change the fingerprint; batching keys don't."""
    from scale.data.cache import fingerprint

    data = tmp_path / "reviews.jsonl"
    shutil.copy(TINY_DATA, data)
    template = tmp_path / "chat.jinja"
    template.write_text((ROOT / "configs" / "chat" / "chatml.jinja").read_text())
    base = ["data.path=" + str(data), f"data.chat_template={template}"]
    key = fingerprint(_cfg(tmp_path, *base), tokenizer, str(data))[0]
    same = [["data.group_by_length=true"], ["data.num_proc=1"], ["data.padding_side=right"], ["data.cache_dir=/x"]]
    for extra in same:
        assert fingerprint(_cfg(tmp_path, *base, *extra), tokenizer, str(data))[0] == key, extra
    for extra in (["data.max_length=32"], ["train.seed=1"], ["loss.threshold=3"], ["data.template=R: {text}\nS: {label}"]):
        assert fingerprint(_cfg(tmp_path, *base, *extra), tokenizer, str(data))[0] != key, extra
    template.write_text(template.read_text() + "\n")
    assert fingerprint(_cfg(tmp_path, *base), tokenizer, str(data))[0] != key
    template.write_text((ROOT / "configs" / "chat" / "chatml.jinja").read_text())
    with open(data, "a") as fh:
        fh.write(json.dumps({"text": "One more review.", "label": "positive"}) + "\n")
    assert fingerprint(_cfg(tmp_path, *base), tokenizer, str(data))[0] != key
    data.write_bytes(TINY_DATA.read_bytes())
    assert fingerprint(_cfg(tmp_path, *base), tokenizer, str(data))[0] == key
    import copy

    other = copy.deepcopy(tokenizer)
    other.add_tokens(["zzqxv"])
    assert fingerprint(_cfg(tmp_path, *base), other, str(data))[0] != key


def test_edited_data_file_is_rebuilt_not_read_stale(tmp_path, tokenizer):
    from scale.data.cache import load_splits

    data = tmp_path / "reviews.jsonl"
    shutil.copy(TINY_DATA, data)
    cfg = _cfg(tmp_path, f"data.path={data}")
    first = load_splits(cfg, tokenizer, str(data))
    data.write_text(data.read_text().replace("charming", "dreadful"))
    second = load_splits(cfg, tokenizer, str(data))
    assert len(_builds(tmp_path / "cache")) == 2 and not _same(first, second)
    assert _same(second, build_splits(cfg.data, cfg.loss, tokenizer, str(data), cfg.train.seed))


@pytest.mark.parametrize("damage", ["truncated", "bit flip", "no build record", "half-written"])
def test_a_corrupt_or_half_written_entry_is_rebuilt(tmp_path, tokenizer, damage, caplog):
    from scale.data.cache import default_cache_dir, fingerprint, load_splits

    cfg = _cfg(tmp_path)
    ref = build_splits(cfg.data, cfg.loss, tokenizer, cfg.data.path, cfg.train.seed)
    load_splits(cfg, tokenizer, cfg.data.path)
    entry = default_cache_dir(cfg) / fingerprint(cfg, tokenizer, cfg.data.path)[0][:32]
    arrow = entry / "train.arrow"
    if damage == "truncated":
        arrow.write_bytes(arrow.read_bytes()[:-100])
    elif damage == "bit flip":
        data = bytearray(arrow.read_bytes())
        data[len(data) // 2] ^= 1
        arrow.write_bytes(bytes(data))
    elif damage == "no build record":
        (entry / "build.json").unlink()
    else:  # a crash mid-build: the temp dir is left, the entry never appeared
        shutil.rmtree(entry)
        (entry.with_name(entry.name + ".tmp")).mkdir()
        (entry.with_name(entry.name + ".tmp") / "train.arrow").write_bytes(b"ARROW1 half")
    with caplog.at_level(logging.WARNING, logger="scale.data.cache"):
        again = load_splits(cfg, tokenizer, cfg.data.path)
    assert _same(ref, again) and len(_builds(tmp_path / "cache")) == 2
    assert not entry.with_name(entry.name + ".tmp").exists()
    warned = [r.message for r in caplog.records if "incomplete or corrupt" in r.message]
    assert len(warned) == (damage != "half-written")


def test_a_data_error_leaves_no_entry(tmp_path, tokenizer):
    from scale.data.cache import load_splits

    (tmp_path / "bad.jsonl").write_text('{"text": "fine", "label": "positive"}\n{"text": "x", "label": "meh"}\n')
    cfg = _cfg(tmp_path, f"data.path={tmp_path / 'bad.jsonl'}", "data.eval_size=1")
    with pytest.raises(DataError, match=r"row 1 \(line 2\) of .*label 'meh' is not in data.labels"):
        load_splits(cfg, tokenizer, cfg.data.path)
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")] == []


def test_scale_prepare_builds_what_scale_train_reads(tmp_path, capsys):
    from scale.prepare import main

    args = ["--config", str(ROOT / "configs" / "train" / "tiny_cpu.yaml"), f"data.path={TINY_DATA}",
            f"data.cache_dir={tmp_path / 'cache'}"]
    assert main(args) == 0
    line = capsys.readouterr().out
    assert "format=classification train_rows=128 eval_rows=32" in line and str(tmp_path / "cache") in line
    assert main([*args, "data.labels=[good,bad]"]) == 2
    assert "scale-prepare: error: DataError: row 0 (line 1) of" in capsys.readouterr().err
    assert len(_builds(tmp_path / "cache")) == 1


@pytest.mark.slow
def test_parquet_source_trains_the_tiny_job_as_the_jsonl_file(sources, tmp_path):
    """The whole job from a parquet file and from the jsonl file (both through the cache): the same numbers."""
    from scale.train import run

    def losses(out: Path, data: str) -> list[float]:
        run(tiny_cfg(out, f"data.path={data}", f"data.cache_dir={tmp_path / 'cache'}", "train.max_steps=4",
                     "train.eval_every=0", "log.peak_flops=false"))
        return [json.loads(line).get("train/loss") for line in (out / "metrics.jsonl").read_text().splitlines()]

    jsonl = losses(tmp_path / "jsonl", str(TINY_DATA))
    assert losses(tmp_path / "parquet", str(sources["parquet"])) == jsonl and len([x for x in jsonl if x]) == 2  # log_every=2
    assert len(_builds(tmp_path / "cache")) == 2  # one entry per source (their sha256 differ)


# The 2-process cache claims (the cache is built on rank 0 only; a resume tokenizes nothing and is bit-exact) are
# checked on the launches of tests/test_completions_launch.py::test_prompt_completion_resume_is_bit_exact_under_ddp.
