"""Export a run as one merged model for inference: LoRA folded into a (dequantized) base.

    python -m scale.export runs/default            # writes runs/default/merged/

For a QLoRA run the base's 4-bit weights are dequantized first (to ``model.dtype``), so the merged model
computes what the trained 4-bit model + adapter computed, without bitsandbytes. No accelerate import.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from pathlib import Path

import torch

from scale.config import load_config
from scale.fileio import replace_dir, temp_dir_for
from scale.modeling import load_base, load_tokenizer

logger = logging.getLogger(__name__)


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
    tokenizer = load_tokenizer(cfg.model)
    base = dequantized_base(cfg.model, len(tokenizer), cfg.train.seed)
    merged = PeftModel.from_pretrained(base, run_dir / "adapter").merge_and_unload()
    merged.config.use_cache = True
    tmp = temp_dir_for(out)
    merged.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    replace_dir(tmp, out)
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m scale.export RUN_DIR [--out DIR]``."""
    parser = argparse.ArgumentParser(prog="scale.export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    logger.info("merged model written to %s", merge_run(args.run_dir, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
