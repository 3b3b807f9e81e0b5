"""Reward functions for GRPO (scale/objectives/rewards.py): TRL's signature, the built-ins against their definitions
(and TRL's own soft overlong punishment), import paths, a local reward-model directory against its own forward, and
every failure in one line naming the function and the data-file row.
"""

from __future__ import annotations

import math

import pytest
import torch

from scale.objectives.rewards import RewardCall, RewardError, RewardModel, build_rewards, score, total

# ---------------------------------------------------------------------------------------- functions used by path


def constant(completions, **kwargs):
    return [1.0] * len(completions)


def fails_on_beta(completions, name, **kwargs):
    """Raises on the row whose name is 'beta' (a KeyError, as a user's lookup table would)."""
    return [{"alpha": 1.0, "gamma": 0.5}[n] for n in name]


def short_list(completions, **kwargs):
    return [0.0]


def nan_on_second(completions, **kwargs):
    return [0.0, math.nan] + [0.0] * (len(completions) - 2)


def text_value(completions, **kwargs):
    return ["1"] * len(completions)


def maybe(completions, name, **kwargs):
    """None where the function does not apply (TRL's convention)."""
    return [None if n == "beta" else 2.0 for n in name]


NOT_CALLABLE = 3


def _call(n=3):
    names = ["alpha", "beta", "gamma"][:n]
    return RewardCall(prompts=[f"Q{i}:" for i in range(n)], completions=[" yes", " no.", " yes\nmore"][:n],
                      completion_ids=[[5, 2], [6, 7, 2], [5, 9, 9]][:n],
                      columns={"name": names, "answer": ["yes", "yes", "yes"][:n]}, rows=[10, 11, 12][:n])


# ------------------------------------------------------------------------------------------------ built-ins


def test_builtins_by_definition():
    """exact_match against the answer column (whole text, first word, first line, case), regex (full match or
    search) and the weighted total (NaN only where every function returned None)."""
    call = _call()
    rewards = build_rewards([{"fn": "exact_match", "column": "answer"},
                             {"fn": "exact_match", "column": "answer", "part": "first_word", "weight": 2.0},
                             {"fn": "exact_match", "column": "answer", "part": "first_line"},
                             {"fn": "regex", "pattern": r" (yes|no)\.?", "weight": 0.5},
                             {"fn": "regex", "pattern": "more", "search": True}], 16)
    assert [r.name for r in rewards] == ["exact_match", "exact_match_2", "exact_match_3", "regex", "regex_2"]
    got = score(rewards, call)
    assert got.tolist() == [[1.0, 1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0, 0.0], [0.0, 1.0, 1.0, 0.0, 1.0]]
    assert total(got, [r.weight for r in rewards]).tolist() == [4.5, 0.5, 4.0]
    folded = build_rewards([{"fn": "exact_match", "column": "answer", "ignore_case": True},
                            {"fn": "exact_match", "column": "answer", "part": "first_word", "ignore_case": True}], 16)
    assert score(folded, RewardCall(["Q"], [" YES "], [[1]], {"answer": ["yes"]})).tolist() == [[1.0, 1.0]]
    assert score(folded, RewardCall(["Q"], [" Yes. It is"], [[1]], {"answer": ["yes"]})).tolist() == [[0.0, 1.0]]


def test_length_is_trls_soft_overlong_punishment():
    """The ``length`` built-in equals TRL's get_soft_overlong_punishment (DAPO eq. 13) at every length around the
    window, and defaults its maximum to rl.max_completion_length."""
    trl_rewards = pytest.importorskip("trl.rewards")
    ids = [[1] * n for n in range(14)]
    ours = build_rewards([{"fn": "length", "cache": 4}], 10)[0].fn(completion_ids=ids)
    assert ours == trl_rewards.get_soft_overlong_punishment(10, 4)(ids)
    assert ours[6] == 0.0 and ours[8] == -0.5 and ours[13] == -1.0


def test_none_is_left_out_and_all_none_is_nan():
    call = _call()
    rewards = build_rewards(["tests.test_rewards:maybe", "tests.test_rewards:constant"], 8)
    got = score(rewards, call)
    assert math.isnan(got[1, 0]) and got[0, 0] == 2.0
    assert total(got, [1.0, 1.0]).tolist() == [3.0, 1.0, 3.0]
    only = build_rewards(["tests.test_rewards:maybe"], 8)
    assert math.isnan(total(score(only, call), [1.0])[1])


# ------------------------------------------------------------------------------------------------ loading


def test_a_file_path_imports(tmp_path):
    f = tmp_path / "my_rewards.py"
    f.write_text("def half(completions, **kw):\n    return [0.5 for _ in completions]\n")
    r = build_rewards([f"{f}:half"], 8)
    assert r[0].name == "half" and score(r, _call()).tolist() == [[0.5]] * 3


@pytest.mark.parametrize("entry, words", [
    ("no_such_module_xyz:f", "rl.rewards[0]: 'no_such_module_xyz:f' does not import (ModuleNotFoundError"),
    ("tests.test_rewards:missing", "rl.rewards[0]: 'tests.test_rewards:missing' does not import (AttributeError"),
    ("tests.test_rewards:NOT_CALLABLE", "is not callable"),
    ("tests.test_rewards", "is not 'module:function'"),
    ({"fn": "exact_match", "colum": "x"}, "rl.rewards[0]: built-in exact_match: "),
    ({"fn": "exact_match", "part": "last"}, "rl.rewards[0]: exact_match part='last' is not one of"),
    ({"fn": "regex", "pattern": "("}, "rl.rewards[0]: regex pattern '(' does not compile"),
    ({"fn": "tests.test_rewards:constant", "column": "x"}, "is not a built-in"),
    ({"fn": "constant", "model": "x"}, "give exactly one of fn"),
    ({"weight": 1.0}, "give exactly one of fn"),
    ({"fn": "exact_match", "weight": "high"}, "weight='high' is not a finite number"),
    ({"model": "/no/such/dir"}, "model='/no/such/dir' is not a directory"),
])
def test_bad_entries_are_one_line(entry, words):
    with pytest.raises(RewardError) as e:
        build_rewards([entry], 8)
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_no_reward_is_refused():
    with pytest.raises(RewardError, match="rl.rewards is empty"):
        build_rewards([], 8)


# ------------------------------------------------------------------------------------------------ failures


@pytest.mark.parametrize("fn, words", [
    ("fails_on_beta", "rl.rewards[0] (fails_on_beta) raised KeyError: 'beta' on the completion of data-file row 11"),
    ("short_list", "rl.rewards[0] (short_list) returned 1 values for 3 completions"),
    ("nan_on_second", "rl.rewards[0] (nan_on_second) returned nan for the completion of data-file row 11"),
    ("text_value", "rl.rewards[0] (text_value) returned str '1' for the completion of data-file row 10"),
])
def test_a_failing_function_names_itself_and_the_row(fn, words):
    rewards = build_rewards([f"tests.test_rewards:{fn}"], 8)
    with pytest.raises(RewardError) as e:
        score(rewards, _call())
    assert str(e.value).startswith(words) and "\n" not in str(e.value), str(e.value)


def test_a_builtin_on_a_missing_column_names_it():
    rewards = build_rewards([{"fn": "exact_match", "column": "label"}], 8)
    with pytest.raises(RewardError, match=r"rl.rewards\[0\] \(exact_match\): exact_match: the rows have no column "
                                          r"'label' \(columns: \['answer', 'name'\]\)"):
        score(rewards, _call())


# ------------------------------------------------------------------------------------------------ reward model


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory, tokenizer):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=4, num_labels=1, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(cfg)
    path = tmp_path_factory.mktemp("rm")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, model.eval()


def test_reward_model_scores_prompt_plus_completion(reward_model_dir, tokenizer):
    """A sequence-classification directory as a reward: its first logit on ``prompt + completion`` (batched, right
    padded, no special tokens added), as the model's own forward of each text alone gives it, within the float32
    round-off of two summation orders (tests/bounds.fp32_paths_rel at hidden size 32)."""
    from tests.bounds import fp32_paths_rel

    path, model = reward_model_dir
    r = build_rewards([{"model": str(path), "weight": 0.5}], 8)
    assert isinstance(r[0].fn, RewardModel) and r[0].weight == 0.5 and r[0].name == path.name
    call = _call()
    got = score(r, call)[:, 0]
    for i, (p, c) in enumerate(zip(call.prompts, call.completions)):
        ids = tokenizer(p + c, add_special_tokens=False, return_tensors="pt")
        with torch.no_grad():
            want = float(model(**ids).logits[0, 0])
        assert abs(float(got[i]) - want) <= fp32_paths_rel(32, 32) * max(1.0, abs(want))
