"""Issue 28: every trained token is one the template renders where the turn is. Spans from rendering positions only
(a Qwen3-style template that renders history turns differently, with the answer repeated in the user's turn), the
reasoning of earlier turns counted or trained as the last turn, OpenAI string arguments decoded once, tool calls on
plain ChatML refused, truncation at message boundaries with its counts, and ``loss.threshold: all`` against a
hand-computed full-sequence NLL."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from scale.config.load import load_config
from scale.config.schema import DataConfig, LossConfig, ModelConfig
from scale.data import Collator, DataError, build_splits, load_rows, removed_lines, tokenize_rows
from scale.loss.tail import forward_tail, tail_loss, token_weights
from scale.modeling.build import load_base
from tests.conftest import ROOT

CHATML_TOOLS = ROOT / "configs" / "chat" / "chatml_tools.jinja"
# Modelled on Qwen3's public template: an assistant turn after the last user turn renders a <think> block (empty
# when the turn has no reasoning) when it is the last turn or has reasoning; earlier turns render their answer only.
QWEN3_STYLE = (
    "{%- set ns = namespace(last_query=messages|length - 1, found=false) %}"
    "{%- for m in messages[::-1] %}{%- set idx = (messages|length - 1) - loop.index0 %}"
    "{%- if not ns.found and m.role == 'user' %}{%- set ns.found = true %}{%- set ns.last_query = idx %}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role != 'assistant' %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- else %}{%- set r = m.reasoning_content if m.reasoning_content is string else '' %}"
    "{%- if loop.index0 > ns.last_query and (loop.last or r) %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + r.strip('\\n') + '\\n</think>\\n\\n' + m.content }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + m.content }}{%- endif %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def _template(tmp_path, text, name="t.jinja"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _runs(tok, e):
    """``[(text before the run, trained text)]`` for each run of trained tokens of an example."""
    flags = [0] * (len(e.input_ids) - e.tail_len) + e.tail_flags()
    out, j = [], 0
    while j < len(flags):
        if flags[j]:
            k = j
            while k < len(flags) and flags[k]:
                k += 1
            out.append((tok.decode(e.input_ids[:j]), tok.decode(e.input_ids[j:k])))
            j = k
        else:
            j += 1
    return out


def _yes_no(q1, a1, q2, a2, **extra):
    turns = [{"role": "user", "content": f"{q1} Answer Yes or No."}, {"role": "assistant", "content": a1, **extra},
             {"role": "user", "content": f"{q2} Answer Yes or No."}, {"role": "assistant", "content": a2, **extra}]
    return {"messages": turns}


def test_a_turn_rendered_otherwise_in_history_trains_where_it_is(tmp_path, tokenizer):
    """The answer 'Yes' also stands in the user's 'Answer Yes or No.': the earlier turn (rendered without its
    <think> block once a later turn follows) is trained right after its own '<|im_start|>assistant\\n', and the
    last turn with its block; nothing of a user turn is trained."""
    cfg = DataConfig(chat_template=_template(tmp_path, QWEN3_STYLE), max_length=128)
    rows = load_rows(cfg, _write(tmp_path / "c.jsonl", [_yes_no("Is Paris in France?", "Yes", "Is the sun a planet?",
                                                                 "No")]))
    (e,) = tokenize_rows(rows, tokenizer, cfg, LossConfig())
    runs = _runs(tokenizer, e)
    assert [t for _, t in runs] == ["Yes<|im_end|>", "<think>\n\n</think>\n\nNo<|im_end|>"]
    assert all(before.endswith("<|im_start|>assistant\n") for before, _ in runs)
    assert runs[0][0] == "<|im_start|>user\nIs Paris in France? Answer Yes or No.<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(e.input_ids) == tokenizer.apply_chat_template(rows[0]["messages"], tokenize=False,
                                                                          chat_template=QWEN3_STYLE).rstrip("\n")


def test_history_reasoning_is_counted_or_trained_as_the_last_turn(tmp_path, tokenizer, caplog):
    """Reasoning of an earlier turn that the template renders only for the last turn: all_assistant (default)
    trains the turn as history and counts the block; all_assistant_as_last makes a row per turn, each the last
    turn of its row, its reasoning trained."""
    rows = [_yes_no(f"Question {i}?", f"Yes {i}", f"Again {i}?", f"No {i}", reasoning_content=f"Thought {i}.")
            for i in range(4)]
    path = _write(tmp_path / "c.jsonl", rows)
    template = _template(tmp_path, QWEN3_STYLE)
    history = build_splits(DataConfig(chat_template=template, max_length=160, eval_size=1), LossConfig(), tokenizer,
                           path, seed=0)
    assert [t for _, t in _runs(tokenizer, history.train[0])] == [
        f"Yes {history.train[0].row}<|im_end|>",
        f"<think>\nThought {history.train[0].row}.\n</think>\n\nNo {history.train[0].row}<|im_end|>"]
    assert (history.stats["data/train_history_reasoning_dropped"], history.stats["data/eval_history_reasoning_dropped"],
            history.stats["data/train_reasoning_not_rendered"]) == (3, 1, 0)
    (line,) = removed_lines(history.stats, DataConfig(train_on="all_assistant"))
    assert line == ("4 reasoning blocks of earlier assistant turns are not trained (3 train, 1 eval): the chat "
                    "template renders those turns as history, without it; data.train_on=all_assistant_as_last trains "
                    "each turn as the last of its own row, with its reasoning")
    as_last = build_splits(DataConfig(chat_template=template, max_length=160, eval_size=1,
                                      train_on="all_assistant_as_last"), LossConfig(), tokenizer, path, seed=0)
    assert len(as_last.train) == 6 and len(as_last.eval) == 2 and as_last.stats["data/train_rows"] == 6
    first, second = as_last.train[:2]
    i = first.row
    assert second.row == i and [t for _, t in _runs(tokenizer, first)] == [
        f"<think>\nThought {i}.\n</think>\n\nYes {i}<|im_end|>"]
    assert [t for _, t in _runs(tokenizer, second)] == [f"<think>\nThought {i}.\n</think>\n\nNo {i}<|im_end|>"]
    assert f"Yes {i}<|im_end|>" in tokenizer.decode(second.input_ids[:-second.tail_len])   # the first turn as history
    assert as_last.stats["data/train_history_reasoning_dropped"] == 0
    assert removed_lines(as_last.stats, DataConfig()) == []


def test_a_turn_with_no_exact_location_is_one_line_naming_template_and_turn(tmp_path, tokenizer):
    """History turns closed by another marker than the last turn's: no end of the last-turn rendering is there."""
    text = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
            "{% if m.role == 'assistant' and not loop.last %}<|endoftext|>{% else %}<|im_end|>{% endif %}\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    template = _template(tmp_path, text, "odd.jinja")
    cfg = DataConfig(chat_template=template, max_length=128)
    rows = load_rows(cfg, _write(tmp_path / "c.jsonl", [_yes_no("A?", "Yes", "B?", "No")]))
    with pytest.raises(DataError) as err:
        tokenize_rows(rows, tokenizer, cfg, LossConfig())
    assert str(err.value) == (
        f"row 0: data.chat_template={template} renders assistant message 1 differently once later messages follow "
        f"(as history), and its rendering there is no end of its rendering as the last turn, so its span has no "
        f"exact location; set data.train_on=all_assistant_as_last (every assistant turn the last of a row of its "
        f"own) or data.train_on=last_assistant")
    (a, b) = tokenize_rows(rows, tokenizer, DataConfig(chat_template=template, max_length=128,
                                                       train_on="all_assistant_as_last"), LossConfig())
    assert [t for _, t in _runs(tokenizer, a)] == ["Yes<|im_end|>"] and [t for _, t in _runs(tokenizer, b)] == [
        "No<|im_end|>"]


def _tool_chat(city, as_string):
    args = {"city": city}
    call = {"type": "function", "function": {"name": "get_weather",
                                             "arguments": json.dumps(args) if as_string else args}}
    return {"tools": [WEATHER], "messages": [
        {"role": "user", "content": f"Weather in {city}?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "name": "get_weather", "content": json.dumps({"celsius": 12})},
        {"role": "assistant", "content": f"12 degrees in {city}."}]}


def test_openai_string_arguments_train_as_the_mapping(tmp_path, tokenizer):
    """OpenAI's format carries arguments as a JSON string: decoded once, the rows train exactly what the mapping
    trains (not a double-encoded "{\\"city\\": ...}"); a string that is not JSON is one line naming the row."""
    cfg = DataConfig(chat_template="chatml_tools", max_length=512)
    mapped = load_rows(cfg, _write(tmp_path / "m.jsonl", [_tool_chat(c, False) for c in ("Oslo", "Lima")]))
    strings = load_rows(cfg, _write(tmp_path / "s.jsonl", [_tool_chat(c, True) for c in ("Oslo", "Lima")]))
    assert strings[0]["messages"][1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    a, b = tokenize_rows(mapped, tokenizer, cfg, LossConfig()), tokenize_rows(strings, tokenizer, cfg, LossConfig())
    assert [e.input_ids for e in a] == [e.input_ids for e in b] and [e.trained for e in a] == [e.trained for e in b]
    assert [t for _, t in _runs(tokenizer, b[0])] == [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>',
        "12 degrees in Oslo.<|im_end|>"]
    bad = _tool_chat("Oslo", True)
    bad["messages"][1]["tool_calls"][0]["function"]["arguments"] = "{city: Oslo}"
    with pytest.raises(DataError, match=r"^row 0 \(line 1\) of .*: message 1 calls 'get_weather' with arguments "
                                        r"that are not JSON \(Expecting property name enclosed in double quotes"):
        load_rows(cfg, _write(tmp_path / "bad.jsonl", [bad]))


def test_chatml_tools_renders_as_qwen25_and_hermes(tokenizer):
    """The shipped tool-aware template: schemas in <tools> in the system turn, the call in <tool_call>, the
    result in <tool_response> inside a user turn; no default system prompt."""
    chat = _tool_chat("Oslo", False)
    text = tokenizer.apply_chat_template(chat["messages"], tools=chat["tools"], tokenize=False,
                                         chat_template=CHATML_TOOLS.read_text())
    assert text == (
        "<|im_start|>system\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are "
        "provided with function signatures within <tools></tools> XML tags:\n<tools>\n" + json.dumps(WEATHER) +
        "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
        "<args-json-object>}\n</tool_call><|im_end|>\n<|im_start|>user\nWeather in Oslo?<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n"
        "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n{\"celsius\": 12}\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n12 degrees in Oslo.<|im_end|>\n")
    plain = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                          add_generation_prompt=True, chat_template=CHATML_TOOLS.read_text())
    assert plain == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("drop", ["tools", "calls"])
def test_tools_on_plain_chatml_are_refused_naming_chatml_tools(tmp_path, capsys, drop):
    """Plain ChatML renders neither tool calls nor tools: one line, exit 2, nothing written, never an empty trained
    '[[<|im_end|>]]' turn."""
    from tests.test_bad_input import _cli

    rows = [_tool_chat(f"City{i}", False) for i in range(40)]
    for r in rows:
        if drop == "calls":  # only the tools column
            r["messages"] = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    code, err = _cli(tmp_path, capsys, f"data.path={_write(tmp_path / 'c.jsonl', rows)}",
                     f"data.chat_template={ROOT / 'configs' / 'chat' / 'chatml.jinja'}", "data.max_length=256")
    what = ("the 'tools' column (tool schemas), so the model would learn to call tools it is never shown" if
            drop == "calls" else "tool calls (message 1 has tool_calls), so that assistant turn would train as an "
                                 "empty turn")
    assert code == 2 and err.startswith(f"row ") and err.endswith(
        f"chatml.jinja does not render {what}; set data.chat_template=chatml_tools (shipped: ChatML with <tools> and "
        f"<tool_call>, as Qwen2.5 and Hermes render them) or the tool-aware template of the model's family")


def test_an_empty_earlier_turn_is_not_trained_and_counted(tmp_path, tokenizer):
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""},
            {"role": "user", "content": "Hello?"}, {"role": "assistant", "content": "Yes, hello."}]
    path = _write(tmp_path / "c.jsonl", [{"messages": chat}] * 3)
    splits = build_splits(DataConfig(chat_template=str(ROOT / "configs" / "chat" / "chatml.jinja"), eval_size=1,
                                     max_length=128), LossConfig(), tokenizer, path, seed=0)
    assert [t for _, t in _runs(tokenizer, splits.train[0])] == ["Yes, hello.<|im_end|>"]
    assert (splits.stats["data/train_empty_turns"], splits.stats["data/eval_empty_turns"]) == (2, 1)
    assert removed_lines(splits.stats, DataConfig()) == [
        "3 assistant turns render as no text but their end-of-turn marker (an empty message) and are not trained "
        "(2 train, 1 eval)"]


def _long_chat(i):
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": f"C{i}"}}}
    return {"tools": [WEATHER], "messages": [
        {"role": "system", "content": "You are brief."},
        {"role": "user", "content": f"Weather in C{i}?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "get_weather", "content": "12"},
        {"role": "assistant", "content": "12 degrees."},
        {"role": "user", "content": "And tomorrow, in words, please, with some detail?"},
        {"role": "assistant", "content": "Rain all day, I am afraid."},
        {"role": "user", "content": f"Thanks {i}!"},
        {"role": "assistant", "content": "You are welcome."}]}


def _length(tok, messages, tools):
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, chat_template=CHATML_TOOLS.read_text())
    return len(tok(text.rstrip("\n"), add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("keep_system", [True, False])
def test_truncation_cuts_whole_messages_and_counts_what_went(tmp_path, tokenizer, keep_system):
    """A chat over data.max_length loses its oldest exchanges whole (a tool call with its turn, the system turn
    last): the row starts with a turn's marker, never inside one, and every removed assistant turn, tool call and
    system turn is counted per split; data.truncation=drop drops the rows instead (counted)."""
    rows = [_long_chat(i) for i in range(3)]
    m = rows[0]["messages"]
    limit = _length(tokenizer, ([m[0]] if keep_system else []) + m[7:], rows[0]["tools"])
    path = _write(tmp_path / "c.jsonl", rows + [{"tools": [WEATHER], "messages": m[7:]}] * 2)
    cfg = DataConfig(chat_template="chatml_tools", max_length=limit, eval_size=1)
    splits = build_splits(cfg, LossConfig(), tokenizer, path, seed=0)
    long = [e for e in splits.train + splits.eval if e.row < 3]
    assert len(long) == 3 and all(len(e.input_ids) <= limit for e in long)
    for e in long:
        text = tokenizer.decode(e.input_ids)
        assert text.startswith("<|im_start|>system\n") and text.count("<|im_start|>") == 3  # tools, user, answer
        assert ("You are brief." in text) == keep_system and [t for _, t in _runs(tokenizer, e)] == [
            "You are welcome.<|im_end|>"]
    count = {k.split("_", 1)[1]: splits.stats[f"data/train_{k.split('_', 1)[1]}"] +
             splits.stats[f"data/eval_{k.split('_', 1)[1]}"] for k in ("x_rows_truncated", "x_turns_cut",
                                                                          "x_tool_calls_cut", "x_system_cut")}
    assert count == {"rows_truncated": 3, "turns_cut": 9, "tool_calls_cut": 3, "system_cut": 0 if keep_system else 3}
    (line,) = removed_lines(splits.stats, cfg)
    assert line.startswith(f"data.max_length={limit} cut the start of ") and (
        "removing 9 assistant turn(s), not trained, 3 tool call(s)" in line) and line.endswith(
        "; a larger data.max_length keeps them, data.truncation=drop drops such rows")
    drop = DataConfig(chat_template="chatml_tools", max_length=limit, truncation="drop")
    assert [e.row for e in tokenize_rows(load_rows(drop, path), tokenizer, drop, LossConfig())] == [3, 4]


def test_a_last_exchange_too_long_loses_the_start_of_its_user_text_not_its_markers(tmp_path, tokenizer):
    """The last exchange alone over data.max_length: the start of its user turn's text goes (found from renderings
    with other text in its place), the turn's '<|im_start|>user\n' stays; a limit that leaves no room for the
    markers and the answer is one line naming the row, or the row is dropped with data.drop_long_completions."""
    plain = str(ROOT / "configs" / "chat" / "chatml.jinja")
    question = "Please read all of this long question with many words before you answer: is it long?"
    chat = [{"role": "user", "content": question}, {"role": "assistant", "content": "Yes."}]
    path = _write(tmp_path / "c.jsonl", [{"messages": chat}] * 3)
    whole = len(tokenizer(tokenizer.apply_chat_template(chat, tokenize=False, chat_template=open(plain).read())
                          .rstrip("\n"), add_special_tokens=False)["input_ids"])
    cfg = DataConfig(chat_template=plain, max_length=whole - 5, eval_size=1)
    splits = build_splits(cfg, LossConfig(), tokenizer, path, seed=0)
    e = splits.train[0]
    text = tokenizer.decode(e.input_ids)
    assert len(e.input_ids) == whole - 5 and text.startswith("<|im_start|>user\n") and text.endswith(
        " is it long?<|im_end|>\n<|im_start|>assistant\nYes.<|im_end|>")
    assert question not in text and [t for _, t in _runs(tokenizer, e)] == ["Yes.<|im_end|>"]
    assert (splits.stats["data/train_user_text_cut"], splits.stats["data/eval_user_text_cut"],
            splits.stats["data/train_rows_truncated"], splits.stats["data/train_turns_cut"]) == (2, 1, 2, 0)
    assert "removing 3 user text start(s)" in removed_lines(splits.stats, cfg)[0]
    rows = load_rows(cfg, path)
    tight = DataConfig(chat_template=plain, max_length=8)   # '<|im_start|>user\n' ... 'Yes.<|im_end|>' need more
    with pytest.raises(DataError, match=r"^row 0: the conversation does not fit in data.max_length=8 tokens even cut "
                                        r"to its last exchange with the start of its user turn's text cut"):
        tokenize_rows(rows[:1], tokenizer, tight, LossConfig())
    assert tokenize_rows(rows, tokenizer, DataConfig(chat_template=plain, max_length=8, drop_long_completions=True),
                         LossConfig()) == []


@torch.no_grad()
def test_threshold_all_trains_the_whole_text_as_a_full_sequence_nll(tmp_path, tokenizer):
    """loss.threshold: all (TRL's dataset_text_field, axolotl's type: completion): every token after the first is
    trained; the harness's tail loss of a padded batch equals the NLL of the whole sequences computed by hand from
    full logits (mean over every predicted token), relative 1e-6."""
    texts = ["The cat sat on the mat.", "A much longer line of plain text to model, token by token, here.", "Hi"]
    rows = load_rows(DataConfig(format="text"), _write(tmp_path / "t.jsonl", [{"text": t} for t in texts]))
    loss_cfg = LossConfig(threshold="all")
    examples = tokenize_rows(rows, tokenizer, DataConfig(format="text", max_length=64), loss_cfg)
    assert [e.tail_len for e in examples] == [len(e.input_ids) - 1 for e in examples]
    assert examples[2].input_ids == [*tokenizer("Hi", add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
    model = load_base(ModelConfig(name_or_path="tiny-llama"), vocab_size=len(tokenizer), seed=3).eval()
    batch = Collator(tokenizer.pad_token_id, "left")(examples)
    tail_logits, targets = forward_tail(model, batch, padding_side="left")
    num, den = tail_loss(tail_logits, targets, token_weights(batch["type_indicator"], batch["tail_mask"], None))
    nll, n = 0.0, 0
    for e in examples:
        ids = torch.tensor([e.input_ids])
        logits = model(input_ids=ids).logits[0].double()                    # [T, V]
        nll += F.cross_entropy(logits[:-1], ids[0, 1:], reduction="sum").item()
        n += len(e.input_ids) - 1
    assert den.item() == n and (num / den).item() == pytest.approx(nll / n, rel=1e-6)


def test_threshold_all_config_show_rows_and_plan(tmp_path, capsys, tokenizer):
    from scale.cli import main
    from scale.config.validation import ConfigError
    from scale.planner.plan import data_tail

    assert load_config("tiny_cpu", ["loss.threshold=all"]).loss.threshold == "all"
    for bad in ("0", "some"):
        with pytest.raises(ConfigError, match=f"loss.threshold={bad if bad == '0' else repr(bad)} must be a number"):
            load_config("tiny_cpu", [f"loss.threshold={bad}"])
    path = _write(tmp_path / "t.jsonl", [{"text": f"line number {i} of some plain text"} for i in range(12)])
    job = ["--config", "tiny_cpu", f"data.path={path}", "data.format=text", "data.eval_size=2", "loss.threshold=all",
           f"output_dir={tmp_path / 'out'}"]
    assert main([*job, "--show-rows", "1"]) == 0
    out = capsys.readouterr().out
    head = next(line for line in out.splitlines() if line.startswith("--- data-file row"))
    n = int(head.split(": ")[1].split(" tokens")[0])
    assert head.endswith(f"{n} tokens, {n - 1} trained") and out.endswith(" of some plain text<|im_end|>]]\n")
    assert out.splitlines()[-1].startswith("line[[ number ")   # every token after the first
    cfg = load_config("tiny_cpu", job[2:] + ["data.cache=false"])   # scale-plan sizes the whole row's tail
    longest = max(len(tokenizer(f"line number {i} of some plain text")["input_ids"]) for i in range(12))  # + EOS - 1
    assert data_tail(cfg)[0] == longest
    missing = load_config("tiny_cpu", ["data.path=/nonexistent.jsonl", "loss.threshold=all", "data.max_length=64"])
    assert data_tail(missing)[0] == 63


def test_history_turns_without_the_generation_prompts_think_block(tmp_path, tokenizer):
    """Qwen3 with enable_thinking: false opens every generation with an empty <think> block that history turns lack:
    an earlier turn starts after the part of its generation prompt the conversation holds ('<|im_start|>assistant\\n'),
    the last one after the whole prompt."""
    text = QWEN3_STYLE.replace("{{- '<|im_start|>assistant\\n' }}{%- endif %}",
                               "{{- '<|im_start|>assistant\\n' }}{%- if enable_thinking is defined and enable_thinking "
                               "is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")
    assert text != QWEN3_STYLE
    cfg = DataConfig(chat_template=_template(tmp_path, text), chat_template_kwargs={"enable_thinking": False},
                     max_length=128)
    rows = load_rows(cfg, _write(tmp_path / "c.jsonl", [_yes_no("Is Paris in France?", "Yes", "Is the sun a planet?",
                                                                 "No")]))
    (e,) = tokenize_rows(rows, tokenizer, cfg, LossConfig())
    runs = _runs(tokenizer, e)
    assert [t for _, t in runs] == ["Yes<|im_end|>", "No<|im_end|>"]
    assert runs[0][0].endswith("Answer Yes or No.<|im_end|>\n<|im_start|>assistant\n")
    assert runs[1][0].endswith("Answer Yes or No.<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
