"""A trained chat run serves as it trained (scale/export.py, scale/generate.py): the trained chat template and
end-of-turn stop travel with adapter/ and merged/; plain transformers generates from merged/ and stops."""

from __future__ import annotations

import json

import pytest
import torch

from scale.export import merge_run
from scale.generate import generate_texts, load_for_generation, render_prompt
from scale.train import run
from tests.conftest import ROOT, tiny_cfg

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
