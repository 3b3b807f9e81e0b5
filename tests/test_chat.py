"""Issue 17: chats as users bring them. Every assistant turn trained (loss equal to a full-logits reference),
transformers' assistant mask agreeing with ours, tool calls/tools/reasoning reaching the template, conversational
prompt/completion, template hygiene (a raising template, the generation prompt, special-token spellings, BOS, the
clock), labels (prefix labels, Unicode forms, separators) and ``--show-rows``."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
import torch.nn.functional as F

from scale.config.schema import DataConfig, LossConfig, ModelConfig
from scale.data import Collator, DataError, build_splits, load_rows, tokenize_rows
from scale.loss.tail import forward_tail, tail_loss, token_weights
from scale.modeling.build import load_base
from tests.conftest import ROOT, SHARED_DATA, TINY_YAML

CASES = SHARED_DATA.parent / "cases" / "turn3"
CHATML = ROOT / "configs" / "chat" / "chatml.jinja"
# ChatML with transformers' {% generation %} markers around what an assistant turn trains
GENERATION = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}{% if m['role'] == 'assistant' %}"
              "{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}{% else %}"
              "{{ m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
              "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def _chat(*turns):
    return [{"role": ("user", "assistant")[k % 2], "content": t} for k, t in enumerate(turns)]


def _enc(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


CHATS = [_chat("Hi", "Hello there.", "Capital of France?", "Paris.", "And of Spain?", "Madrid, I think."),
         _chat("Name a colour.", "Blue."),
         _chat("Count to three.", "One, two, three.", "Backwards?", "Three, two, one.")]


@pytest.fixture(scope="module")
def model(tokenizer):
    return load_base(ModelConfig(name_or_path="tiny-llama"), vocab_size=len(tokenizer), seed=5).eval()


@pytest.fixture(scope="module")
def chat_examples(tmp_path_factory, tokenizer):
    path = _write(tmp_path_factory.mktemp("chats") / "c.jsonl", [{"messages": m} for m in CHATS])
    cfg = DataConfig(chat_template=str(CHATML), max_length=256)
    return tokenize_rows(load_rows(cfg, path), tokenizer, cfg, LossConfig())


def test_every_assistant_turn_is_trained_through_its_marker(chat_examples, tokenizer):
    a, b, c = chat_examples
    trained = [t for t, f in zip(a.input_ids[-a.tail_len:], a.trained) if f]
    assert trained == [t for s in ("Hello there.", "Paris.", "Madrid, I think.") for t in _enc(tokenizer, s + "<|im_end|>")]
    assert b.trained is None and b.input_ids[-b.tail_len:] == _enc(tokenizer, "Blue.<|im_end|>")
    assert a.input_ids[-a.tail_len:][:len(_enc(tokenizer, "Hello"))] == _enc(tokenizer, "Hello")  # tail starts trained
    assert sum(c.trained) == len(_enc(tokenizer, "One, two, three.<|im_end|>Three, two, one.<|im_end|>"))


@pytest.mark.parametrize("side", ["left", "right"])
@torch.no_grad()
def test_multi_turn_loss_equals_a_full_logits_masked_reference(chat_examples, tokenizer, model, side):
    """Per-token loss of a multi-turn batch (tails of 3 lengths, weight-0 user turns inside) equals masked CE
    over the full logits of every row run alone, within fp32 round-off (tests/bounds.py); the LM head never sees all
    positions.

    The sum is held to what fp32 can promise against a float64 sum of the same tokens: each token's own
    tolerance plus the bound of recursive summation, ``(n - 1) * eps * sum|x|`` (Higham, *Accuracy and Stability
    of Numerical Algorithms*, 2nd ed., eq. 4.4). An absolute 1e-5 on a sum of ~334 nats failed on AVX-512 CPUs,
    whose reduction order differs (2e-5 apart, 6e-8 relative)."""
    batch = Collator(tokenizer.pad_token_id, side)(chat_examples)
    assert batch["tail_mask"].shape[1] < batch["input_ids"].shape[1]
    tail_logits, targets = forward_tail(model, batch, padding_side=side)
    w = token_weights(batch["type_indicator"], batch["tail_mask"], None)
    per_token = F.cross_entropy(tail_logits.flatten(0, 1).float(), targets.flatten(), reduction="none").view_as(w)
    num, den = tail_loss(tail_logits, targets, w)
    ref_num, ref_den = 0.0, 0
    from tests.bounds import fp32_paths_rel

    rel = fp32_paths_rel(tail_logits.shape[-1], model.config.intermediate_size)
    for b, e in enumerate(chat_examples):
        ids = torch.tensor([e.input_ids])
        logits = model(input_ids=ids).logits[0].float()                              # [T, V]
        T, N = len(e.input_ids), batch["tail_mask"].shape[1]
        for j, flag in enumerate(e.tail_flags()):
            pos = T - e.tail_len + j
            if flag:
                ref = F.cross_entropy(logits[pos - 1:pos], ids[0, pos:pos + 1]).item()
                col = N - e.tail_len + j
                assert targets[b, col].item() == e.input_ids[pos]
                # batched (padded) and one row alone: two fp32 paths (tests/bounds.py); a CE is ln V-sized
                assert per_token[b, col].item() == pytest.approx(ref, rel=rel, abs=0)
                ref_num, ref_den = ref_num + ref, ref_den + 1
    eps = torch.finfo(torch.float32).eps
    assert den.item() == ref_den
    assert abs(num.item() - ref_num) <= ref_num * (1e-6 + (ref_den - 1) * eps), (num.item(), ref_num)


def test_generation_markers_agree_with_transformers_assistant_mask(tmp_path, tokenizer):
    """Where a template marks {% generation %}, transformers' return_assistant_tokens_mask is our trained mask."""
    template = tmp_path / "gen.jinja"
    template.write_text(GENERATION)
    cfg = DataConfig(chat_template=str(template), max_length=256)
    rows = load_rows(cfg, _write(tmp_path / "c.jsonl", [{"messages": m} for m in CHATS]))
    for e, m in zip(tokenize_rows(rows, tokenizer, cfg, LossConfig()), CHATS):
        out = tokenizer.apply_chat_template(m, chat_template=GENERATION, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
        assert ids[:len(e.input_ids)] == e.input_ids and tokenizer.decode(ids[len(e.input_ids):]) == "\n"
        ours = [0] * (len(e.input_ids) - e.tail_len) + e.tail_flags()
        assert ours == mask[:len(e.input_ids)] and sum(ours) > 0


def test_tool_calls_and_tools_reach_the_template(tmp_path, tokenizer, caplog):
    """C34's rows: the tool call turn and the answer are both trained; the tools schema is in the prompt."""
    case = CASES / "C34"
    if not case.is_dir():
        pytest.skip("../shared/cases is absent")
    cfg = DataConfig(chat_template=str(case / "qwen25_tools.jinja"), max_length=512, eval_size=8)
    rows = load_rows(cfg, str(case / "tool_answers.jsonl"))
    assert "tool_calls" in rows[0]["messages"][1] and rows[0]["tools"][0]["function"]["name"] == "get_temperature"
    (e,) = tokenize_rows(rows[:1], tokenizer, cfg, LossConfig())
    text = tokenizer.decode(e.input_ids)
    raw = json.loads((case / "tool_answers.jsonl").read_text().splitlines()[0])
    full = tokenizer.apply_chat_template(raw["messages"], tools=raw["tools"], chat_template=(
        case / "qwen25_tools.jinja").read_text(), tokenize=False)
    assert text == full.rstrip("\n") and "<tools>" in text and "<tool_call>" in text
    trained = tokenizer.decode([t for t, f in zip(e.input_ids[-e.tail_len:], e.tail_flags()) if f])
    assert trained == ('<tool_call>\n{"name": "get_temperature", "arguments": {"city": "Paris"}}\n</tool_call>'
                       '<|im_end|>It is 10 degrees Celsius in Paris.<|im_end|>')
    # The same rows on plain ChatML (no tool calls, no tools): refused, naming the shipped tool-aware template;
    # on chatml_tools a key it does not render (a tool turn's name: linking metadata) is an INFO line, once.
    path = _write(tmp_path / "r.jsonl", [{k: v for k, v in r.items() if k != "row"} for r in rows])
    with pytest.raises(DataError, match=r"^row \d+ \(line \d+\) of .*r.jsonl: data.chat_template=.*chatml.jinja does not "
                                        r"render tool calls \(message 1 has tool_calls\).*set data.chat_template=chatml_tools"):
        build_splits(DataConfig(chat_template=str(CHATML), max_length=256, eval_size=8), LossConfig(), tokenizer,
                     path, seed=0)
    with caplog.at_level("INFO"):
        build_splits(DataConfig(chat_template="chatml_tools", max_length=512, eval_size=8), LossConfig(), tokenizer,
                     path, seed=0)
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if "does not render the" in r.getMessage()]
    assert lines == [("INFO", "data: the chat template does not render the tool-call metadata ['name'] (OpenAI's "
                              "links between a call and its result, no trained text; no common tool-aware template "
                              "renders them)")]


def _openai_tool_chat(user_name=None):
    """A chat in OpenAI's documented tool-call format: the call carries an ``id``, its result the ``tool_call_id``
    and the function's ``name``."""
    user = {"role": "user", "content": "How warm is it in Paris?", **({"name": user_name} if user_name else {})}
    return {"tools": [{"type": "function", "function": {"name": "get_temperature", "parameters": {
                "type": "object", "properties": {"city": {"type": "string"}}}}}],
            "messages": [user,
                         {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
                          "function": {"name": "get_temperature", "arguments": "{\"city\": \"Paris\"}"}}]},
                         {"role": "tool", "tool_call_id": "call_1", "name": "get_temperature", "content": "10"},
                         {"role": "assistant", "content": "It is 10 degrees."}]}


def test_openai_tool_call_metadata_is_no_warning_but_a_key_with_text_is(tmp_path, tokenizer, caplog):
    """chatml_tools (as Qwen2.5, Hermes and Llama 3.1 do) renders a tool result's content only: its tool_call_id and
    name link it to the call and are no trained text, so the documented format gets one INFO line, no warning. A
    user's name (who speaks: text a template may render) stays a warning."""
    cfg = DataConfig(chat_template="chatml_tools", max_length=512, eval_size=2)
    path = _write(tmp_path / "tools.jsonl", [_openai_tool_chat() for _ in range(6)])
    with caplog.at_level("INFO"):
        build_splits(cfg, LossConfig(), tokenizer, path, seed=0)
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if "does not render the" in r.getMessage()]
    assert lines == [("INFO", "data: the chat template does not render the tool-call metadata ['name', "
                              "'tool_call_id'] (OpenAI's links between a call and its result, no trained text; no "
                              "common tool-aware template renders them)")]
    caplog.clear()
    path = _write(tmp_path / "named.jsonl", [_openai_tool_chat(user_name="alice") for _ in range(6)])
    with caplog.at_level("INFO"):
        build_splits(cfg, LossConfig(), tokenizer, path, seed=0)
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if "does not render the" in r.getMessage()]
    assert lines == [("INFO", "data: the chat template does not render the tool-call metadata ['tool_call_id'] "
                              "(OpenAI's links between a call and its result, no trained text; no common tool-aware "
                              "template renders them)"),
                     ("WARNING", "data: the chat template does not render the message key(s) ['name'] (a row renders "
                                 "the same without them), so they are not part of the trained text; use a template "
                                 "that renders them (data.chat_template) if they matter")]


def test_conversational_prompt_completion_trains_the_completion_turns(tmp_path, tokenizer):
    row = {"prompt": _chat("Hi", "Hello.", "Capital of France?"), "completion": [
        {"role": "assistant", "content": "Paris."}]}
    cfg = DataConfig(chat_template=str(CHATML), max_length=256)
    rows = load_rows(cfg, _write(tmp_path / "pc.jsonl", [row]))
    (r,) = rows
    assert r["completion_from"] == 3 and [m["content"] for m in r["messages"]][-1] == "Paris."
    assert rows.task.name == "messages"          # a prompt/completion file of conversations is encoded as chats
    (e,) = tokenize_rows(rows, tokenizer, cfg, LossConfig())
    assert e.input_ids[-e.tail_len:] == _enc(tokenizer, "Paris.<|im_end|>") and e.trained is None


from tests.test_bad_input import _cli  # noqa: E402  one rejected run: exit code, one line, nothing written


def test_a_template_that_raises_is_one_line_naming_the_row(tmp_path, capsys):
    case = CASES / "C33"
    if not case.is_dir():
        pytest.skip("../shared/cases is absent")
    code, err = _cli(tmp_path, capsys, f"data.path={case / 'system_row.jsonl'}", "data.format=messages",
                     f"data.chat_template={case / 'gemma.jinja'}", "data.eval_size=8")
    assert code == 2 and err == (f"row 7 (line 8) of {case / 'system_row.jsonl'}: the chat template refuses this "
                                 f"conversation (TemplateError: System role not supported); fix the row or "
                                 f"data.chat_template")


def test_generation_prompt_must_start_the_rendered_turn(tmp_path, capsys):
    """A reasoning-style template whose generation prompt opens a thinking block the rendered turn lacks."""
    template = tmp_path / "think.jinja"
    template.write_text("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n\n</think>\n\n"
                        "{% endif %}")
    path = _write(tmp_path / "c.jsonl", [{"messages": _chat("Hi", "Yo")}] * 40)
    code, err = _cli(tmp_path, capsys, f"data.path={path}", f"data.chat_template={template}")
    assert code == 2 and err.split(":", 1)[1] == (
        " the chat template's generation prompt is not the start of the rendered last assistant turn: after "
        "'m_end|>\\n<|im_start|>assistant\\n' the prompt continues '<think>\\n\\n</think>\\n\\n' but the "
        "conversation 'Yo<|im_end|>\\n'; the model would be trained after a prompt inference never sends. Fix "
        "data.chat_template so that its generation prompt is what the rendered turn starts with")


def test_special_token_spellings_in_text_stay_text(tmp_path, tokenizer, caplog):
    m = _chat("Quote the marker <|im_end|> please", "It is <|im_end|> as text.")
    cfg = DataConfig(chat_template=str(CHATML), max_length=256, eval_size=1)
    path = _write(tmp_path / "c.jsonl", [{"messages": m}] * 3)
    with caplog.at_level("WARNING"):
        splits = build_splits(cfg, LossConfig(), tokenizer, path, seed=0)
    e = splits.train[0]
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    literal = tokenizer("<|im_end|>", add_special_tokens=False, split_special_tokens=True)["input_ids"]
    assert len(literal) > 1 and e.input_ids.count(end) == 2          # the user's and the assistant's own markers
    assert tokenizer.decode(e.input_ids[-e.tail_len:]) == "It is <|im_end|> as text.<|im_end|>"
    assert e.input_ids[-1] == end and e.input_ids[-e.tail_len:].count(end) == 1
    assert any("6 special-token spellings inside message text" in r.getMessage() for r in caplog.records)


def test_no_second_bos(tmp_path, tokenizer):
    from tokenizers.processors import TemplateProcessing

    tok = copy.deepcopy(tokenizer)
    tok._tokenizer.post_processor = TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    tok.bos_token = "<|endoftext|>"
    rows = load_rows(DataConfig(), _write(tmp_path / "p.jsonl", [{"prompt": "<|endoftext|>Q:", "completion": " A"}]))
    (e,) = tokenize_rows(rows, tok, DataConfig(), LossConfig())
    assert e.input_ids == [0, *_enc(tok, "Q:"), *_enc(tok, " A"), tok.eos_token_id]


def test_a_template_that_reads_the_clock_is_refused_unless_pinned(tmp_path, capsys, tokenizer):
    case = CASES / "C36"
    if not case.is_dir():
        pytest.skip("../shared/cases is absent")
    tok_dir = tmp_path / "tok"
    tok = copy.deepcopy(tokenizer)
    tok.add_special_tokens({"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]})
    tok.save_pretrained(tok_dir)
    path = _write(tmp_path / "c.jsonl", [{"messages": _chat(f"Q{i}", f"A{i}")} for i in range(40)])
    job = [f"data.path={path}", f"data.chat_template={case / 'llama32.jinja'}", f"model.tokenizer={tok_dir}",
           "data.max_length=96"]
    code, err = _cli(tmp_path, capsys, *job)
    assert code == 2 and err.startswith("data.chat_template reads the clock (strftime_now)")
    cfg = DataConfig(chat_template=str(case / "llama32.jinja"), chat_template_kwargs={"date_string": "09 Jan 2026"},
                     max_length=96, eval_size=8)
    splits = build_splits(cfg, LossConfig(), tok, path, seed=0)
    assert "Today Date: 09 Jan 2026" in tok.decode(splits.train[0].input_ids)
    assert tok.decode(splits.train[0].input_ids).count(tok.bos_token) == 1


def test_prefix_labels_unicode_forms_and_separators(tmp_path, tokenizer):
    from scale.data.tasks.classification import label_candidates, label_sequences

    nfd, nfc = "cafe\u0301", "caf\u00e9"
    cfg = DataConfig(labels=[nfc, "recommend", "recommend against"], template="Review: {text}\nVerdict:\n{label}")
    seqs = label_sequences(tokenizer, cfg)
    assert [tokenizer.decode(s) for s in seqs] == [nfc, "recommend", "recommend against"]   # no "\n" in a label
    rows = load_rows(cfg, _write(tmp_path / "d.jsonl", [{"text": "ok", "label": nfd + " "},
                                                         {"text": "no", "label": "recommend against"}]))
    a, b = tokenize_rows(rows, tokenizer, cfg, LossConfig())
    assert rows[0]["label"] == nfc and a.label == 0 and b.label == 2
    assert b.input_ids[:-b.tail_len] == _enc(tokenizer, "Review: no\nVerdict:\n")   # the prompt, exactly
    batch = Collator(tokenizer.pad_token_id, "left")([a, b])
    cands = label_candidates(batch, seqs, tokenizer.pad_token_id, "left")
    eos = tokenizer.eos_token_id
    assert cands[1]["input_ids"][1, -len(seqs[1]) - 1:].tolist() == [*seqs[1], eos]   # scored with its EOS


def test_show_rows_prints_the_trained_tokens(tmp_path, capsys):
    from scale.cli import main

    path = _write(tmp_path / "c.jsonl", [{"messages": m} for m in CHATS] * 4)
    code = main(["--config", str(TINY_YAML), f"data.path={path}", "data.eval_size=2", "data.max_length=128",
                 f"data.chat_template={CHATML}", "--show-rows", "2", f"output_dir={tmp_path / 'out'}"])
    out = capsys.readouterr().out
    assert code == 0 and not (tmp_path / "out").exists()
    assert out.startswith("format=messages; trained tokens between [[ and ]]\ndata: train_rows=10 eval_rows=2 ")
    assert "; trained tokens per row: train " in out.splitlines()[1]
    assert out.count("--- data-file row") == 2 and "<|im_start|>assistant\n[[" in out and "<|im_end|>]]" in out


# ---- resume on multi-turn chats (issue 17 acceptance) ----

def _run_launch(out, *extra):
    import os
    import subprocess

    from tests.launching import CHATS, TINY, accelerate_cmd

    job = ["--config", str(TINY), *CHATS, "data.max_train_examples=20", "train.micro_batch_size=2",
           "train.gradient_accumulation_steps=2", "train.max_steps=6", "train.log_every=1", "train.eval_every=0",
           "lora.dropout=0.1", "log.trackers=[]", f"output_dir={out}", *extra]
    proc = subprocess.run(accelerate_cmd("cpu_ddp.yaml") + job, env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=ROOT,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]


@pytest.mark.launch
def test_two_process_resume_on_multi_turn_chats_is_bit_exact(tmp_path):
    """2 ranks, micro-batch 2, GA 2, 20 chats: 3 steps an epoch; resumed from step 4 (inside epoch 2), steps 5-6
    and the adapter are bit-identical to the uninterrupted run."""
    from safetensors.torch import load_file

    from scale.training.metrics import read_jsonl

    ref, resumed = tmp_path / "ref", tmp_path / "resumed"
    _run_launch(ref, "train.save_every=4")
    _run_launch(resumed, f"train.resume_from={ref}/checkpoints/step_000004")
    losses = [{r["step"]: r["train/loss"] for r in read_jsonl(d / "metrics.jsonl") if "train/loss" in r}
              for d in (ref, resumed)]
    assert sorted(losses[1]) == [5, 6] and all(losses[1][s] == losses[0][s] for s in (5, 6))
    a, b = (load_file(d / "adapter" / "adapter_model.safetensors") for d in (ref, resumed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_resume_after_a_template_edit_is_refused(tmp_path):
    """C37 in one process: the template's text is in the checkpoint; an edited template stops the resume."""
    from scale.config.validation import ConfigError
    from scale.train import run
    from tests.conftest import tiny_cfg

    template = tmp_path / "t.jinja"
    shutil.copy(CHATML, template)
    path = _write(tmp_path / "c.jsonl", [{"messages": m} for m in CHATS] * 8)
    job = [f"data.path={path}", f"data.chat_template={template}", "data.eval_size=4", "data.max_length=128",
           "train.max_steps=2", "train.eval_every=0", "train.save_every=1"]
    run(tiny_cfg(tmp_path / "a", *job))
    _reset()
    template.write_text(template.read_text() + "\n")
    with pytest.raises(ConfigError, match=r"^data.chat_template changed since checkpoint .*step_000001"):
        run(tiny_cfg(tmp_path / "a", *job, "train.resume_from=" + str(tmp_path / "a" / "checkpoints" / "step_000001"),
                     "output_dir=" + str(tmp_path / "b")))
    _reset()


def _reset():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
