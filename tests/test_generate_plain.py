"""A run whose rows no chat template rendered (the tiny classification job) serves as it trained: adapter/ and
merged/ carry no chat template (not the tokenizer's own), `scale-generate` answers each prompt's text as it is,
exactly as the run's samples.jsonl did, refuses the chat flags in one line, and `scale-export`/`scale-generate`
write only their own plain log lines on stderr (no third-party notice, warning or progress bar)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from scale.generate import main
from scale.train import run
from tests.conftest import ROOT, tiny_cfg

STAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ")  # the log format's asctime


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    """The tiny classification job at lr 1e-2 (it then answers a label: non-empty completions), every eval row
    generated at the end; exported by the `scale-export` command in a process of its own (its stderr kept)."""
    out = tmp_path_factory.mktemp("plain_run") / "run"
    run(tiny_cfg(out, "optim.lr=1e-2", "eval.generate_samples=8", "train.eval_every=0", "log.peak_flops=false"))
    env = {k: v for k, v in os.environ.items() if k not in ("SCALE_PROGRESS", "HF_HUB_DISABLE_PROGRESS_BARS")}
    export = subprocess.run([sys.executable, "-m", "scale.export", str(out)], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=300)
    assert export.returncode == 0, export.stderr
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    return out, [s for s in samples if s["step"] == 12], export


@pytest.mark.slow
def test_adapter_and_merged_carry_no_chat_template_and_export_says_so(plain_run):
    from transformers import AutoTokenizer

    out, _, export = plain_run
    merged = out / "merged"
    for d in (out / "adapter", merged):
        assert not (d / "chat_template.jinja").exists()
        assert json.loads((d / "tokenizer_config.json").read_text()).get("chat_template") is None
        assert AutoTokenizer.from_pretrained(d).chat_template is None
        assert json.loads((d / "generation_config.json").read_text())["eos_token_id"] == 2  # EOS only
    lines = export.stderr.splitlines()
    assert all(STAMP.match(line) for line in lines), export.stderr  # scale-train's format, nothing else
    assert [STAMP.sub("", line) for line in lines] == [
        f"INFO scale.export: {merged}: the tokenizer saved in {out / 'adapter'}, without a chat template: the run's "
        f"rows were not rendered by one, so prompts are used as they are (a chat request has no template to apply)",
        f"INFO scale.export: merged model written to {merged}"]
    assert export.stdout == ""


@pytest.mark.slow
def test_scale_generate_answers_as_the_runs_samples(plain_run, capsys):
    """Greedy, with the budget the evaluation had (the label's tokens and EOS): every held-out prompt of the last
    evaluation gets samples.jsonl's completion, from base + adapter/ and from merged/."""
    from transformers import AutoTokenizer

    out, final, _ = plain_run
    assert len(final) == 8 and all(s["completion"] for s in final)  # answers, not empty strings
    assert {s["completion"] for s in final} <= {"negative", "positive"}
    tok = AutoTokenizer.from_pretrained(out / "adapter")
    budgets = {len(tok(" " + s["reference"], add_special_tokens=False)["input_ids"]) + 1 for s in final}
    assert budgets == {2}  # the label (one token) and EOS
    for path in (out, out / "merged"):
        flags = [x for s in final for x in ("--prompt", s["prompt"])]
        assert main([str(path), *flags, "--max-new-tokens", "2", "--jsonl"]) == 0
        answers = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
        assert [a["messages"][0]["content"] for a in answers] == [s["prompt"] for s in final]
        assert [a["messages"][-1]["content"] for a in answers] == [s["completion"] for s in final], path


@pytest.mark.slow
def test_scale_generate_command_is_quiet_and_refuses_chat_flags(plain_run):
    """`scale-generate` in a process of its own: the answer on stdout, nothing on stderr (bitsandbytes' hub-kernel
    notice, transformers' is_gradient_checkpointing FutureWarning: gone); --system is one line, exit 2."""
    out, final, _ = plain_run
    env = {k: v for k, v in os.environ.items() if k != "SCALE_PROGRESS"}
    cmd = [sys.executable, "-m", "scale.generate", str(out), "--prompt", final[0]["prompt"], "--max-new-tokens", "2"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert (proc.returncode, proc.stderr) == (0, "")
    assert proc.stdout == f">>> {final[0]['prompt']}\n{final[0]['completion']}\n"
    proc = subprocess.run([*cmd, "--system", "Be brief."], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == (f"scale-generate: error: {out} has no chat template (its run trained on prompts as plain "
                           f"text, not rendered by one): --system needs one; give each prompt's text as it trained "
                           f"with --prompt, --file or stdin\n")
