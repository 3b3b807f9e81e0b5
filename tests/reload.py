"""A run's saved adapter loaded as its user would load it, with plain peft or with transformers, and evaluated again:
what docs/outputs.md promises of ``<output_dir>/adapter`` and of every checkpoint directory."""

from __future__ import annotations

from pathlib import Path

import torch


def reload_eval(out: Path, adapter: Path, how: str) -> dict[str, float]:
    """The eval split's figures of the run in ``out`` with the adapter directory ``adapter`` loaded by ``how``:
    ``"peft"`` (``PeftModel.from_pretrained(base, adapter)``) or ``"transformers"`` (``base.load_adapter(adapter)``).

    The base is what a user loads: ``AutoModelForCausalLM.from_pretrained`` of a saved model directory in float32
    (``tiny-llama``, which has no directory, is rebuilt from the run's seed). No scale code touches the loading; the
    evaluation is :func:`scale.training.evaluate.evaluate` over the split the run held out, 16 rows a batch,
    left-padded.
    """
    from accelerate import Accelerator
    from peft import PeftModel
    from torch.utils.data import DataLoader
    from transformers import AutoModelForCausalLM

    from scale.config.load import load_config
    from scale.data import Collator, build_splits
    from scale.modeling.build import load_base, load_tokenizer
    from scale.objectives.tail import LossSpec
    from scale.training.evaluate import evaluate

    cfg = load_config(out / "config.yaml")
    tokenizer = load_tokenizer(cfg.model)
    if Path(cfg.model.name_or_path).is_dir():
        base = AutoModelForCausalLM.from_pretrained(cfg.model.name_or_path, dtype=torch.float32)
    else:
        base = load_base(cfg.model, len(tokenizer), cfg.train.seed)
    if how == "peft":
        model = PeftModel.from_pretrained(base, str(adapter))
    elif how == "transformers":
        try:
            base.load_adapter(str(adapter))
        except ImportError as e:  # transformers' integration needs a newer peft than the installed one
            import pytest

            from scale.utils.compat import installed

            pytest.skip(f"transformers {installed('transformers')}'s load_adapter cannot run with peft "
                        f"{installed('peft')}: {e}")
        model = base
    else:
        raise ValueError(how)
    splits = build_splits(cfg.data, cfg.loss, tokenizer, cfg.data.path, cfg.train.seed)
    dl = DataLoader(splits.eval, batch_size=16, collate_fn=Collator(tokenizer.pad_token_id, "left"))
    return evaluate(Accelerator(cpu=True), model.eval(), dl, LossSpec.from_config(cfg))
