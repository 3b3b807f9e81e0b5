"""A run's model for serving: the tokenizer a run ships with its trained chat template and end-of-turn stop
(:func:`serving_tokenizer`, :func:`save_serving_files`: ``adapter/`` and ``merged/`` carry them), and the run merged
into one model (:func:`merge_run`: LoRA folded into a base dequantized from 4-bit, written atomically). ``scale-export``
(:mod:`scale.export`) is its command line; the training run writes the serving files itself. No accelerate import.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch

from scale.config.load import load_config
from scale.config.schema import Config
from scale.data.tasks.chat_spans import render_chat
from scale.data.tasks.chat_template import chat_template
from scale.modeling.build import load_base, load_tokenizer
from scale.modeling.moe import explicit_targets
from scale.modeling.tokens import grow_embeddings
from scale.utils.fileio import replace_dir, temp_dir_for

logger = logging.getLogger("scale.export")  # the lines of scale-export (scale/export.py) and of the merge


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
        run_dir: the run directory, whose ``adapter/`` (``model/`` for ``model.finetune=full``) holds the saved
            tokenizer; None: build it from ``cfg``.
        chat: without a saved tokenizer: whether the run's rows were rendered by a chat template (its prepared
            task's answer: :attr:`scale.data.tokenize.Splits.template_sha256` is not empty).

    Returns:
        ``(tokenizer, stop_ids, note)``.
    """
    from transformers import AutoTokenizer

    saved = run_model_dir(Path(run_dir), cfg) if run_dir is not None else None
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


def run_model_dir(run_dir: Path, cfg: Config) -> Path:
    """Where a run saved what it trained: ``<run_dir>/adapter`` (LoRA) or ``<run_dir>/model`` (``model.finetune=full``,
    a plain transformers directory)."""
    return run_dir / ("model" if cfg.model.finetune == "full" else "adapter")


def copy_model(run_dir: Path, out_dir: str | Path | None) -> Path:
    """A full fine-tune's export: ``<run_dir>/model`` is already a plain transformers directory (the fp32 weights,
    the tokenizer as trained, ``generation_config.json``), so it is returned as it is, or copied to ``out_dir``
    (built in a temporary directory, then renamed).

    Raises:
        FileNotFoundError: the run has no ``model/config.json``.
    """
    import shutil

    model = run_dir / "model"
    if not (model / "config.json").exists():
        raise FileNotFoundError(f"{model} has no config.json: a model.finetune=full run writes it at the end with "
                                f"train.save_adapter=true")
    if out_dir is None:
        logger.info("%s: already a plain transformers directory (model.finetune=full); nothing to merge", model)
        return model
    out = Path(out_dir)
    tmp = temp_dir_for(out)
    shutil.copytree(model, tmp, dirs_exist_ok=True)
    replace_dir(tmp, out)
    logger.info("%s: copied from %s (model.finetune=full: nothing to merge)", out, model)
    return out


def merge_run(run_dir: str | Path, out_dir: str | Path | None = None) -> Path:
    """Fold ``<run_dir>/adapter`` into the run's base and save a plain HF model + tokenizer; a full fine-tune's
    ``model/`` is already one (:func:`copy_model`).

    Args:
        run_dir: a finished run (``config.yaml`` and ``adapter/``).
        out_dir: where to write; default ``<run_dir>/merged`` (a full fine-tune: ``<run_dir>/model`` itself). Written
            to a temp dir, then renamed.

    Returns:
        The output directory.

    Raises:
        FileNotFoundError: the run has no ``config.yaml`` or ``adapter/``.
    """
    from peft import PeftModel

    run_dir = Path(run_dir)
    cfg = load_config(run_dir / "config.yaml")
    if cfg.model.finetune == "full":
        return copy_model(run_dir, out_dir)
    out = Path(out_dir) if out_dir is not None else run_dir / "merged"
    if not (run_dir / "adapter" / "adapter_config.json").exists():
        raise FileNotFoundError(f"{run_dir}/adapter has no adapter_config.json: train with train.save_adapter=true")
    tokenizer, stops, note = serving_tokenizer(cfg, run_dir)
    run_tokenizer = load_tokenizer(cfg.model)
    rows = len(run_tokenizer)  # with model.new_tokens: the rows the run trained
    base = dequantized_base(cfg.model, rows, cfg.train.seed)
    grow_embeddings(base, rows, cfg.train.seed, run_tokenizer.vocab_size)  # as the run grew them (the adapter trained them)
    with explicit_targets():  # a mixture-of-experts adapter names its targets in full (scale.modeling.moe)
        merged = PeftModel.from_pretrained(base, run_dir / "adapter").merge_and_unload()
    merged.config.use_cache = True
    tmp = temp_dir_for(out)
    merged.save_pretrained(tmp, safe_serialization=True)
    save_serving_files(tokenizer, stops, tmp, merged.generation_config)
    replace_dir(tmp, out)
    logger.info("%s: %s", out, note)
    return out
