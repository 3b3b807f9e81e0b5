"""Preference pairs and the DPO family: the ``preference`` format (TRL's explicit- and implicit-prompt conventions,
text and messages, its errors), each objective against the formula computed by hand in float64, the reference
without a second copy (adapter disabled, a starting adapter frozen) against separately built models, precomputed
references against in-step ones, padding-free and packed pairs against padded ones, one TRL ``DPOTrainer`` run step
by step, and ``data.pair_conventions: trl`` on real text and chat pairs against TRL 1.16's DPO, CPO (SimPO) and ORPO
trainers' own tokens and ``evaluate()``.
"""

from __future__ import annotations

import contextlib
import json
import math

import pytest
import torch

from scale.config.schema import DataConfig, LoraConfig, LossConfig, ModelConfig
from scale.data import Collator, DataError, PaddingFreeCollator, load_rows, removed_lines, tokenize_rows
from scale.data.tasks.preference import PairCollator, PairedExamples
from scale.modeling.build import add_lora, build_model, load_adapter, load_base
from scale.objectives.pair_losses import METRICS, dpo_loss, orpo_loss, simpo_loss
from scale.objectives.preference import (PreferenceObjective, add_reference_adapter, orpo_trl_terms,
                                         reference_forward, reference_logps, reference_mode, tail_logps)
from tests.conftest import ROOT

CHATML = ROOT / "configs" / "chat" / "chatml.jinja"
EPS64 = torch.finfo(torch.float64).eps


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def _enc(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def _user(text):
    return {"role": "user", "content": text}


def _bot(text):
    return {"role": "assistant", "content": text}


SYSTEM = {"role": "system", "content": "Be brief."}
TEXT_PAIRS = [{"prompt": "Q: what colour is the sky?", "chosen": " Blue.", "rejected": " Green, mostly green."},
              {"prompt": "Q: is fire hot?", "chosen": " Yes.", "rejected": " No, it is cold."},
              {"prompt": "Q: two plus two?", "chosen": " Four.", "rejected": " Five."},
              {"prompt": "Q: name a fruit.", "chosen": " An apple.", "rejected": " A chair."}]


def _pairs(tmp_path, tokenizer, rows, **data):
    data = {"chat_template": str(CHATML), "max_length": 64, **data}
    cfg = DataConfig(**data)
    return tokenize_rows(load_rows(cfg, _write(tmp_path / "p.jsonl", rows)), tokenizer, cfg, LossConfig())


# ----------------------------------------------------------------------------------------------- the format


def test_text_pairs_explicit_and_implicit_prompt(tmp_path, tokenizer):
    """Explicit prompt: the prompt's tokens then each completion's + EOS (as prompt_completion encodes a row);
    implicit: the prompt is the common start (a space before the first difference goes to the completions)."""
    eos = tokenizer.eos_token_id
    implicit = {"chosen": "Q: sun? It is hot.", "rejected": "Q: sun? It is cold."}
    ex = _pairs(tmp_path, tokenizer, [TEXT_PAIRS[0], implicit])
    assert [e.row for e in ex] == [0, 0, 1, 1]
    prompt = _enc(tokenizer, TEXT_PAIRS[0]["prompt"])
    for e, side in zip(ex[:2], ("chosen", "rejected")):
        tail = _enc(tokenizer, TEXT_PAIRS[0][side]) + [eos]
        assert e.input_ids == prompt + tail and e.tail_len == len(tail)
    prompt = _enc(tokenizer, "Q: sun? It is")
    assert ex[2].input_ids == prompt + _enc(tokenizer, " hot.") + [eos]
    assert ex[3].input_ids == prompt + _enc(tokenizer, " cold.") + [eos]


def test_message_pairs_explicit_implicit_and_tools(tmp_path, tokenizer):
    """Conversational pairs render as chats whose completion's assistant turn is trained through its end-of-turn;
    the explicit and implicit conventions give the same tokens; tools reach the template."""
    prompt = [{"role": "system", "content": "Be brief."}, _user("Hi")]
    explicit = {"prompt": prompt, "chosen": [_bot("Hello.")], "rejected": [_bot("Go away.")]}
    implicit = {"chosen": prompt + [_bot("Hello.")], "rejected": prompt + [_bot("Go away.")]}
    ex = _pairs(tmp_path, tokenizer, [explicit, implicit])
    assert [e.input_ids for e in ex[:2]] == [e.input_ids for e in ex[2:]]
    head = _enc(tokenizer, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                           "<|im_start|>assistant\n")
    for e, answer in zip(ex[:2], ("Hello.", "Go away.")):
        tail = _enc(tokenizer, answer + "<|im_end|>")
        assert e.input_ids[:len(head)] == head and e.input_ids[-e.tail_len:] == tail
        assert e.input_ids == head + tail
    tool = {"type": "function", "function": {"name": "clock", "description": "time", "parameters": {}}}
    with_tools = _pairs(tmp_path, tokenizer, [{**explicit, "tools": [tool]}], chat_template="chatml_tools",
                        max_length=256)
    assert '"clock"' in tokenizer.decode(with_tools[0].input_ids) and with_tools[0].tail_len == ex[0].tail_len


@pytest.mark.parametrize("row, words", [
    ({"prompt": "Q?", "chosen": " A."}, "the rejected side ('rejected') is missing or empty"),
    ({"prompt": "Q?", "chosen": "  ", "rejected": " B."}, "the chosen side ('chosen') is missing or empty"),
    ({"prompt": "Q?", "chosen": " A.", "rejected": " A."}, "chosen and rejected are identical"),
    ({"prompt": "Q?", "chosen": " A.", "rejected": [_bot("B.")]}, "both sides are text or both are lists"),
    ({"chosen": [SYSTEM, _user("Hi"), _bot("A.")], "rejected": [SYSTEM, _user("Hello"), _bot("B.")]},
     "the prompts of chosen and rejected differ"),
    ({"chosen": [_user("Hi"), _bot("A.")], "rejected": [_user("Hello"), _bot("B.")]},
     "the conversations have no prompt"),
    ({"chosen": "Same start A.", "rejected": "Other start B."}, "the pair has no prompt"),
])
def test_bad_pairs_name_the_row(tmp_path, row, words):
    good = TEXT_PAIRS[1]
    with pytest.raises(DataError) as e:
        load_rows(DataConfig(), _write(tmp_path / "p.jsonl", [good, row]))
    assert str(e.value).startswith("row 1 (line 2) of ") and words in str(e.value) and "\n" not in str(e.value)


def test_long_pairs_share_their_cut_prompt_and_are_counted(tmp_path, tokenizer):
    """keep_end cuts the prompt so the longer side fits, the same prompt for both sides, counted once; a
    completion that cannot fit is an error naming the row, or dropped (once) with drop_long_completions."""
    from scale.data.tasks.base import Builder
    from scale.data.tasks.preference import Preference

    long_prompt = "Q: " + " ".join(f"w{k}" for k in range(40)) + "?"
    row = {"row": 7, "prompt": long_prompt, "chosen": " Yes.", "rejected": " No, not at all, never."}
    task, cfg = Preference(), DataConfig(max_length=24)
    task.prepare(tokenizer, cfg, LossConfig())
    b = Builder(tokenizer, cfg)
    chosen, rejected = task.encode(row, b, LossConfig())
    assert len(rejected.input_ids) == 24 and b.notes["rows_truncated"] == 1
    assert chosen.input_ids[:-chosen.tail_len] == rejected.input_ids[:-rejected.tail_len]
    row["rejected"] = " " + " ".join(["no"] * 30)
    n = len(_enc(tokenizer, row["rejected"])) + 1
    with pytest.raises(DataError) as e:
        task.encode(row, b, LossConfig())
    assert str(e.value) == (f"row 7: the rejected answer (its completion + EOS) is {n} tokens; with 1 token(s) before "
                            f"it the pair needs {n + 1} > data.max_length=24. Raise data.max_length, or set "
                            f"data.drop_long_completions=true to drop such pairs (counted in the log).")
    b = Builder(tokenizer, DataConfig(max_length=24, drop_long_completions=True))
    assert task.encode(row, b, LossConfig()) is None and b.dropped == [7]
    b = Builder(tokenizer, DataConfig(max_length=24, truncation="drop"))
    assert task.encode({**row, "rejected": " No."}, b, LossConfig()) is None and b.dropped == [7]


LONG_USER = "Tell me everything: " + " ".join(f"w{k}" for k in range(40))
TOOL = {"type": "function", "function": {"name": "clock", "description": "time", "parameters": {}}}
CHAT_SHAPES = {  # conversational pairs whose rejected side is the longer: explicit / implicit prompt, history, tools
    "explicit": ({"prompt": [SYSTEM, _user(LONG_USER)]}, "chatml"),
    "implicit": ({}, "chatml"),
    "history": ({"prompt": [SYSTEM, _user("Hi there, " + LONG_USER), _bot("Hello, how can I help?"),
                            _user("Say yes or no.")]}, "chatml"),
    "tools": ({"prompt": [_user(LONG_USER)], "tools": [TOOL]}, "chatml_tools"),
}


def _chat_pair(shape):
    extra, template = CHAT_SHAPES[shape]
    chosen, rejected = [_bot("Yes.")], [_bot("No, " + " ".join(["never"] * 12) + ".")]
    if shape == "implicit":  # no prompt column: the common first messages are the prompt
        return {"chosen": [SYSTEM, _user(LONG_USER)] + chosen, "rejected": [SYSTEM, _user(LONG_USER)] + rejected}, \
            template
    return {**extra, "chosen": chosen, "rejected": rejected}, template


@pytest.mark.parametrize("shape", list(CHAT_SHAPES))
def test_long_chat_pairs_share_their_cut_prompt(tmp_path, tokenizer, shape):
    """A conversational pair over data.max_length keeps one prompt on both sides, whatever its shape (explicit or
    implicit prompt, earlier exchanges, tools): the cut that lets the longer side fit, applied to both (the longer
    side is encoded exactly as a chat of its own would be), so chosen and rejected are scored after the same prompt
    tokens; counted once (rows_truncated, and what went)."""
    from scale.data.tasks.base import Builder
    from scale.data.tasks.messages import Messages

    row, template = _chat_pair(shape)
    whole = _pairs(tmp_path, tokenizer, [row], chat_template=template, max_length=1024)
    lengths = [len(e.input_ids) for e in whole]
    assert lengths[0] < lengths[1]
    limit = lengths[0]  # the chosen side fits whole, the rejected side does not: both must lose the same prompt
    rows = load_rows(DataConfig(chat_template=template, max_length=limit), _write(tmp_path / "p.jsonl", [row]))
    task, cfg = rows.task, DataConfig(chat_template=template, max_length=limit)
    task.prepare(tokenizer, cfg, LossConfig())
    b = Builder(tokenizer, cfg)
    chosen, rejected = task.encode(rows[0], b, LossConfig())
    prompt = chosen.input_ids[:-chosen.tail_len]
    assert prompt == rejected.input_ids[:-rejected.tail_len]
    assert chosen.input_ids[-chosen.tail_len:] == whole[0].input_ids[-whole[0].tail_len:]
    assert rejected.input_ids[-rejected.tail_len:] == whole[1].input_ids[-whole[1].tail_len:]
    assert len(rejected.input_ids) <= limit and len(prompt) < len(whole[0].input_ids) - whole[0].tail_len
    # the longer side is cut as the chat of its own messages is cut
    chat = Messages()
    chat.prepare(tokenizer, cfg, LossConfig())
    alone = chat.encode({"row": 0, "messages": rows[0]["prompt"] + rows[0]["rejected"],
                         "completion_from": len(rows[0]["prompt"]), **({"tools": [TOOL]} if shape == "tools" else {})},
                        Builder(tokenizer, cfg), LossConfig())
    assert alone.input_ids == rejected.input_ids and alone.tail_len == rejected.tail_len
    cut_text = {"explicit": 1, "implicit": 1, "history": 0, "tools": 1}[shape]  # history: its first exchange goes
    assert {k: v for k, v in b.notes.items() if v} == {"rows_truncated": 1,
                                                       **({"user_text_cut": 1} if cut_text else {})}
    stats = {f"data/train_{k}": v for k, v in b.notes.items()}
    assert removed_lines(stats, cfg, "pairs") == [
        f"data.max_length={limit} cut the start of 1 train and 0 eval pairs (data.truncation=keep_end, the same prompt "
        f"cut on both sides of a pair)" + (", removing 1 user text start(s)" if cut_text else "") + "; a larger "
        "data.max_length keeps them, data.truncation=drop drops such pairs"]


def test_show_rows_shows_both_sides(tmp_path, capsys):
    from scale.cli import show_rows
    from tests.conftest import tiny_cfg

    path = _write(tmp_path / "p.jsonl", TEXT_PAIRS * 3)
    cfg = tiny_cfg(tmp_path / "out", f"data.path={path}", "data.eval_size=2", "data.deduplicate=false")
    show_rows(cfg, 2)
    out = capsys.readouterr().out
    assert out.startswith("format=preference")
    heads = [line for line in out.splitlines() if line.startswith("--- data-file row")]
    assert [h.split(":")[0].split(" (")[1] for h in heads] == ["chosen)", "rejected)"] * 2
    assert heads[0].split(" (")[0] == heads[1].split(" (")[0]


@pytest.mark.parametrize("objective, pairs, message", [
    ("dpo", False, ("loss.objective=dpo with data.format=classification: a preference objective needs pairs "
                    "(data.format=preference: prompt/chosen/rejected)")),
    ("sft", True, ("loss.objective=sft with data.format=preference: preference pairs train under "
                   "loss.objective=dpo, simpo or orpo")),
])
def test_objective_that_does_not_fit_the_format_is_refused_before_tokenizing(tmp_path, monkeypatch, objective, pairs,
                                                                               message):
    """A run whose ``loss.objective`` does not train its data's format stops in one line as soon as the format is
    known: no row is tokenized and no token cache entry is written (on a large file the build takes minutes). A
    later start whose splits come from an existing cache entry is refused by the same check, before the model."""
    from scale.config.validation import ConfigError
    from scale.data import tokenize
    from scale.train import run
    from tests.conftest import TINY_DATA, tiny_cfg

    data = _write(tmp_path / "p.jsonl", TEXT_PAIRS * 3) if pairs else TINY_DATA
    cache = tmp_path / "cache"
    calls = []
    real = tokenize._tokenize
    monkeypatch.setattr(tokenize, "_tokenize", lambda *a, **k: calls.append(1) or real(*a, **k))
    cfg = tiny_cfg(tmp_path / "out", f"data.path={data}", f"loss.objective={objective}", f"data.cache_dir={cache}",
                   "data.eval_size=2", "data.deduplicate=false", "train.max_steps=1")
    with pytest.raises(ConfigError) as e:
        run(cfg)
    assert str(e.value) == message
    assert calls == [] and not [f for f in cache.rglob("*") if f.is_dir() or f.suffix == ".arrow"]
    # a cache entry written under the objective that fits, then a start with the other one: refused the same way
    other = "dpo" if pairs else "sft"
    run(tiny_cfg(tmp_path / "fits", f"data.path={data}", f"loss.objective={other}", f"data.cache_dir={cache}",
                 "data.eval_size=2", "data.deduplicate=false", "train.max_steps=1", "train.eval_every=0",
                 "eval.generate_samples=0", "log.peak_flops=false"))
    entries = sorted(f for f in cache.iterdir() if f.is_dir())
    assert len(entries) == 1
    monkeypatch.setattr(tokenize, "build_splits", None)  # a hit builds nothing
    with pytest.raises(ConfigError) as e:
        run(cfg)
    assert str(e.value) == message and sorted(f for f in cache.iterdir() if f.is_dir()) == entries


def test_pair_conventions_key_the_token_cache_and_need_pairs(tmp_path, tokenizer):
    """data.pair_conventions=trl makes the objective's TRL trainer's tokens (DPOTrainer's differ from CPO/ORPO's),
    so the token cache keys on loss.objective under it (a cached DPO split is never read by a SimPO run); under
    scale the three objectives share one entry. The run's objective reads the key; an objective without pairs
    refuses it in one line."""
    from scale.config.load import load_config
    from scale.config.validation import ConfigError
    from scale.data.cache import fingerprint

    path = _write(tmp_path / "p.jsonl", TEXT_PAIRS)

    def key(objective, conventions):
        cfg = load_config(None, [f"data.path={path}", "data.format=preference", f"loss.objective={objective}",
                                 f"data.pair_conventions={conventions}"])
        return fingerprint(cfg, tokenizer, path)[0]

    assert key("dpo", "scale") == key("simpo", "scale") == key("orpo", "scale")
    run = load_config(None, [f"data.path={path}", "loss.objective=orpo", "data.pair_conventions=trl"])
    assert PreferenceObjective.from_config(run).conventions == "trl"  # the loop's ORPO takes TRL's NLL term
    assert len({key("dpo", "trl"), key("simpo", "trl"), key("orpo", "trl"), key("dpo", "scale")}) == 4
    with pytest.raises(ConfigError, match=r"^data.pair_conventions=trl sets the tokens of preference pairs .*"
                                          r"loss.objective=sft trains none: remove it$"):
        load_config(None, ["data.pair_conventions=trl"])
    with pytest.raises(ConfigError, match="data.pair_conventions"):
        load_config(None, ["loss.objective=dpo", "data.format=preference", "data.pair_conventions=hf"])


def test_pair_collator_keeps_sides_adjacent(tmp_path, tokenizer):
    ex = _pairs(tmp_path, tokenizer, TEXT_PAIRS)
    pairs = PairedExamples(ex)
    batch = PairCollator(Collator(tokenizer.pad_token_id))([pairs[2], pairs[0]])
    assert batch["pair_row"].tolist() == [2, 0] and batch["row"].tolist() == [2, 2, 0, 0]
    assert batch["input_ids"].shape[0] == 4
    with pytest.raises(ValueError, match="different rows"):
        PairCollator(Collator(0))([[ex[0], ex[3]]])


# ------------------------------------------------------------------------------------- objectives by hand

# Policy and reference summed logps and tail lengths of two pairs (float64), and the objectives computed from
# the formulas with Python floats (math): each term a handful of float64 operations on numbers of magnitude
# <= 10, so |ours - hand| <= 64 eps64 * (1 + |value|) bounds round-off with a wide margin.
LC, LR, RC, RR = [-3.0, -7.5], [-5.0, -6.0], [-4.0, -7.0], [-4.5, -6.5]
NC, NR = [2.0, 5.0], [4.0, 3.0]


def _t(x):
    return torch.tensor(x, dtype=torch.float64)


def _close(got, want):
    for g, w in zip(got.tolist(), want):
        assert abs(g - w) <= 64 * EPS64 * (1 + abs(w)), (g, w)


def _logsig(z):
    return -math.log1p(math.exp(-z)) if z > 0 else z - math.log1p(math.exp(z))


def test_dpo_sigmoid_ipo_hinge_by_hand():
    beta, eps = 0.1, 0.2
    h = [(lc - rc) - (lr - rr) for lc, lr, rc, rr in zip(LC, LR, RC, RR)]           # [1.5, -1.0]
    t = dpo_loss(_t(LC), _t(LR), _t(RC), _t(RR), _t(NC), _t(NR), beta, "sigmoid", eps)
    _close(t.losses, [-(1 - eps) * _logsig(beta * x) - eps * _logsig(-beta * x) for x in h])
    _close(t.chosen_rewards, [beta * (lc - rc) for lc, rc in zip(LC, RC)])
    _close(t.rejected_rewards, [beta * (lr - rr) for lr, rr in zip(LR, RR)])
    _close(dpo_loss(_t(LC), _t(LR), _t(RC), _t(RR), _t(NC), _t(NR), beta, "hinge").losses,
           [max(0.0, 1 - beta * x) for x in h])
    ipo = [((lc - rc) / nc - (lr - rr) / nr - 1 / (2 * beta)) ** 2
           for lc, lr, rc, rr, nc, nr in zip(LC, LR, RC, RR, NC, NR)]
    _close(dpo_loss(_t(LC), _t(LR), _t(RC), _t(RR), _t(NC), _t(NR), beta, "ipo").losses, ipo)
    m = t.metrics(torch.ones(2, dtype=torch.float64))
    assert m["rewards/accuracies"].item() == 1.0  # pair 0: 0.1 > -0.05; pair 1: -0.05 > 0.05 is false
    _close(m["rewards/margins"][None], [beta * sum(h)])
    _close(m["logps/chosen"][None], [sum(LC)])


def test_simpo_and_orpo_by_hand():
    beta, gamma, eps = 2.0, 0.5, 0.1
    avg_c, avg_r = [lc / n for lc, n in zip(LC, NC)], [lr / n for lr, n in zip(LR, NR)]
    z = [beta * (c - r) - gamma for c, r in zip(avg_c, avg_r)]
    t = simpo_loss(_t(LC), _t(LR), _t(NC), _t(NR), beta, gamma, eps)
    _close(t.losses, [-(1 - eps) * _logsig(x) - eps * _logsig(-x) for x in z])
    _close(t.chosen_logps, avg_c)
    lam = 0.25
    odds = [(c - math.log(1 - math.exp(c))) - (r - math.log(1 - math.exp(r))) for c, r in zip(avg_c, avg_r)]
    o = orpo_loss(_t(LC), _t(LR), _t(NC), _t(NR), lam)
    _close(o.losses, [-c - lam * _logsig(x) for c, x in zip(avg_c, odds)])
    _close(o.rejected_rewards, [lam * r for r in avg_r])


# ----------------------------------------------------------------------- the model: reference and layouts


def _model(tokenizer, seed=3, adapter_seed=None, dtype=torch.float64):
    """The tiny Llama with a LoRA adapter whose B matrices are random (``adapter_seed``), so the adapter changes
    the outputs (a fresh adapter's B = 0 would make every reference trivially equal to the policy)."""
    base = load_base(ModelConfig(name_or_path="tiny-llama"), vocab_size=len(tokenizer), seed=seed).to(dtype)
    torch.manual_seed(seed)  # peft draws the A matrices from the global generator
    model = add_lora(base, ModelConfig(name_or_path="tiny-llama", gradient_checkpointing=False),
                     LoraConfig(r=4, dropout=0.0))
    if adapter_seed is not None:
        g = torch.Generator().manual_seed(adapter_seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5)
    return model


@pytest.fixture(scope="module")
def pair_examples(tmp_path_factory, tokenizer):
    return _pairs(tmp_path_factory.mktemp("pairs"), tokenizer, TEXT_PAIRS)


def test_disabled_adapter_reference_equals_the_base_model(tokenizer, pair_examples):
    """The in-step reference (adapter disabled, no_grad) equals a separately built frozen base: bit for bit (a
    disabled LoRA layer runs its base layer alone: the same operations)."""
    policy = _model(tokenizer, adapter_seed=1)
    frozen = load_base(ModelConfig(name_or_path="tiny-llama"), vocab_size=len(tokenizer), seed=3).double().eval()
    batch = PairCollator(Collator(tokenizer.pad_token_id))(list(PairedExamples(pair_examples)))
    ref = reference_forward(policy, batch)
    want, _ = tail_logps(frozen, batch)
    assert torch.equal(ref, want)
    assert not torch.allclose(tail_logps(policy, batch)[0], want)  # the adapter does change the policy


def test_starting_adapter_is_the_frozen_reference(tmp_path, tokenizer, pair_examples):
    """From an SFT run's adapter: after an optimizer step of the policy, the reference is still the starting
    adapter: equal to a model loaded separately from that adapter's files."""
    from peft import PeftModel

    sft = _model(tokenizer, adapter_seed=2)
    sft.save_pretrained(tmp_path / "adapter")
    base = load_base(ModelConfig(name_or_path="tiny-llama"), vocab_size=len(tokenizer), seed=3).double()
    frozen = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    policy = _model(tokenizer)
    load_adapter(policy, str(tmp_path / "adapter"), LoraConfig(r=4, dropout=0.0))  # model.adapter
    with pytest.raises(ValueError, match=r"saved with lora.r=4, this run has lora.r=8; set lora.r=4$"):
        load_adapter(_model(tokenizer), str(tmp_path / "adapter"), LoraConfig(r=8, dropout=0.0))
    add_reference_adapter(policy)
    assert not any(p.requires_grad for n, p in policy.named_parameters() if ".reference." in n)
    batch = PairCollator(Collator(tokenizer.pad_token_id))(list(PairedExamples(pair_examples)))
    objective = PreferenceObjective(name="dpo", beta=0.1)
    opt = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=1.0)
    objective.loss_step(policy, batch, objective.weights(batch)).backward()
    opt.step()
    want, _ = tail_logps(frozen, batch)
    assert torch.equal(reference_forward(policy, batch), want)
    assert not torch.allclose(tail_logps(policy, batch)[0], want)  # the policy moved
    assert all(p.requires_grad for n, p in policy.named_parameters() if ".default." in n)


def test_precomputed_reference_of_a_starting_adapter_is_that_adapter(tmp_path, tokenizer, pair_examples):
    """With ``model.adapter`` the pass before training scores the pairs with the starting adapter (bit-equal to the
    in-step frozen copy, :func:`add_reference_adapter`), not with the adapter disabled (the base model)."""
    sft = _model(tokenizer, adapter_seed=5)
    sft.save_pretrained(tmp_path / "adapter")
    policy, in_step = _model(tokenizer), _model(tokenizer)
    for m in (policy, in_step):
        load_adapter(m, str(tmp_path / "adapter"), LoraConfig(r=4, dropout=0.0))
    add_reference_adapter(in_step)
    batch = PairCollator(Collator(tokenizer.pad_token_id))(list(PairedExamples(pair_examples)))
    got = reference_logps(policy, [batch], starting_adapter=True)
    assert torch.equal(got, reference_forward(in_step, batch).double())
    assert not torch.equal(got, reference_logps(policy, [batch]))  # the base model scores them differently


def test_precomputed_reference_equals_in_step(tokenizer, pair_examples):
    """One pass before training stores each pair's reference logps; the step with them equals the step that runs
    the reference itself (the same batches: the same operations, so bit-equal), loss and gradients."""
    collate = PairCollator(Collator(tokenizer.pad_token_id))
    pairs = PairedExamples(pair_examples)
    order = [[0, 3], [1, 2]]
    policy = _model(tokenizer, adapter_seed=4)
    refs = torch.zeros(len(pair_examples), dtype=torch.float64)
    got = reference_logps(policy, [collate([pairs[p] for p in mb]) for mb in order])
    for k, p in enumerate(q for mb in order for q in mb):
        refs[2 * p:2 * p + 2] = got[2 * k:2 * k + 2]
    stored = PairedExamples(pair_examples, ref_logps=refs)
    on_the_fly, precomputed = PreferenceObjective("dpo"), PreferenceObjective("dpo", reference="precomputed")
    for mb in order:
        a_batch, b_batch = collate([pairs[p] for p in mb]), collate([stored[p] for p in mb])
        assert "ref_logps" in b_batch and "ref_logps" not in a_batch
        a = on_the_fly.loss_step(policy, a_batch, on_the_fly.weights(a_batch))
        ga = torch.autograd.grad(a, [p for p in policy.parameters() if p.requires_grad])
        b = precomputed.loss_step(policy, b_batch, precomputed.weights(b_batch))
        gb = torch.autograd.grad(b, [p for p in policy.parameters() if p.requires_grad])
        assert torch.equal(a, b) and all(torch.equal(x, y) for x, y in zip(ga, gb))


@pytest.mark.parametrize("name", ["dpo", "simpo", "orpo"])
def test_padding_free_pairs_equal_padded(tokenizer, pair_examples, name):
    """A padding-free micro-batch of pairs (one packed row, position ids restarting per side) gives the padded
    batch's loss. float64 model: the two layouts reduce the same numbers in other orders (attention over padding
    vs none); each logp is a sum of <= 16 log-softmaxes over V ~ 49k of magnitude <= 20, so the round-off is below
    1e3 * eps64 * 20 * 16 ~ 1e-9 (bound 1e-9 on the loss)."""
    policy = _model(tokenizer, adapter_seed=5)
    pairs = list(PairedExamples(pair_examples))
    objective = PreferenceObjective(name, beta=0.5)
    padded = PairCollator(Collator(tokenizer.pad_token_id))(pairs)
    free = PairCollator(PaddingFreeCollator())(pairs)
    a = objective.loss_step(policy, padded, objective.weights(padded))
    b = objective.loss_step(policy, free, objective.weights(free))
    assert abs(a.item() - b.item()) <= 1e-9
    assert a.item() > 0


@pytest.mark.parametrize("name", ["dpo", "simpo"])
def test_packed_pairs_equal_padded(tokenizer, pair_examples, name):
    """data.packing for pairs: whole pairs packed best-fit-decreasing into bins of 2 x data.max_length tokens
    (every pair fits; no pair cut), a micro-batch of bins one padding-free row whose sides keep their own segments.
    The packed micro-batches together give the padded batch's loss and gradients (float64 tiny model).

    Bound: each side's logp is a sum of its tail tokens' log-softmaxes, all <= 0, so ``sum_t |term_t| = |logp|``; the
    two layouts compute it within ``r |logp|``, ``r = fp32_paths_rel(V, H, eps64)`` (tests/bounds.py: 2 x (4 eps
    sqrt(V) + 4 eps H), the vocabulary's log-sum-exp and the hidden-width dot products). |dloss/dlogp| <= beta for
    DPO's sigmoid and SimPO (beta / |y|, |y| >= 1), so the loss is within ``beta r sum|logp|`` over the policy's and
    (DPO) the reference's sides, and each gradient tensor within ``beta r sum_s max|d logp_s / d theta|``."""
    from scale.data.collate import PaddingFreeCollator
    from scale.data.order import PackedRows, pack_bfd
    from scale.data.tasks.preference import PackedPairCollator, pair_capacity
    from tests.bounds import fp32_paths_rel

    beta = 0.5
    policy = _model(tokenizer, adapter_seed=8)
    params = [p for p in policy.parameters() if p.requires_grad]
    pairs = PairedExamples(pair_examples)
    sizes = [len(c.input_ids) + len(r.input_ids) for c, r in pairs]
    small = sorted(sizes)
    capacity = pair_capacity(max((small[0] + small[1] + 1) // 2, (small[-1] + 1) // 2))  # the 2 shortest share a bin
    bins = pack_bfd(sizes, capacity)
    assert 1 < len(bins) < len(pairs) and sorted(p for b in bins for p in b) == list(range(len(pairs)))
    packed = PackedRows(pairs, bins)
    collate = PackedPairCollator(PaddingFreeCollator())
    objective = PreferenceObjective(name, beta=beta)

    padded = PairCollator(Collator(tokenizer.pad_token_id))(list(pairs))
    a = objective.loss_step(policy, padded, objective.weights(padded))
    ga = torch.autograd.grad(a, params)
    b, gb, rows = 0.0, [torch.zeros_like(p) for p in params], []
    for mb in ([packed[0], packed[1]], [packed[k] for k in range(2, len(packed))]):  # two micro-batches of bins
        batch = collate(mb)
        assert batch["input_ids"].shape[0] == 1 and batch["seq_lens"].numel() == 2 * batch["pair_row"].numel()
        assert batch["row"][0::2].tolist() == batch["row"][1::2].tolist() == batch["pair_row"].tolist()
        rows += batch["pair_row"].tolist()
        loss = objective.loss_step(policy, batch, objective.weights(batch))
        b = b + loss
        gb = [x + y for x, y in zip(gb, torch.autograd.grad(loss, params))]
    assert sorted(rows) == sorted(padded["pair_row"].tolist())  # each pair once

    r = fp32_paths_rel(len(tokenizer), policy.config.hidden_size, EPS64)
    logps, _ = tail_logps(policy, padded)
    sides = logps.abs().sum() + (reference_forward(policy, padded).abs().sum() if name == "dpo" else 0)
    assert abs(a.item() - b.item()) <= beta * r * sides.item(), (a.item(), b.item())
    side_grads = [torch.autograd.grad(logps[s], params, retain_graph=True) for s in range(logps.numel())]
    for k, (x, y) in enumerate(zip(ga, gb)):
        bound = beta * r * sum(g[k].abs().max() for g in side_grads)
        assert (x - y).abs().max() <= bound, (k, (x - y).abs().max().item(), bound.item())
    assert a.item() > 0 and max(g.abs().max() for g in ga) > 0


def test_precomputed_references_reach_packed_bins(tokenizer, pair_examples):
    """loss.reference=precomputed with data.packing: the reference logps set on the split's pairs
    (scale.training.parts.preference.pairs_of_loader finds them under the bins) travel with each pair into the packed
    micro-batch, in its row order (2p chosen, 2p + 1 rejected of the pair in pair_row[p])."""
    from scale.data.collate import PaddingFreeCollator
    from scale.data.order import PackedRows
    from scale.data.tasks.preference import PackedPairCollator
    from scale.training.parts.preference import pairs_of_loader

    pairs = PairedExamples(pair_examples)
    packed = PackedRows(pairs, [[2, 0], [3], [1]])
    assert pairs_of_loader(packed) is pairs
    pairs_of_loader(packed).ref_logps = -torch.arange(len(pair_examples), dtype=torch.float64)  # example k: -k
    batch = PackedPairCollator(PaddingFreeCollator())([packed[0], packed[2]])
    rows = batch["pair_row"].tolist()
    assert rows == [pairs[p][0].row for p in (2, 0, 1)]
    assert batch["ref_logps"].tolist() == [-float(2 * p + s) for p in (2, 0, 1) for s in (0, 1)]


def test_side_logps_equal_a_full_logits_reference(tokenizer, pair_examples):
    """Our tail logps (only the tail's logits asked for) equal TRL's way: full logits, log-softmax, the completion
    tokens summed (float64 model; the same log-softmax values, summed in the same order: <= 16 eps64 x |sum|)."""
    policy = _model(tokenizer, adapter_seed=6)
    batch = PairCollator(Collator(tokenizer.pad_token_id, padding_side="right"))(list(PairedExamples(pair_examples)))
    ours, lengths = tail_logps(policy, batch, padding_side="right")
    with torch.no_grad():
        logits = policy(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    for b, e in enumerate(pair_examples):
        n = len(e.input_ids)
        want = logp[b, n - 1 - e.tail_len:n - 1].sum()
        assert lengths[b].item() == e.tail_len
        assert abs(ours[b].item() - want.item()) <= 16 * EPS64 * abs(want.item()) + 1e-12


def test_orpo_trl_nll_pools_every_chosen_token(tokenizer, pair_examples):
    """ORPO under data.pair_conventions=trl: the NLL term is one mean over every token but the first of the
    micro-batch's chosen rows (TRL's nn.CrossEntropyLoss over the chosen half), the same for each pair, computed
    here from full logits; the odds-ratio term reads the answers' logps as tail_logps does. Equal (float64 model,
    64 eps64) in left- and right-padded and padding-free batches; the objective picks it under conventions=trl."""
    policy = _model(tokenizer, adapter_seed=6)
    pairs = list(PairedExamples(pair_examples))
    with torch.no_grad():
        token_logps = [torch.log_softmax(policy(input_ids=torch.tensor([e.input_ids])).logits[0, :-1], -1)
                       .gather(-1, torch.tensor(e.input_ids[1:])[:, None])[:, 0] for e in pair_examples[0::2]]
    nll = -sum(t.sum() for t in token_logps) / sum(len(t) for t in token_logps)
    for collator, side in ((Collator(tokenizer.pad_token_id), "left"),
                           (Collator(tokenizer.pad_token_id, padding_side="right"), "right"),
                           (PaddingFreeCollator(), "left")):
        batch = PairCollator(collator)(pairs)
        with torch.no_grad():
            got = orpo_trl_terms(policy, batch, beta=0.1, padding_side=side)
            lp, n = tail_logps(policy, batch, side)
        want = orpo_loss(lp[0::2], lp[1::2], n[0::2], n[1::2], 0.1, nll=nll)
        _close(got.losses, want.losses.tolist())
        _close(got.chosen_logps, want.chosen_logps.tolist())
        spec = PreferenceObjective("orpo", beta=0.1, padding_side=side, conventions="trl")
        with torch.no_grad():
            _close(spec.terms(policy, batch).losses, want.losses.tolist())
    assert float(nll) != pytest.approx(float(-(lp[0::2] / n[0::2]).mean()), rel=1e-3)  # not scale's answer NLL


# ------------------------------------------------------------------------------------------------- TRL


def test_equals_trl_dpo_trainer_step_by_step(tmp_path, tokenizer, pair_examples):
    """Two optimizer steps of TRL's DPOTrainer and of ours on the same pairs, same model, same AdamW: loss,
    rewards/* and logps/* of each step within 1e-5 (float32 models; TRL pads right and takes full logits, we pad
    left and take the tail's: fp32 round-off ~1e-6 on logps of magnitude ~50). The adapter starts from random B
    matrices, so TRL keeps a frozen copy as its reference ("ref") and so do we (add_reference_adapter); step 2's
    numbers depend on step 1's update."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    beta, lr, steps = 0.1, 1e-2, 2
    ours_model = _model(tokenizer, adapter_seed=7, dtype=torch.float32)
    trl_model = _model(tokenizer, adapter_seed=7, dtype=torch.float32)
    add_reference_adapter(ours_model)

    args = trl.DPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=len(TEXT_PAIRS),
                         gradient_accumulation_steps=1, max_steps=steps, learning_rate=lr, lr_scheduler_type="constant",
                         warmup_steps=0, weight_decay=0.0, max_grad_norm=1e9, beta=beta, logging_steps=1,
                         report_to=[], save_strategy="no", use_cpu=True, seed=0, gradient_checkpointing=False,
                         bf16=False, fp16=False)
    trainer = trl.DPOTrainer(model=trl_model, args=args, processing_class=tokenizer,
                             train_dataset=Dataset.from_list(TEXT_PAIRS))
    trainer.train()
    logged = [h for h in trainer.state.log_history if "rewards/chosen" in h]
    assert len(logged) == steps
    assert abs(logged[-1]["rewards/margins"]) > 1e-3  # step 2's policy moved away from its reference

    objective = PreferenceObjective("dpo", beta=beta)
    batch = PairCollator(Collator(tokenizer.pad_token_id))(list(PairedExamples(pair_examples)))
    opt = torch.optim.AdamW([p for p in ours_model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0,
                            betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon)
    for step in range(steps):
        w = objective.weights(batch)
        loss, metrics = objective.loss_and_metrics(ours_model, batch, w)
        (loss / w.sum()).backward()
        opt.step()
        opt.zero_grad()
        want = logged[step]
        got = {"loss": (loss / w.sum()).item(), **{k: (v / w.sum()).item() for k, v in metrics.items()}}
        for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                    "logps/chosen", "logps/rejected"):
            assert abs(got[key] - want[key]) <= 1e-5 * max(1.0, abs(want[key])), (step, key, got[key], want[key])


# ------------------------------------------------------------------------------------------ dropout


# Base models shipped with dropout in their config: a Llama-like attention_dropout (a float the attention passes to
# F.scaled_dot_product_attention while training) and GPT-2's resid/embd/attn_pdrop (nn.Dropout modules, 0.1 by
# default).
DROPOUT_FAMILIES = {
    "llama": ("LlamaConfig", {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
                              "attention_dropout": 0.3}),
    "gpt2": ("GPT2Config", {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256}),
}


@pytest.fixture(scope="module")
def dropout_models(tmp_path_factory, tokenizer):
    """family -> directory of a tiny model whose config has dropout (save_pretrained)."""
    import transformers

    root, out = tmp_path_factory.mktemp("dropout"), {}
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
           "pad_token_id": tokenizer.pad_token_id}
    for name, (config_cls, kwargs) in DROPOUT_FAMILIES.items():
        torch.manual_seed(0)
        config = getattr(transformers, config_cls)(vocab_size=len(tokenizer), **ids, **kwargs)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(root / name)
        out[name] = root / name
    return out


@pytest.mark.parametrize("family", sorted(DROPOUT_FAMILIES))
def test_policy_equal_to_its_reference_has_zero_rewards_with_dropout_in_the_config(tmp_path, dropout_models, family,
                                                                                    caplog):
    """DPO at step 1 (LoRA B = 0: the policy equals its in-step reference) on a model whose config has dropout, with
    lora.dropout on too: model.disable_dropout (null: true under dpo) turns every dropout off, so the rewards, margins
    and accuracies are exactly 0 and the loss is log 2 (one float32 logsigmoid(0): within eps32); the start-up line
    says what was turned off. (With the policy's and the reference's forwards under different masks, the margins
    were 0.0086 and the accuracies 0.625.)"""
    import logging

    from scale.train import run
    from scale.training.metrics import read_jsonl
    from tests.conftest import tiny_cfg

    path = _write(tmp_path / "p.jsonl", [{"prompt": f"Q: question {i} about things?", "chosen": " Yes" + " yes" * i,
                                          "rejected": " No" + " no" * (i % 3)} for i in range(12)])
    out = tmp_path / "run"
    with caplog.at_level(logging.INFO):
        run(tiny_cfg(out, f"model.name_or_path={dropout_models[family]}", "model.tokenizer=smollm2-135m",
                     f"data.path={path}", "loss.objective=dpo", "lora.dropout=0.1", "data.eval_size=4",
                     "train.micro_batch_size=8", "train.gradient_accumulation_steps=1", "train.max_steps=1",
                     "train.log_every=1", "train.eval_every=0", "eval.generate_samples=0", "train.save_every=0",
                     "train.save_every_minutes=null", "log.peak_flops=false"))
    step = next(r for r in read_jsonl(out / "metrics.jsonl") if r.get("step") == 1 and "train/loss" in r)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert step[f"train/{key}"] == 0.0, key
    assert abs(step["train/loss"] - math.log(2)) <= 2 * torch.finfo(torch.float32).eps
    config = {"llama": "attention_dropout=0.3 (2 functional rates in layers)",
              "gpt2": "attn_pdrop=0.1, embd_pdrop=0.1, resid_pdrop=0.1, summary_first_dropout=0.1 (7 Dropout modules)"}
    lora = {"llama": 14, "gpt2": 8}  # all-linear: 7 linear layers per Llama block, c_attn/c_proj/c_fc/c_proj in GPT-2
    line = (f"dropout off (model.disable_dropout=null: true under loss.objective=dpo, as TRL's disable_dropout): the "
            f"model's {config[family]}, lora.dropout=0.1 ({lora[family]} adapters) -> 0; the policy and its in-step "
            f"reference forward are one network")
    assert [m for m in caplog.messages if "dropout" in m] == [f"[RANK 0] {line}"]


def _dropout_model(tokenizer, directory):
    return build_model(ModelConfig(name_or_path=str(directory), tokenizer="smollm2-135m"), LoraConfig(dropout=0.1),
                       len(tokenizer), seed=0)


def test_sft_keeps_the_models_dropout_and_the_reference_never_draws_masks(tmp_path, tokenizer, dropout_models,
                                                                          pair_examples):
    """loss.objective=sft keeps the model's own dropout and lora.dropout (as TRL's SFTTrainer), said in one line;
    model.disable_dropout=true turns them off under sft too. With model.disable_dropout=false under dpo the policy's
    forward draws masks, but the in-step reference runs in eval mode: it equals the precomputed pass bit for bit, and
    the model is back in train mode after it."""
    from scale.training.parts.model import set_dropout
    from tests.conftest import tiny_cfg

    def cfg(*overrides):
        return tiny_cfg(tmp_path / "out", f"model.name_or_path={dropout_models['llama']}", *overrides)

    model = _dropout_model(tokenizer, dropout_models["llama"])
    assert set_dropout(cfg(), model) == ("dropout on (model.disable_dropout=null: false under loss.objective=sft): "
                                         "the model's attention_dropout=0.3 (2 functional rates in layers), "
                                         "lora.dropout=0.1 (14 adapters) draw masks in training; "
                                         "model.disable_dropout=true turns them off")
    attention = [m for m in model.modules() if hasattr(m, "attention_dropout")]
    assert [m.attention_dropout for m in attention] == [0.3, 0.3]
    assert model.get_base_model().config.attention_dropout == 0.3
    line = set_dropout(cfg("loss.objective=dpo", "model.disable_dropout=false", "data.format=preference"), model)
    assert line.startswith("dropout on (model.disable_dropout=false): the model's attention_dropout=0.3")
    batch = PairCollator(Collator(tokenizer.pad_token_id))(list(PairedExamples(pair_examples)))
    torch.manual_seed(0)
    first, second = tail_logps(model, batch)[0], tail_logps(model, batch)[0]
    assert not torch.equal(first, second)  # the policy's forward draws masks
    ref = reference_forward(model, batch)
    assert model.training and torch.equal(ref, reference_forward(model, batch))
    assert torch.equal(ref.double(), reference_logps(model, [batch]))
    assert set_dropout(cfg("model.disable_dropout=true"), model).startswith(
        "dropout off (model.disable_dropout=true, as TRL's disable_dropout): the model's attention_dropout=0.3 (2 "
        "functional rates in layers), lora.dropout=0.1 (14 adapters) -> 0")
    assert [m.attention_dropout for m in attention] == [0.0, 0.0]
    assert model.get_base_model().config.attention_dropout == 0.0 and model.peft_config["default"].lora_dropout == 0
    assert torch.equal(tail_logps(model, batch)[0], tail_logps(model, batch)[0])


# ------------------------------------------------------------------------------------------ error lines


def _distinct_pairs(n):
    return [{"prompt": f"Q: question {k}?", "chosen": f" Answer {k}.", "rejected": f" Wrong {k}."} for k in range(n)]


def test_pair_errors_name_the_file_the_line_the_side_and_the_fix(tmp_path, tokenizer):
    """The one-line errors of a pair file name the file, the row and its line, the side and the fix: an answer that
    cannot fit (text and conversational pairs, and in a mixture the file of the source it is in), and a first row
    without a rejected side (the file's columns are every row's, so the row check names the row)."""
    from scale.data import build_splits
    from tests.conftest import tiny_cfg

    long = " " + " ".join(["no"] * 30)
    rows = _distinct_pairs(12)
    rows[3]["rejected"] = long
    path = _write(tmp_path / "p.jsonl", rows)
    n = len(_enc(tokenizer, long)) + 1
    fix = "Raise data.max_length, or set data.drop_long_completions=true to drop such pairs (counted in the log)."
    text_line = (f"the rejected answer (its completion + EOS) is {n} tokens; with 1 token(s) before it the pair needs "
                 f"{n + 1} > data.max_length=24. {fix}")
    with pytest.raises(DataError) as e:
        build_splits(DataConfig(max_length=24, eval_size=2), LossConfig(objective="dpo"), tokenizer, path, 0)
    assert str(e.value) == f"row 3 (line 4) of {path}: {text_line}"

    # a mixture: the row is named in the file of its own source
    other = _write(tmp_path / "q.jsonl", _distinct_pairs(12)[6:] + _distinct_pairs(20)[12:])
    cfg = tiny_cfg(tmp_path / "out", f"data.datasets=[{{path: {other}}}, {{path: {path}}}]", "data.max_length=24",
                   "data.eval_size=2", "loss.objective=dpo", "data.format=preference")
    with pytest.raises(DataError) as e:
        build_splits(cfg.data, cfg.loss, tokenizer, "", 0)
    assert str(e.value) == f"row 3 (line 4) of {path}: {text_line}"

    answer = "No, " + " ".join(["never"] * 40) + "."
    chats = [{"prompt": [_user(f"Hi {k}")], "chosen": [_bot("Yes.")], "rejected": [_bot("No.")]} for k in range(12)]
    chats[5]["rejected"] = [_bot(answer)]
    path = _write(tmp_path / "c.jsonl", chats)
    tail = len(_enc(tokenizer, answer + "<|im_end|>"))
    with pytest.raises(DataError) as e:
        build_splits(DataConfig(max_length=24, eval_size=2, chat_template=str(CHATML)), LossConfig(objective="dpo"),
                     tokenizer, path, 0)
    assert str(e.value) == (f"row 5 (line 6) of {path}: the rejected answer is {tail} tokens (through its end-of-turn "
                            f"marker), and the pair does not fit in data.max_length=24 tokens even with its shared "
                            f"prompt cut to its last exchange and the start of that exchange's user text "
                            f"(data.truncation=keep_end never cuts inside a turn's markers). {fix}")

    rows = _distinct_pairs(13)
    del rows[0]["rejected"]
    path = _write(tmp_path / "r.jsonl", rows)
    with pytest.raises(DataError) as e:
        load_rows(DataConfig(), path)
    assert str(e.value) == (f"row 0 (line 1) of {path}: the rejected side ('rejected') is missing or empty; every "
                            f"preference pair needs a chosen and a rejected answer: add the rejected answer to the "
                            f"row, or remove the row")


# --------------------------------------------------- TRL's conventions: real text and chats, both tokenizers


def _real_pairs(kind):
    """Pairs of real text, as a TRL user's file holds them. ``text``: ChatterBot questions as ``Question: ...\\n
    Answer: `` (a prompt ending in a space; one answer a year) with the corpus answer chosen and another
    conversation's rejected, and rotten-tomatoes reviews as ``Review: ...\\nSentiment:`` (`` positive``/
    `` negative``, the true label chosen; one prompt ending in a space). ``chat``: ChatterBot pairs as message
    lists (one exchange), and two multi-turn conversations of the English corpus whose last answer is chosen
    against another conversation's."""
    from scale.utils.assets import resolve_data

    def lines(name):
        with open(resolve_data(name), encoding="utf-8") as f:
            return [json.loads(line) for line in f]

    bot = lines("chatterbot-preference")
    bot = [r for r in bot if len(r["chosen"][0]["content"]) < 120 and len(r["rejected"][0]["content"]) < 120]
    if kind == "chat":
        talks = [r["messages"] for r in lines("chatterbot-english")]
        long = [m for m in talks if len(m) >= 4 and sum(len(x["content"]) for x in m) < 300][:2]
        multi = [{"prompt": m[:-1], "chosen": m[-1:], "rejected": bot[20 + k]["chosen"]} for k, m in enumerate(long)]
        return bot[:4] + multi
    reviews = lines("rotten-tomatoes")
    reviews = [r for r in reviews if len(r["text"]) < 90][:3]
    other = {"positive": "negative", "negative": "positive"}
    # a year answer: "Answer: 1963" keeps the space as its own token, "Answer: What" does not, so the two sides'
    # encodings leave the prompt at different tokens (DPOTrainer: one shared prompt; CPO/ORPO: each side's own)
    year = next(r for r in bot if r["chosen"][0]["content"][:1].isdigit() and r["rejected"][0]["content"][:1].isalpha())
    return ([{"prompt": f"Question: {r['prompt'][0]['content']}\nAnswer: ", "chosen": r["chosen"][0]["content"],
              "rejected": r["rejected"][0]["content"]} for r in bot[:4] + [year]]
            + [{"prompt": f"Review: {r['text']}\nSentiment:", "chosen": f" {r['label']}",
                "rejected": f" {other[r['label']]}"} for r in reviews[:2]]
            + [{"prompt": f"Review: {r['text']}\nSentiment: ", "chosen": r["label"], "rejected": other[r["label"]]}
               for r in reviews[2:3]])


def _trl_trainer(trl, objective, loss_type, model, tokenizer, rows, out, beta, batch):
    """TRL 1.16's trainer of ``objective`` (DPOTrainer; CPOTrainer with loss_type=simpo, cpo_alpha=0; ORPOTrainer),
    tokenizing ``rows`` itself. DPO's reference is a separately built base model (ours: the adapter disabled,
    bit-equal to it: test_disabled_adapter_reference_equals_the_base_model); a PeftModel given alone would get a
    copy of its adapter as the reference, equal to the policy before training."""
    from datasets import Dataset

    common = {"output_dir": str(out), "per_device_eval_batch_size": batch, "report_to": [], "use_cpu": True,
              "bf16": False, "fp16": False, "beta": beta, "max_length": 512, "seed": 0}
    data = Dataset.from_list(rows)
    if objective == "dpo":
        ref = load_base(ModelConfig(name_or_path="tiny-llama"), vocab_size=len(tokenizer), seed=3).float()
        return trl.DPOTrainer(model=model, ref_model=ref, args=trl.DPOConfig(**common, loss_type=[loss_type]),
                              processing_class=tokenizer, train_dataset=data, eval_dataset=data)
    if objective == "simpo":
        from trl.experimental.cpo import CPOConfig, CPOTrainer

        return CPOTrainer(model=model, args=CPOConfig(**common, loss_type="simpo", cpo_alpha=0.0, simpo_gamma=0.5),
                          processing_class=tokenizer, train_dataset=data, eval_dataset=data)
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    return ORPOTrainer(model=model, args=ORPOConfig(**common), processing_class=tokenizer, train_dataset=data,
                       eval_dataset=data)


def _trl_rows(trainer, objective):
    """The token rows TRL's trainer made of its eval split, chosen then rejected per pair, with each row's
    trained length (DPOTrainer: ``prompt_ids`` + ``chosen_ids``; CPO/ORPO: ``chosen_input_ids``, ``chosen_labels``)."""
    rows = []
    for r in trainer.eval_dataset:
        for side in ("chosen", "rejected"):
            if objective == "dpo":
                rows.append((r["prompt_ids"] + r[f"{side}_ids"], len(r[f"{side}_ids"])))
            else:
                rows.append((r[f"{side}_input_ids"], sum(t != -100 for t in r[f"{side}_labels"])))
    return rows


def _float64_sides(model64, examples, reference=False):
    """Each example's float64 logps under ``model64`` (the float32 model cast; ``reference``: its adapter disabled),
    one row at a time, with the bound on a float32 evaluation's error in each:
    ``(tail logps, its bound, whole-row logps (every token but the first), its bound, whole-row tokens)``.

    Per predicted token (float64 logits ``z`` over the vocabulary ``V``, hidden widths up to ``D``): each logit is
    within ``r |z|_max`` of its float64 value, ``r = 4 eps sqrt(V) + 4 eps D`` (tests/bounds.py ``rel_bound`` +
    ``dot_rel``: the vocabulary reduction and the cancelling dot products, relative to the largest logit); the log
    of the softmax's sum of ``V`` positive terms adds ``4 eps sqrt(V)`` and its rounding ``eps |lse|``, so a token's
    log-probability ``z_t - lse`` is within ``e_t = 2 r |z|_max + 4 eps sqrt(V) + eps |lse|``. A sum of ``n`` of
    them adds ``4 eps sqrt(n) sum |logp|``."""
    from tests.bounds import EPS32, dot_rel, rel_bound

    cfg = model64.config
    V, D = cfg.vocab_size, max(cfg.hidden_size, cfg.intermediate_size)
    r = rel_bound(V) + dot_rel(D)
    out = []
    with torch.no_grad(), (reference_mode(model64) if reference else contextlib.nullcontext()):
        for e in examples:
            ids = torch.tensor([e.input_ids])
            z = model64(input_ids=ids).logits[0, :-1].double()                     # [n - 1, V]
            lse = torch.logsumexp(z, -1)
            logp = z.gather(-1, ids[0, 1:, None])[:, 0] - lse
            err = 2 * r * z.abs().amax(-1) + rel_bound(V) + EPS32 * lse.abs()
            n = e.tail_len
            out.append((float(logp[-n:].sum()), float(err[-n:].sum() + rel_bound(n) * logp[-n:].abs().sum()),
                        float(logp.sum()), float(err.sum() + rel_bound(len(logp)) * logp.abs().sum()), len(logp)))
    return out


def _exact_metrics(objective, loss_type, beta, examples, policy, reference, batch):
    """The float64 eval metrics (``eval/*``, means over pairs as :func:`scale.training.evaluate.evaluate` reports them) of
    the pairs, from :func:`_float64_sides` (``policy``, ``reference``: ``None`` without one), with each metric's
    float32 bound: the per-side bounds propagated to first order (the derivatives at the float64 logps), plus the
    metric's own float32 rounding (4 eps per operand's magnitude, and the mean's sum); and each pair's margin with
    its bound (``rewards/accuracies`` is a step: equal where every margin is farther from 0 than its bound).
    ORPO's NLL is TRL's: every chosen-row token but the first, pooled over each eval batch of ``batch`` pairs."""
    from tests.bounds import EPS32, rel_bound

    def column(rows, k, side, grad=False):
        return torch.tensor([x[k] for x in rows[side::2]], dtype=torch.float64, requires_grad=grad)

    lc, lr = column(policy, 0, 0, True), column(policy, 0, 1, True)
    ec, er = column(policy, 1, 0), column(policy, 1, 1)
    nc, nr = (torch.tensor([e.tail_len for e in examples[s::2]], dtype=torch.float64) for s in (0, 1))
    P = len(lc)
    if objective == "dpo":
        rc, rr = column(reference, 0, 0, True), column(reference, 0, 1, True)
        erc, err = column(reference, 1, 0), column(reference, 1, 1)
        terms = dpo_loss(lc, lr, rc, rr, nc, nr, beta, loss_type)
        inputs = ((lc, ec), (lr, er), (rc, erc), (rr, err))
        per = {"rewards/chosen": beta * (ec + erc + 4 * EPS32 * (lc.abs() + rc.abs())),
               "rewards/rejected": beta * (er + err + 4 * EPS32 * (lr.abs() + rr.abs())),
               "logps/chosen": ec + 4 * EPS32 * lc.abs(), "logps/rejected": er + 4 * EPS32 * lr.abs()}
    else:
        if objective == "simpo":
            terms = simpo_loss(lc, lr, nc, nr, beta, 0.5)
            inputs = ((lc, ec), (lr, er))
        else:
            row, count = column(policy, 2, 0, True), column(policy, 4, 0)
            nll = torch.cat([(-row[k:k + batch].sum() / count[k:k + batch].sum()).expand(len(row[k:k + batch]))
                             for k in range(0, P, batch)])
            terms = orpo_loss(lc, lr, nc, nr, beta, nll=nll)
            inputs = ((lc, ec), (lr, er), (row, column(policy, 3, 0)))
        per = {"rewards/chosen": beta * (ec + 4 * EPS32 * lc.abs()) / nc,
               "rewards/rejected": beta * (er + 4 * EPS32 * lr.abs()) / nr,
               "logps/chosen": (ec + 4 * EPS32 * lc.abs()) / nc, "logps/rejected": (er + 4 * EPS32 * lr.abs()) / nr}
    grads = torch.autograd.grad(terms.losses.sum(), [x for x, _ in inputs])
    per["rewards/margins"] = per["rewards/chosen"] + per["rewards/rejected"]
    # d(sum of pair losses)/d(input) x the input's bound, each input once (ORPO's rows feed a batch's pooled NLL)
    per["loss"] = sum((g.abs() * (e + 4 * EPS32 * x.detach().abs())).sum() for g, (x, e) in zip(grads, inputs)) / P \
        + 4 * EPS32 * terms.losses.detach().abs()
    columns = terms.columns().detach()                                   # [P, 7]: loss, then METRICS
    exact = PreferenceObjective.eval_summary(columns.sum(0).tolist(), P)
    # the mean over P pairs: its own float32 sum adds 4 eps sqrt(P) x the mean of |values|
    size = dict(zip(("loss", *METRICS), columns.abs().mean(0).tolist()))
    bounds = {k: float(v.detach().sum()) / P + rel_bound(P) * size[k] for k, v in per.items()}
    # rewards/accuracies: 0/1 per pair, equal where no margin is within its bound; TRL's float32 means (of each eval
    # batch, then of the batches) round within 2 x 4 eps sqrt(pairs) of the exact share
    bounds["rewards/accuracies"] = 2 * rel_bound(P)
    return exact, bounds, columns[:, 4], per["rewards/margins"]


TRL_LOSSES = {"dpo": ("sigmoid", "ipo", "hinge"), "simpo": ("simpo",), "orpo": ("orpo",)}
EVAL_KEYS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
             "logps/rejected")


@pytest.mark.parametrize("kind", ["text", "chat"])
@pytest.mark.parametrize("objective", ["dpo", "simpo", "orpo"])
def test_trl_conventions_reproduce_trl_evaluate(tmp_path, tokenizer, objective, kind):
    """``data.pair_conventions: trl`` on real pairs: our tokenizer path and TRL 1.16's trainer of the objective
    (DPOTrainer: sigmoid, ipo, hinge; CPOTrainer loss_type=simpo; ORPOTrainer, both from trl.experimental), each
    tokenizing the same rows itself, make the same token rows with the same trained answers (a prompt ending in a
    space, BOS, EOS, ChatML's newline after <|im_end|>: every convention TRL has), and our evaluation (two eval
    micro-batches, as TRL's two eval batches) gives TRL's ``evaluate()`` metrics within the float32 bound of
    :func:`_exact_metrics` of the float64 values, on the tiny model with SmolLM2's tokenizer and chat template."""
    import copy

    from torch.utils.data import DataLoader

    from scale.training.evaluate import evaluate

    trl = pytest.importorskip("trl")
    from accelerate import Accelerator

    rows, beta = _real_pairs(kind), 0.1
    batch = len(rows) // 2
    path = _write(tmp_path / "pairs.jsonl", rows)
    cfg = DataConfig(max_length=512, pair_conventions="trl")
    examples = tokenize_rows(load_rows(cfg, path), tokenizer, cfg, LossConfig(objective=objective))
    policy = _model(tokenizer, adapter_seed=7, dtype=torch.float32)
    policy64 = copy.deepcopy(policy).double()

    # What TRL's conventions make of real text, checked on the tokens themselves.
    trainer = _trl_trainer(trl, objective, TRL_LOSSES[objective][0], copy.deepcopy(policy), tokenizer, rows,
                           tmp_path / "trl", beta, batch)
    assert [(e.input_ids, e.tail_len) for e in examples] == _trl_rows(trainer, objective)
    if kind == "text":
        words = tokenizer.convert_ids_to_tokens(examples[0].input_ids[-examples[0].tail_len:])
        assert words[0].startswith("Ġ")  # the prompt's trailing space is the answer's first token's, as TRL's
        prompts = [len(e.input_ids) - e.tail_len for e in examples]
        split = [prompts[p] != prompts[p + 1] for p in range(0, len(prompts), 2)]
        assert any(split) == (objective != "dpo")  # the year pair: CPO/ORPO cut each side on its own
    else:
        eot, newline = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer("\n")["input_ids"]
        end = [eot] + newline + ([eot] if objective != "dpo" else [])  # CPO/ORPO append EOS after the newline
        assert examples[0].input_ids[-len(end):] == end  # the newline after <|im_end|> is trained too
    if objective != "dpo":
        assert all(e.input_ids[0] == tokenizer.bos_token_id for e in examples)  # CPO/ORPO's BOS

    policy_sides = _float64_sides(policy64, examples)
    reference_sides = _float64_sides(policy64, examples, reference=True) if objective == "dpo" else None
    loader = DataLoader(PairedExamples(examples), batch_size=batch,
                        collate_fn=PairCollator(Collator(tokenizer.pad_token_id)))
    task = load_rows(cfg, path).task
    for loss_type in TRL_LOSSES[objective]:
        if objective == "dpo":  # one DPOTrainer, its loss as DPOConfig(loss_type=[...]) sets it
            trainer.loss_types = [loss_type]
        theirs = trainer.evaluate()
        dpo_kind = loss_type if objective == "dpo" else "sigmoid"
        spec = PreferenceObjective(objective, beta=beta, dpo_loss=dpo_kind, conventions="trl")
        ours = evaluate(Accelerator(cpu=True), policy, loader, spec, task=task)
        exact, bounds, margins, margin_bounds = _exact_metrics(objective, dpo_kind, beta, examples, policy_sides,
                                                               reference_sides, batch)
        assert bool((margins.abs() > margin_bounds).all()), (margins, margin_bounds)  # no accuracy near a tie
        for key in EVAL_KEYS:
            b, x = bounds[key], exact[f"eval/{key}"]
            assert abs(theirs[f"eval_{key}"] - x) <= b and abs(ours[f"eval/{key}"] - x) <= b, \
                (loss_type, key, ours[f"eval/{key}"], theirs[f"eval_{key}"], x, b)
