"""Export a run as one merged model for inference: LoRA folded into a (dequantized) base, served as it trained.

    scale-export runs/default                      # = python -m scale.export; writes runs/default/merged/

``merged/`` (and ``adapter/``, written by the training run) carry the tokenizer with the chat template the run
trained with (``data.chat_template``, not the tokenizer's own) and a ``generation_config.json`` whose
``eos_token_id`` lists the trained end-of-turn marker (``<|im_end|>`` for ChatML) as well as EOS: a base model
whose EOS is not the template's end of turn then stops where training taught it to (LLaMA-Factory#7454). A run
whose rows no chat template rendered (classification, plain text, text prompt/completion) ships no chat template
at all, not the tokenizer's own: it trained on prompts as they are, and a server or harness that applied one would
score another text (the log line says so).
Serve it with ``transformers serve``, chat with ``scale-generate``, evaluate it with ``scale-lm-eval RUN_DIR`` (the
run's eval split as a local lm-evaluation-harness task) or any harness (docs/outputs.md).

For a QLoRA run the base's 4-bit weights are dequantized first (to ``model.dtype``), so the merged model
computes what the trained 4-bit model + adapter computed, without bitsandbytes. No accelerate import.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch

from scale.config.help import help_text
from scale.config.load import load_config
from scale.config.schema import Config
from scale.data.tasks.chat_spans import render_chat
from scale.data.tasks.chat_template import chat_template
from scale.modeling.build import keep_bitsandbytes_out, load_base, load_tokenizer
from scale.modeling.moe import explicit_targets
from scale.utils.fileio import replace_dir, temp_dir_for
from scale.utils.logs import configure_logging

logger = logging.getLogger("scale.export")  # also under `python -m scale.export`


def dequantized_base(model_cfg, vocab_size: int, seed: int) -> torch.nn.Module:
    """The base model in ``model_cfg.dtype`` with every 4-bit linear replaced by its dequantized weight."""
    plain = load_base(dataclasses.replace(model_cfg, quantize_4bit=False), vocab_size, seed)
    if not model_cfg.quantize_4bit:
        return plain
    import bitsandbytes as bnb

    quantized = load_base(model_cfg, vocab_size, seed)
    with torch.no_grad():
        for name, module in quantized.named_modules():
            if isinstance(module, bnb.nn.Linear4bit):
                w = bnb.functional.dequantize_4bit(module.weight.data, module.weight.quant_state)
                plain.get_submodule(name).weight.copy_(w.to(plain.get_submodule(name).weight.dtype))
    return plain


PROBE = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "OK"}]
NO_TEMPLATE = ("without a chat template: the run's rows were not rendered by one, so prompts are used as they are "
               "(a chat request has no template to apply)")


def serving_tokenizer(cfg: Config, run_dir: str | Path | None = None, chat: bool = True
                      ) -> tuple[Any, list[int], str]:
    """The run's tokenizer as it trained, the token ids generation must stop at, and a note for the log.

    ``<run_dir>/adapter/`` holds the tokenizer the run saved and is read first: its chat template is the one the
    rows were rendered with, and it has none when they were not rendered by one (what training wrote with
    ``chat``). Else the config's tokenizer gets ``data.chat_template``'s text (``chat``), or loses the template it
    came with (not ``chat``: a classification, plain-text or text prompt/completion run never trained through it,
    so nothing that serves the run may apply it). The stops are EOS plus, with a template, the end-of-turn marker
    it closes an assistant turn with (what the trained tails end with: :func:`scale.data.render_chat`), found by
    rendering a probe conversation.

    Args:
        cfg: the run's config.
        run_dir: the run directory, whose ``adapter/`` holds the saved tokenizer; None: build it from ``cfg``.
        chat: without a saved tokenizer: whether the run's rows were rendered by a chat template (its prepared
            task's answer: :attr:`scale.data.tokenize.Splits.template_sha256` is not empty).

    Returns:
        ``(tokenizer, stop_ids, note)``.
    """
    from transformers import AutoTokenizer

    saved = Path(run_dir) / "adapter" if run_dir is not None else None
    if saved is not None and (saved / "tokenizer_config.json").exists():
        tokenizer = AutoTokenizer.from_pretrained(saved)
        note = (f"the tokenizer and chat template saved in {saved}" if getattr(tokenizer, "chat_template", None)
                else f"the tokenizer saved in {saved}, {NO_TEMPLATE}")
    elif not chat:
        tokenizer, note = load_tokenizer(cfg.model), f"the model's tokenizer, {NO_TEMPLATE}"
        tokenizer.chat_template = None
    else:
        tokenizer, note = load_tokenizer(cfg.model), "the model's tokenizer"
        if cfg.data.chat_template is not None:
            tokenizer.chat_template = chat_template(tokenizer, cfg.data)
            note += f" with the run's chat template data.chat_template={cfg.data.chat_template}"
    stops = [tokenizer.eos_token_id]
    if getattr(tokenizer, "chat_template", None):  # a chat model also stops at its end-of-turn marker
        _, tail, appends_eos = render_chat(tokenizer, tokenizer.chat_template, PROBE, 0)
        if not appends_eos:  # the tail ends with the template's end-of-turn marker, one special token
            marker = tokenizer(tail, add_special_tokens=False)["input_ids"][-1]
            stops += [marker] if marker not in stops else []
            note += f"; generation stops at {[tokenizer.decode([t]) for t in stops]}"
    return tokenizer, stops, note


def save_serving_files(tokenizer: Any, stops: list[int], out: Path, generation_config: Any = None) -> None:
    """Write the tokenizer and a ``generation_config.json`` stopping at ``stops`` into ``out``."""
    from transformers import GenerationConfig

    tokenizer.save_pretrained(out)
    gen = generation_config if generation_config is not None else GenerationConfig()
    gen.eos_token_id = stops if len(stops) > 1 else stops[0]
    gen.pad_token_id = tokenizer.pad_token_id
    gen.save_pretrained(out)


def merge_run(run_dir: str | Path, out_dir: str | Path | None = None) -> Path:
    """Fold ``<run_dir>/adapter`` into the run's base and save a plain HF model + tokenizer.

    Args:
        run_dir: a finished run (``config.yaml`` and ``adapter/``).
        out_dir: where to write; default ``<run_dir>/merged``. Written to a temp dir, then renamed.

    Returns:
        The output directory.

    Raises:
        FileNotFoundError: the run has no ``config.yaml`` or ``adapter/``.
    """
    from peft import PeftModel

    run_dir = Path(run_dir)
    out = Path(out_dir) if out_dir is not None else run_dir / "merged"
    cfg = load_config(run_dir / "config.yaml")
    if not (run_dir / "adapter" / "adapter_config.json").exists():
        raise FileNotFoundError(f"{run_dir}/adapter has no adapter_config.json: train with train.save_adapter=true")
    tokenizer, stops, note = serving_tokenizer(cfg, run_dir)
    base = dequantized_base(cfg.model, len(load_tokenizer(cfg.model)), cfg.train.seed)
    with explicit_targets():  # a mixture-of-experts adapter names its targets in full (scale.modeling.moe)
        merged = PeftModel.from_pretrained(base, run_dir / "adapter").merge_and_unload()
    merged.config.use_cache = True
    tmp = temp_dir_for(out)
    merged.save_pretrained(tmp, safe_serialization=True)
    save_serving_files(tokenizer, stops, tmp, merged.generation_config)
    replace_dir(tmp, out)
    logger.info("%s: %s", out, note)
    return out


def main(argv: list[str] | None = None, *, own_process: bool = False) -> int:
    """``python -m scale.export RUN_DIR [--out DIR]``.

    ``own_process``: this process exports and nothing else (:func:`cli`), so bitsandbytes stays out unless the
    run's base is 4-bit (:func:`scale.modeling.build.keep_bitsandbytes_out`)."""
    parser = argparse.ArgumentParser(prog="scale.export", description=help_text(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    configure_logging(dict(os.environ))  # first: before transformers, peft and bitsandbytes are imported
    if own_process and (Path(args.run_dir) / "config.yaml").is_file():  # else merge_run says what is missing
        keep_bitsandbytes_out(load_config(Path(args.run_dir) / "config.yaml").model)
    out = merge_run(args.run_dir, args.out)
    logger.info("merged model written to %s", out)
    log_merged(Path(args.run_dir), out)
    return 0


def log_merged(run_dir: Path, out: Path) -> None:
    """With ``log.wandb_log_model`` set and W&B online, add ``out`` to the training run as the artifact
    ``merged-<run id>``. Offline it is not: a second offline directory of the run would replace its history
    when synced (wandb#3841); ``wandb artifact put`` uploads it."""
    cfg = load_config(run_dir / "config.yaml")
    record = run_dir / "wandb_run.json"
    if not cfg.log.wandb_log_model or "wandb" not in cfg.log.trackers or not record.exists():
        return
    if os.environ.get("WANDB_MODE", "offline" if not os.environ.get("WANDB_API_KEY") else "") in ("offline",
                                                                                                  "disabled"):
        logger.info("W&B offline: %s not logged as an artifact; upload it with `wandb artifact put --type model "
                    "%s`", out, out)
        return
    import json

    import wandb

    run_id = json.loads(record.read_text(encoding="utf-8"))["id"]
    run = wandb.init(project=cfg.log.project, entity=cfg.log.entity, id=run_id, resume="must", dir=str(run_dir))
    artifact = wandb.Artifact(f"merged-{run_id}", type="model")
    artifact.add_dir(str(out))
    run.log_artifact(artifact, aliases=["final", "latest"])
    run.finish()


def cli() -> None:
    """Console entry point (``scale-export``)."""
    sys.exit(main(own_process=True))


if __name__ == "__main__":
    cli()
