"""Issue 18: several data sets mixed by weight (``data.datasets``), and the ranks that wait for the node's cache
build without a collective."""

from __future__ import annotations

import csv
import json
import logging
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from scale.config.load import load_config
from scale.config.validation import ConfigError
from scale.data import DataError, build_splits
from tests.conftest import ROOT, TINY_YAML, tiny_cfg

COMPLETIONS = ROOT / "configs" / "data" / "tiny_completions.jsonl"
CHATS = ROOT / "configs" / "data" / "tiny_chats.jsonl"
CHATML = ROOT / "configs" / "chat" / "chatml.jinja"


def test_apportion_and_mixture_counts_are_exact_integers():
    from scale.data.mixing import apportion, mixture_counts

    assert apportion(10, [3, 1]) == [8, 2] and apportion(7, [1, 1, 1]) == [3, 2, 2]  # ties: the earlier entry
    assert apportion(3, [0.1, 0.2, 0.7]) == [0, 1, 2] and sum(apportion(1001, [0.3, 0.3, 0.4])) == 1001
    # first_exhausted: the largest size at which no row repeats (61: 30.5 + 30.5, the half row to the earlier entry)
    assert mixture_counts([100, 30], [1, 1], "first_exhausted") == [31, 30]
    assert mixture_counts([100, 100], [3, 1], "first_exhausted") == [100, 33]
    # the example of docs/data.md: 232 rows, not the 231 of the source that runs out first (77 x 6 / 2)
    assert mixture_counts([154, 58, 77], [3, 1, 2], "first_exhausted") == [116, 39, 77]
    # a small source: 38 rows, where 3 x 11 = 33 is all the floor of the small source's quota allows
    assert mixture_counts([1000, 3], [10, 1], "first_exhausted") == [35, 3]
    # all_exhausted: the smallest size at which every row is used, the smaller source repeats
    assert mixture_counts([100, 30], [1, 1], "all_exhausted") == [100, 99]
    assert mixture_counts([100, 30], [1, 1], "first_exhausted", cap=10) == [5, 5]


def test_mixture_sizes_follow_the_documented_rule():
    """For every small case, against a search over every size: first_exhausted is the largest N whose
    apportion(N) repeats no row of any source, all_exhausted the smallest N that uses every row."""
    import math
    import random

    from scale.data.mixing import apportion, mixture_counts

    rng = random.Random(0)
    for _ in range(200):
        k = rng.randint(1, 4)
        available = [rng.randint(1, 30) for _ in range(k)]
        weights = [rng.choice([1, 2, 3, 5, 0.5, 1.5, 10]) for _ in range(k)]
        # no size above every row fits; every source's quota reaches its rows by the last size here
        fits = [n for n in range(sum(available) + 1)
                if all(c <= a for c, a in zip(apportion(n, weights), available))]
        bound = max(math.ceil(a * sum(weights) / w) for a, w in zip(available, weights))
        covers = [n for n in range(bound + 1) if all(c >= a for c, a in zip(apportion(n, weights), available))]
        assert mixture_counts(available, weights, "first_exhausted") == apportion(max(fits), weights), (available, weights)
        assert mixture_counts(available, weights, "all_exhausted") == apportion(min(covers), weights), (available, weights)


@pytest.fixture
def mixture(tmp_path):
    """Three sources in three file types and two formats: the completions (jsonl, weight 3), the same rows with
    other column names (csv, weight 1) and the multi-turn chats (messages, parquet, weight 2)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in COMPLETIONS.read_text().splitlines()]
    with open(tmp_path / "qa.csv", "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(["question", "answer"])
        w.writerows([("Q: " + r["prompt"].replace("\n", " "), r["completion"]) for r in rows[:60]])  # one line each
    chats = [json.loads(line) for line in CHATS.read_text().splitlines()]
    pq.write_table(pa.Table.from_pylist(chats), tmp_path / "chats.parquet")
    datasets = (f"data.datasets=[{{path: {COMPLETIONS}, weight: 3}}, {{path: {tmp_path / 'qa.csv'}, weight: 1, "
                f"prompt_column: question, completion_column: answer}}, {{path: {tmp_path / 'chats.parquet'}, "
                f"weight: 2, name: chats}}]")
    return [datasets, "data.eval_size=12", "data.max_length=128", f"data.chat_template={CHATML}"]


def _source_of(tokenizer, e) -> str:
    text = tokenizer.decode(e.input_ids)
    return "chats" if "<|im_start|>" in text else "qa" if text.startswith("Q: ") else "tiny_completions"


def test_mixture_holds_exact_ratios_and_is_deterministic(tmp_path, tokenizer, mixture):
    """160 + 60 + 81 rows at weights 3:1:2, eval 12 carved 6/2/4: the chats (77 train rows at weight 2/6) run out
    first, so the train split holds exactly 116/39/77 rows (232 x 3/6, 1/6, 2/6: 116, 38.67, 77.33, the row left
    to the largest fraction), counted per source in the data/* metrics; the same seed gives the same examples in the same order,
    and the cache holds exactly what memory does."""
    from scale.data.cache import load_splits

    cfg = tiny_cfg(tmp_path / "out", *mixture, f"data.cache_dir={tmp_path / 'cache'}", "data.num_proc=2")
    a = build_splits(cfg.data, cfg.loss, tokenizer, cfg.data.path, cfg.train.seed)
    b = build_splits(cfg.data, cfg.loss, tokenizer, cfg.data.path, cfg.train.seed)
    assert a.train == b.train and a.eval == b.eval and a.fingerprint == b.fingerprint
    assert Counter(_source_of(tokenizer, e) for e in a.train) == {"tiny_completions": 116, "qa": 39, "chats": 77}
    assert Counter(_source_of(tokenizer, e) for e in a.eval) == {"tiny_completions": 6, "qa": 2, "chats": 4}
    assert {k: v for k, v in a.stats.items() if k.count("/") == 2} == {
        "data/tiny_completions/rows": 160, "data/tiny_completions/train_rows": 116,
        "data/tiny_completions/eval_rows": 6, "data/tiny_completions/dropped_long_rows": 0,
        "data/qa/rows": 60, "data/qa/train_rows": 39, "data/qa/eval_rows": 2, "data/qa/dropped_long_rows": 0,
        "data/chats/rows": 81, "data/chats/train_rows": 77, "data/chats/eval_rows": 4,
        "data/chats/dropped_long_rows": 0}
    assert a.stats["data/train_rows"] == 232 and a.format == "prompt_completion"  # eval/exact_match for both
    cached = load_splits(cfg, tokenizer, cfg.data.path)
    assert list(cached.train) == a.train and list(cached.eval) == a.eval and cached.stats == a.stats
    other = tiny_cfg(tmp_path / "out", *mixture, "train.seed=7")
    assert build_splits(other.data, other.loss, tokenizer, "", 7).train != a.train


def test_all_exhausted_repeats_the_smaller_sources(tmp_path, tokenizer, mixture):
    cfg = tiny_cfg(tmp_path / "out", *mixture, "data.stopping_strategy=all_exhausted")
    s = build_splits(cfg.data, cfg.loss, tokenizer, cfg.data.path, cfg.train.seed)
    # qa (58 train rows at 1/6) sets the size, 346 rows (its 57.67 rounds up): every row at least once, the others
    # repeat
    assert Counter(_source_of(tokenizer, e) for e in s.train) == {"tiny_completions": 173, "qa": 58, "chats": 115}
    assert len({(_source_of(tokenizer, e), e.row) for e in s.train}) == 154 + 58 + 77  # each train row, at least once


def test_a_mixture_change_is_a_new_cache_entry(tmp_path, tokenizer, mixture):
    from scale.data.cache import fingerprint

    cfg = tiny_cfg(tmp_path / "out", *mixture)
    key = fingerprint(cfg, tokenizer, cfg.data.path)[0]
    assert fingerprint(tiny_cfg(tmp_path / "out", *mixture, "data.datasets.1.weight=2"), tokenizer, "")[0] != key
    with open(tmp_path / "qa.csv", "a", encoding="utf-8") as fh:  # one source's content
        fh.write("Q: one more,row\n")
    assert fingerprint(cfg, tokenizer, cfg.data.path)[0] != key


@pytest.mark.parametrize("override, message", [
    ("data.datasets=[{path: a.jsonl, wieght: 2}]",
     "unknown config key data.datasets[0].wieght: did you mean data.datasets[0].weight?"),
    ("data.datasets=[a.jsonl]", "data.datasets[0] must be a mapping (e.g. {path: data/a.jsonl, weight: 1})"),
    ("data.datasets=[{path: a.jsonl}, {weight: 2}]", "data.datasets[1].path is missing"),
    ("data.datasets=[{path: a.jsonl, weight: -1}]", "data.datasets[0].weight=-1.0 must be > 0"),
    ("data.datasets=[{path: a.jsonl, format: chat}]", "data.datasets[0].format='chat' is not one of"),
    ("data.datasets=[{path: x/a.jsonl}, {path: y/a.csv}]", "data.datasets[1] and data.datasets[0] are both named 'a'"),
])
def test_a_bad_entry_is_one_line_naming_the_field(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(TINY_YAML, [override])
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_a_bad_entry_exits_2_through_scale_train(tmp_path, capsys):
    from scale.cli import main

    code = main(["--config", str(TINY_YAML), f"output_dir={tmp_path / 'out'}",
                 "data.datasets=[{path: a.jsonl, weight: 0}]"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "data.datasets[0].weight=0.0 must be > 0" in err[0]
    assert not (tmp_path / "out").exists()


def test_mixing_formats_that_do_not_mix_is_one_line(tmp_path, tokenizer):
    cfg = tiny_cfg(tmp_path / "out", f"data.datasets=[{{path: {COMPLETIONS}}}, {{path: {ROOT / 'configs' / 'data'}"
                                      f"/tiny_reviews.jsonl}}]", "data.eval_size=4")
    with pytest.raises(DataError, match=r"data.datasets\[1\] \(.*tiny_reviews.jsonl\) holds classification rows but "
                                        r"data.datasets\[0\] .* prompt_completion rows"):
        build_splits(cfg.data, cfg.loss, tokenizer, "", cfg.train.seed)


def test_waiting_ranks_poll_the_build_record_and_share_the_builders_error(tmp_path, tokenizer, caplog):
    """A rank that is not the node's main process waits for the entry (no collective), logging its wait, and
    maps what the builder wrote; a build that fails in this run is raised by the waiting rank too."""
    from scale.data.cache import load_splits, wait_for_splits

    cfg = tiny_cfg(tmp_path / "out", f"data.cache_dir={tmp_path / 'cache'}")
    builder = threading.Thread(target=lambda: (time.sleep(1.0), load_splits(cfg, tokenizer, cfg.data.path, "run-a")))
    builder.start()
    with caplog.at_level(logging.INFO, logger="scale.data.cache"):
        waited = wait_for_splits(cfg, tokenizer, cfg.data.path, "run-a", poll_s=0.2)
    builder.join()
    assert len(waited.train) == 128 and type(waited.train).__name__ == "TokenTable"
    assert any("waits for the node's main process" in r.message and "no collective timeout" in r.message
               for r in caplog.records)
    assert len((tmp_path / "cache" / "builds.jsonl").read_text().splitlines()) == 1  # the builder only

    (tmp_path / "bad.jsonl").write_text('{"text": "fine", "label": "positive"}\n{"text": "x", "label": "meh"}\n')
    bad = tiny_cfg(tmp_path / "out", f"data.path={tmp_path / 'bad.jsonl'}", "data.eval_size=1",
                   f"data.cache_dir={tmp_path / 'cache'}")
    with pytest.raises(DataError, match="label 'meh'"):
        load_splits(bad, tokenizer, bad.data.path, "run-b")
    with pytest.raises(DataError, match=r"row 1 \(line 2\) of .*label 'meh' is not in data.labels"):
        wait_for_splits(bad, tokenizer, bad.data.path, "run-b", poll_s=0.05)
    # a config the data contradicts (loss.objective=dpo on classification rows): the same ConfigError on every rank
    dpo = tiny_cfg(tmp_path / "out", "loss.objective=dpo", f"data.cache_dir={tmp_path / 'cache-dpo'}")
    with pytest.raises(ConfigError, match="^loss.objective=dpo with data.format=classification: a preference "):
        load_splits(dpo, tokenizer, dpo.data.path, "run-d")
    with pytest.raises(ConfigError, match="^loss.objective=dpo with data.format=classification: a preference "):
        wait_for_splits(dpo, tokenizer, dpo.data.path, "run-d", poll_s=0.05)
    # another launch's failure marker is not this launch's: its ranks keep waiting for their own builder
    with pytest.raises(TimeoutError):
        wait_for_splits(bad, tokenizer, bad.data.path, "run-c", poll_s=0.05, give_up_s=0.5)


def test_overrides_index_entries_and_paths_resolve_beside_the_config(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.jsonl").write_text("")
    (tmp_path / "job.yaml").write_text("data:\n  datasets:\n    - {path: data/a.jsonl, weight: 2}\n"
                                       "    - {path: org/name, split: train, subset: en}\n")
    cfg = load_config(tmp_path / "job.yaml", ["data.datasets.1.weight=0.5"])
    assert [(d.path, d.weight, d.subset) for d in cfg.data.datasets] == [
        (str(tmp_path / "data" / "a.jsonl"), 2.0, None), ("org/name", 0.5, "en")]
    with pytest.raises(ConfigError, match=r"data.datasets has 2 entries; index it with 0..1"):
        load_config(tmp_path / "job.yaml", ["data.datasets.2.weight=1"])
    from scale.config.load import dump_config

    dump_config(cfg, tmp_path / "config.yaml")  # what a run writes and its resume reads back
    assert load_config(tmp_path / "config.yaml") == cfg


@pytest.mark.slow
def test_the_tiny_job_trains_a_mixture_and_logs_per_source_counts(tmp_path, mixture):
    """scale-train on the three-source mixture: step 0 of metrics.jsonl holds the per-source counts; a rerun
    with the same seed trains the same losses from the cache (one build)."""
    from scale.train import run

    def losses(out: Path) -> tuple[list[float], dict]:
        run(tiny_cfg(out, *mixture, f"data.cache_dir={tmp_path / 'cache'}", "train.max_steps=4",
                     "train.eval_every=0", "log.peak_flops=false"))
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return [r["train/loss"] for r in rows if "train/loss" in r], next(r for r in rows if "data/train_rows" in r)

    first, step0 = losses(tmp_path / "a")
    assert {k: step0[k] for k in ("data/tiny_completions/train_rows", "data/qa/train_rows", "data/chats/train_rows",
                                  "data/train_rows")} == {"data/tiny_completions/train_rows": 116,
                                                          "data/qa/train_rows": 39, "data/chats/train_rows": 77,
                                                          "data/train_rows": 232}
    assert losses(tmp_path / "b")[0] == first and len(first) == 2  # log_every=2
    assert len((tmp_path / "cache" / "builds.jsonl").read_text().splitlines()) == 1
