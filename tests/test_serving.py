"""A trained chat run serves as it trained (scale/generation/export.py, scale/generate.py): the trained chat template
and end-of-turn stop travel with adapter/ and merged/; plain transformers generates from merged/ and stops, and
`transformers serve` (OpenAI-compatible, on 127.0.0.1) answers a held-out chat exactly as `scale-generate` and the
run's own samples.jsonl did."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from scale.generate import main as generate_main
from scale.generation.export import merge_run
from scale.generation.generator import generate_texts, load_for_generation, render_prompt
from scale.train import run
from tests.conftest import CHAT_SYSTEM, ROOT, tiny_cfg
from tests.launching import free_port

CHATML = ROOT / "configs" / "chat" / "chatml.jinja"


def _chats(path, n=40):
    rows = [{"messages": [{"role": "user", "content": f"Say something about item {i}."},
                          {"role": "assistant", "content": "OK"}]} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.slow
def test_merged_model_serves_the_trained_template_and_stops(tmp_path):
    data = _chats(tmp_path / "chats.jsonl")
    out = tmp_path / "run"
    run(tiny_cfg(out, f"data.path={data}", "data.format=messages", f"data.chat_template={CHATML}",
                 "data.eval_size=8", "train.max_steps=4", "optim.lr=1e-2", "optim.schedule=constant",
                 "optim.warmup_steps=0", "train.micro_batch_size=8", "train.gradient_accumulation_steps=1",
                 "train.eval_every=0", "train.log_every=10", "log.peak_flops=false"))
    merged = merge_run(out)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(merged)
    assert tok.chat_template.strip() == CHATML.read_text().strip()
    assert AutoTokenizer.from_pretrained(out / "adapter").chat_template.strip() == CHATML.read_text().strip()
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    gen = json.loads((merged / "generation_config.json").read_text())
    gen["eos_token_id"] = gen["eos_token_id"] if isinstance(gen["eos_token_id"], list) else [gen["eos_token_id"]]
    assert im_end in gen["eos_token_id"] and tok.eos_token_id in gen["eos_token_id"]  # (SmolLM2: both are id 2)
    model = AutoModelForCausalLM.from_pretrained(merged)  # plain transformers, no scale code
    prompt = tok.apply_chat_template([{"role": "user", "content": "Say something about item 99."}],
                                     add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        ids = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    new = ids[0, prompt["input_ids"].shape[1]:].tolist()
    # whatever it answers, it never generates past an end-of-turn marker (merged/'s generation_config stops there)
    assert all(t not in gen["eos_token_id"] for t in new[:-1]), [tok.decode([t]) for t in new]
    for path in (merged, out):  # scale-generate: merged/ and base + adapter answer alike, greedily
        model, tokenizer, stops = load_for_generation(path)
        assert sorted(stops) == sorted(gen["eos_token_id"])
        answers = generate_texts(model, tokenizer, [render_prompt(tokenizer, "Say something about item 99.")],
                                 stops, 12)
        assert answers == [tok.decode(new, skip_special_tokens=True).strip()]



def _wait_until_serving(proc, port, timeout_s=180.0):
    """Poll ``GET /v1/models`` until the server answers; fail at once when the process has exited."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"transformers serve exited with {proc.returncode}:\n{proc.stdout.read()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as r:
                return json.loads(r.read())
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"transformers serve did not answer on 127.0.0.1:{port} within {timeout_s} s")


def _stop(proc):
    """SIGTERM the server by its process id (uvicorn shuts down cleanly), SIGKILL after 30 s."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


@pytest.mark.launch
def test_transformers_serve_answers_as_scale_generate_and_samples(chat_run, tmp_path, capsys):
    """A held-out two-turn chat, greedy: `transformers serve` on merged/ (through the OpenAI client), `scale-generate`
    on merged/ and on base + adapter/, and the run's own samples.jsonl give the same text, which is the trained
    answer, and the server stops at the end-of-turn marker (finish_reason "stop", the marker its last token)."""
    from openai import OpenAI
    from transformers import AutoTokenizer

    out, merged, rows = chat_run
    final = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()][-1]
    assert final["step"] == 30
    held_out = rows[final["row"]]["messages"]
    prompt, reference = held_out[:-1], held_out[-1]["content"]
    assert final["prompt"] == AutoTokenizer.from_pretrained(merged).apply_chat_template(
        prompt, add_generation_prompt=True, tokenize=False)  # the run's sample prompt is what a server renders
    assert final["completion"] == reference == "Added that one too."  # the run learnt the answer

    chat_file = tmp_path / "held_out.jsonl"
    chat_file.write_text(json.dumps({"messages": held_out}) + "\n")
    answers = {}
    for path in (merged, out):  # scale-generate, as a user runs it: merged/, then base + adapter/
        capsys.readouterr()
        assert generate_main([str(path), "--messages", str(chat_file), "--jsonl", "--max-new-tokens", "32"]) == 0
        record = json.loads(capsys.readouterr().out)
        assert record["messages"][:-1] == prompt and record["reference"] == reference
        answers[path.name] = record["messages"][-1]["content"]
    assert answers == {"merged": reference, "run": reference}

    port = free_port()
    exe = Path(sys.executable).parent / "transformers"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([str(exe), "serve", str(merged), "--host", "127.0.0.1", "--port", str(port),
                             "--device", "cpu"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        listed = _wait_until_serving(proc, port)
        assert [m["id"] for m in listed["data"]] == [str(merged)]
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        reply = client.chat.completions.create(model=str(merged), messages=prompt, temperature=0, max_tokens=32)
        choice = reply.choices[0]
        assert choice.message.content == reference
        assert choice.finish_reason == "stop"
        tok = AutoTokenizer.from_pretrained(merged)
        assert reply.usage.completion_tokens == len(tok(reference, add_special_tokens=False)["input_ids"]) + 1
        assert reply.usage.prompt_tokens == len(tok(final["prompt"], add_special_tokens=False)["input_ids"])
        # `transformers chat` against the same server, turns piped in: the first turn's trained answer, then the
        # held-out one. Its client refuses 127.0.0.1 under HF_HUB_OFFLINE=1, so that variable is dropped here.
        chat_env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"} | {"COLUMNS": "200"}
        turns = f"{prompt[1]['content']}\n{prompt[3]['content']}\n"
        chat = subprocess.run([str(exe), "chat", str(merged), f"http://127.0.0.1:{port}", "--system-prompt",
                               CHAT_SYSTEM, "do_sample=False", "max_new_tokens=32"], input=turns, capture_output=True,
                              text=True, env=chat_env, cwd=tmp_path, timeout=120, check=False)  # EOF: "Aborted!"
        lines = chat.stdout.splitlines()
        said = [lines[i + 1].strip() for i, line in enumerate(lines[:-1]) if line.strip() == f"<{merged}>:"]
        assert said == [prompt[2]["content"], reference], chat.stdout[-2000:]
    finally:
        _stop(proc)
    assert proc.returncode is not None
