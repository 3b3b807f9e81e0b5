"""`scale-generate` as a chat (scale/generate.py) on a random tiny Llama saved as scale-export saves merged/: the
ChatML template, generation stopping at <|im_end|>. Each answer is checked against model.generate run here on the
template's tokens; sampling is reproducible by seed; bad input is one line and exit code 2, nothing on stdout."""

from __future__ import annotations

import copy
import functools
import io
import json

import pytest
import torch

from scale.config.schema import ModelConfig
from scale.generate import main, read_conversations, split_reference
from scale.generation.export import save_serving_files
from scale.generation.generator import Sampling
from scale.modeling.build import load_base
from tests.conftest import ROOT

CHATML = ROOT / "configs" / "chat" / "chatml.jinja"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Red."}, {"role": "user", "content": "Another one?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    """A merged/-like directory: a random tiny Llama, the SmolLM2 tokenizer with the ChatML template, and a
    generation_config stopping at EOS and <|im_end|>."""
    out = tmp_path_factory.mktemp("merged")
    tok = copy.deepcopy(tokenizer)  # the session's tokenizer stays as it was
    tok.chat_template = CHATML.read_text()
    model = load_base(ModelConfig(name_or_path="tiny-llama", dtype="float32", quantize_4bit=False), len(tok), 3)
    model.save_pretrained(out)
    save_serving_files(tok, [tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")], out, model.generation_config)
    return out


@functools.cache
def _loaded(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir), AutoModelForCausalLM.from_pretrained(model_dir).eval()


def _reference(model_dir, messages, max_new_tokens, **sampling):
    """model.generate on the template's tokens, done here without scale.generate: the expected answer."""
    tok, model = _loaded(model_dir)
    enc = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        ids = model.generate(**enc, max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id, **sampling)
    return tok.decode(ids[0, enc["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def _jsonl(capsys):
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_a_held_out_chat_is_answered_from_before_its_last_assistant_turn(model_dir, tmp_path, capsys):
    data = tmp_path / "chats.jsonl"
    whole = CHAT + [{"role": "assistant", "content": "Blue."}]
    data.write_text(json.dumps({"messages": whole}) + "\n\n" + json.dumps(CHAT) + "\n")  # a row, a bare list
    assert main([str(model_dir), "--messages", str(data), "--jsonl", "--max-new-tokens", "6"]) == 0
    first, second = _jsonl(capsys)
    expected = _reference(model_dir, CHAT, 6, do_sample=False)
    assert first == {"messages": CHAT + [{"role": "assistant", "content": expected}], "reference": "Blue."}
    assert second == {"messages": CHAT + [{"role": "assistant", "content": expected}]}


def test_chat_turns_carry_the_earlier_answers(model_dir, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("Name a colour.\n\nAnother one?\n"))  # stdin: a turn a line
    assert main([str(model_dir), "--chat", "--system", "Be brief.", "--jsonl", "--max-new-tokens", "5"]) == 0
    (record,) = _jsonl(capsys)
    m = record["messages"]
    assert [x["role"] for x in m] == ["system", "user", "assistant", "user", "assistant"]
    assert m[2]["content"] == _reference(model_dir, m[:2], 5, do_sample=False)
    assert m[4]["content"] == _reference(model_dir, m[:4], 5, do_sample=False)
    # the text output: one ">>> turn" line, then the answer, per turn
    monkeypatch.setattr("sys.stdin", io.StringIO("Name a colour.\nAnother one?\n"))
    assert main([str(model_dir), "--chat", "--system", "Be brief.", "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out == f">>> Name a colour.\n{m[2]['content']}\n>>> Another one?\n{m[4]['content']}\n"


def test_separate_prompts_get_the_system_turn_each(model_dir, capsys):
    assert main([str(model_dir), "--prompt", "Hi", "--prompt", "Bye", "--system", "Be brief.", "--jsonl",
                 "--max-new-tokens", "4"]) == 0
    records = _jsonl(capsys)
    for record, prompt in zip(records, ("Hi", "Bye"), strict=True):
        head = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": prompt}]
        assert record["messages"] == head + [{"role": "assistant",
                                              "content": _reference(model_dir, head, 4, do_sample=False)}]


def test_sampling_is_reproducible_by_seed(model_dir, capsys):
    args = [str(model_dir), "--prompt", "Name a colour.", "--temperature", "1.3", "--top-p", "0.95",
            "--max-new-tokens", "6", "--jsonl"]
    texts = []
    for seed in ("5", "5", "6"):
        assert main(args + ["--seed", seed]) == 0
        texts.append(_jsonl(capsys)[0]["messages"][-1]["content"])
    assert texts[0] == texts[1] != texts[2]
    torch.manual_seed(5)  # the same draw as scale-generate's: seeded once, then model.generate samples
    expected = _reference(model_dir, [{"role": "user", "content": "Name a colour."}], 6, do_sample=True,
                          temperature=1.3, top_p=0.95, top_k=0)
    assert texts[0] == expected
    assert texts[0] != _reference(model_dir, [{"role": "user", "content": "Name a colour."}], 6, do_sample=False)


@pytest.mark.parametrize("flags, phrase", [
    (["--temperature", "-0.5"], "--temperature -0.5: must be >= 0"),
    (["--top-p", "0"], "--top-p 0.0: must be in (0, 1]"),
    (["--top-p", "1.5"], "--top-p 1.5: must be in (0, 1]"),
    (["--top-k", "-1"], "--top-k -1: must be >= 0"),
    (["--max-new-tokens", "0"], "--max-new-tokens 0: must be >= 1"),
    (["--file", "/nonexistent/prompts.txt"], "--file /nonexistent/prompts.txt: cannot read it"),
    (["--messages", "-", "--prompt", "x"], "either as --messages or as --prompt"),
])
def test_bad_flags_are_one_line_and_exit_2(model_dir, capsys, monkeypatch, flags, phrase):
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert main([str(model_dir), "--prompt", "Hi", *flags] if "--prompt" not in flags else
                [str(model_dir), *flags]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and phrase in captured.err, captured.err


def test_bad_messages_lines_name_the_line(model_dir, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps(CHAT) + "\n{not json\n"))
    assert main([str(model_dir), "--messages", "-"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("scale-generate: error: stdin line 2: not JSON") and err.count("\n") == 1
    with pytest.raises(ValueError, match=r"x.jsonl line 3: expected a non-empty list of \{role, content\}"):
        read_conversations(["", json.dumps(CHAT), json.dumps({"messages": [{"role": "user"}]})], "x.jsonl")
    with pytest.raises(ValueError, match=r"x.jsonl line 1: nothing precedes the assistant turn"):
        read_conversations([json.dumps([{"role": "assistant", "content": "Hi."}])], "x.jsonl")
    call = {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "f"}}]}
    assert read_conversations([json.dumps(CHAT + [call, {"role": "tool", "content": "1"}])], "x") == [
        CHAT + [call, {"role": "tool", "content": "1"}]]


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory, tokenizer):
    """A merged/-like directory of a run trained without a chat template: the tokenizer saved without one, as
    training saves it (scale.generation.export.serving_tokenizer), stopping at EOS only."""
    out = tmp_path_factory.mktemp("plain")
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = None
    model = load_base(ModelConfig(name_or_path="tiny-llama", dtype="float32", quantize_4bit=False), len(tok), 3)
    model.save_pretrained(out)
    save_serving_files(tok, [tok.eos_token_id], out, model.generation_config)
    return out


@pytest.mark.parametrize("flags, asked", [
    (["--prompt", "Review: fine.\nSentiment:", "--system", "x"], "--system needs"),
    (["--prompt", "a", "--prompt", "b", "--chat"], "--chat needs"),
    (["--chat", "--prompt", "a", "--system", "x"], "--system, --chat need"),
    (["--messages", "-"], "--messages needs"),
    ([], "the interactive chat needs"),
])
def test_a_model_without_a_chat_template_refuses_conversations(plain_dir, capsys, monkeypatch, flags, asked):
    """--system, --chat, --messages (even one user turn) and the interactive chat are refused in one line, exit 2,
    before the model loads; nothing on stdout."""
    stdin = io.StringIO(json.dumps({"messages": [{"role": "user", "content": "Review: fine."}]}) + "\n")
    stdin.isatty = lambda: not flags  # no prompt on a terminal: the interactive chat
    monkeypatch.setattr("sys.stdin", stdin)
    monkeypatch.setattr("scale.generate.load_model", lambda path: pytest.fail("the model loaded before the check"))
    assert main([str(plain_dir), *flags]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (f"scale-generate: error: {plain_dir} has no chat template (its run trained on prompts as "
                            f"plain text, not rendered by one): {asked} one; give each prompt's text as it trained "
                            f"with --prompt, --file or stdin\n")


def test_a_model_without_a_chat_template_answers_the_text_as_it_is(plain_dir, capsys):
    """The prompt's own tokens (SmolLM2 adds no BOS), no template around them: the answer is model.generate's on
    exactly those tokens."""
    assert main([str(plain_dir), "--prompt", "Review: fine.\nSentiment:", "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    tok, model = _loaded(plain_dir)
    assert tok.chat_template is None
    enc = tok("Review: fine.\nSentiment:", return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        ids = model.generate(**enc, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    answer = tok.decode(ids[0, enc["input_ids"].shape[1]:], skip_special_tokens=True).strip()
    assert out == f">>> Review: fine.\nSentiment:\n{answer}\n"


def test_plain_prompts_get_the_bos_the_run_trained_with(tokenizer):
    """A tokenizer whose post-processor puts BOS in front (Llama): the plain prompt starts with it once, as the
    run's rows did (scale.data.tasks.base.Builder.front); SmolLM2's adds none."""
    from scale.generation.generator import plain_prompt_ids

    text = "Review: fine.\nSentiment:"
    plain = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert plain_prompt_ids(tokenizer, text) == plain  # no BOS to add
    bos = copy.deepcopy(tokenizer)
    from tokenizers.processors import TemplateProcessing

    bos._tokenizer.post_processor = TemplateProcessing(single="<|endoftext|> $A", special_tokens=[
        ("<|endoftext|>", bos.convert_tokens_to_ids("<|endoftext|>"))])
    first = bos.convert_tokens_to_ids("<|endoftext|>")
    assert bos(text)["input_ids"] == [first, *plain]  # the tokenizer now adds a BOS
    assert plain_prompt_ids(bos, text) == [first, *plain]
    assert plain_prompt_ids(bos, "<|endoftext|>" + text) == [first, *plain]  # once, even when the text has it


def test_serving_tokenizer_keeps_a_template_only_for_chat_rows(tmp_path):
    """What training saves in adapter/: no chat template (and EOS as the only stop) for rows no template rendered,
    the run's data.chat_template for chats; a run directory's saved tokenizer is read as it is."""
    from scale.generation.export import serving_tokenizer
    from tests.conftest import tiny_cfg

    cfg = tiny_cfg(tmp_path, f"data.chat_template={CHATML}")
    plain, stops, note = serving_tokenizer(cfg, chat=False)
    assert plain.chat_template is None and stops == [plain.eos_token_id] and "without a chat template" in note
    chat, stops, _ = serving_tokenizer(cfg, chat=True)
    assert chat.chat_template == CHATML.read_text() and stops == [plain.eos_token_id]  # SmolLM2: <|im_end|> is EOS
    save_serving_files(plain, [plain.eos_token_id], tmp_path / "adapter")
    saved, stops, note = serving_tokenizer(cfg, tmp_path, chat=True)  # the saved tokenizer wins
    assert saved.chat_template is None and stops == [plain.eos_token_id]
    assert note == (f"the tokenizer saved in {tmp_path / 'adapter'}, without a chat template: the run's rows were not "
                    f"rendered by one, so prompts are used as they are (a chat request has no template to apply)")


def test_split_reference_and_sampling_kwargs():
    assert split_reference(CHAT + [{"role": "assistant", "content": "Blue."}]) == (CHAT, "Blue.")
    assert split_reference(CHAT) == (CHAT, None)
    assert Sampling().generate_kwargs() == {"do_sample": False, "max_new_tokens": 256}
    assert Sampling(temperature=0.7, top_p=0.9, top_k=0, max_new_tokens=8).generate_kwargs() == {
        "do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 0, "max_new_tokens": 8}
