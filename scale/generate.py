"""``scale-generate``: greedy answers from a trained run, with the chat template it trained with, stopping at the
trained end-of-turn marker.

    scale-generate runs/sft/merged --prompt "Hello, how are you?"          # the merged export
    scale-generate runs/sft --prompt "Hello"                                # base + runs/sft/adapter
    echo "What is AI?" | scale-generate runs/sft                            # prompts from stdin, one a line
    scale-generate runs/sft --file prompts.txt --max-new-tokens 64          # or a file, one a line

A prompt becomes one user message rendered with the run's chat template (``add_generation_prompt``); a run
trained without a chat template gets the prompt text as it is. Decoding is ``model.generate`` (greedy), stopping
at EOS and at the end-of-turn marker (:func:`scale.export.serving_tokenizer`). No accelerate import.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

import torch

from scale.config import load_config
from scale.export import serving_tokenizer
from scale.modeling import load_base, load_tokenizer

logger = logging.getLogger(__name__)


def load_for_generation(path: str | Path) -> tuple[torch.nn.Module, Any, list[int]]:
    """``(model, tokenizer, stop_ids)`` from a merged/plain HF model directory, a run directory (base +
    ``adapter/``) or a run's ``adapter/`` directory.

    Raises:
        FileNotFoundError: ``path`` is none of these.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    path = Path(path)
    if (path / "config.json").exists():  # merged/ (scale-export) or any HF causal LM
        model, tokenizer = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
        stops = GenerationConfig.from_pretrained(path).eos_token_id if (path / "generation_config.json").exists() \
            else tokenizer.eos_token_id
        return model.eval(), tokenizer, stops if isinstance(stops, list) else [stops]
    run_dir = path.parent if (path / "adapter_config.json").exists() else path
    if not (run_dir / "config.yaml").exists() or not (run_dir / "adapter" / "adapter_config.json").exists():
        raise FileNotFoundError(f"{path} is neither a model directory (config.json), a run directory (config.yaml "
                                f"and adapter/) nor a run's adapter/")
    from peft import PeftModel

    cfg = load_config(run_dir / "config.yaml")
    tokenizer, stops, _ = serving_tokenizer(cfg, run_dir)
    base = load_base(cfg.model, len(load_tokenizer(cfg.model)), cfg.train.seed)
    model = PeftModel.from_pretrained(base, run_dir / "adapter")
    return model.eval(), tokenizer, stops


def render_prompt(tokenizer: Any, prompt: str) -> str:
    """One user message through the chat template with the generation prompt; the text itself without one."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             tokenize=False)
    return prompt


@torch.no_grad()
def generate_texts(model: torch.nn.Module, tokenizer: Any, prompts: list[str], stops: list[int],
                   max_new_tokens: int = 64) -> list[str]:
    """Greedy completions (``model.generate``, ``do_sample=False``) of already rendered ``prompts``, one at a
    time (no padding question), decoded without special tokens; each stops at a token of ``stops``."""
    out = []
    for text in prompts:
        enc = tokenizer(text, return_tensors="pt", add_special_tokens=False).to(next(model.parameters()).device)
        ids = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stops,
                             pad_token_id=tokenizer.pad_token_id)
        out.append(tokenizer.decode(ids[0, enc["input_ids"].shape[1]:], skip_special_tokens=True).strip())
    return out


def main(argv: list[str] | None = None) -> int:
    """``scale-generate PATH [--prompt TEXT]... [--file F] [--max-new-tokens N]``; stdin when no prompt is given."""
    parser = argparse.ArgumentParser(prog="scale-generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", help="merged/ (or any HF model dir), a run dir (base + adapter/), or adapter/")
    parser.add_argument("--prompt", action="append", default=[], help="a user message (repeatable)")
    parser.add_argument("--file", default=None, help="a file with one prompt a line")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    prompts = list(args.prompt)
    if args.file:
        prompts += [line.strip() for line in Path(args.file).read_text(encoding="utf-8").splitlines() if line.strip()]
    if not prompts:
        prompts = [line.strip() for line in sys.stdin if line.strip()]
    try:
        model, tokenizer, stops = load_for_generation(args.path)
    except FileNotFoundError as e:
        sys.stderr.write(f"scale-generate: error: {e}\n")
        return 2
    answers = generate_texts(model, tokenizer, [render_prompt(tokenizer, p) for p in prompts], stops,
                             args.max_new_tokens)
    for prompt, answer in zip(prompts, answers):
        sys.stdout.write(f">>> {prompt}\n{answer}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
