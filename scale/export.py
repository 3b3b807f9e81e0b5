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
import logging
import os
import sys
from pathlib import Path

from scale.config.help import help_text
from scale.config.load import load_config
from scale.generation.export import merge_run
from scale.modeling.build import keep_bitsandbytes_out
from scale.utils.logs import configure_logging

logger = logging.getLogger("scale.export")  # also under `python -m scale.export`


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
