"""``scale-plan``: which launch mode fits, before the job is launched. Predicted bytes per rank, from configs only.

    scale-plan --config configs/train/default.yaml --gpus 8 --gpu-mem 80
    scale-plan --config configs/train/default.yaml model.name_or_path=configs/models/llama-3.1-70b.json \\
        model.dtype=bfloat16 train.mixed_precision=bf16 model.bnb_4bit_compute_dtype=bfloat16 \\
        model.bnb_4bit_quant_storage=bfloat16 --gpus 16 --nodes 2
    scale-plan --gpus 2 --gpu-mem 24 --model-config configs/models/llama-3.1-8b.json --json
    scale-plan --resume runs/x/checkpoints/step_000400 --gpus 4 --gpu-mem 24   # continue that run on 4 GPUs

It reads the training config (the same YAML and dotted overrides as ``scale-train``) and the model's
``config.json`` only: no weights are loaded, so it answers for a 70B model on a laptop and for node counts that
do not exist here. For every launch mode (single, DDP, ZeRO-1/2/3, ZeRO-3 + CPU offload, FSDP2) it prints the
bytes one rank holds, by kind, and the total against ``--gpu-mem`` (GiB; a mode fits when it leaves
:data:`HEADROOM` of it free); it recommends the cheapest mode (fewest bytes moved between ranks per step) that
fits, a data-parallel one when there are several GPUs.

How each number is obtained:

- **Parameters** are counted by :mod:`scale.planner.census` (meta-device model) and **saved activations** by
  :mod:`scale.planner.activations` (fake-tensor forward with saved-tensor hooks).
- **Where each launch mode keeps them** is :mod:`scale.planner.layouts` (DeepSpeed, DDP and FSDP2 as their code does).
- **Logits**: the part of the saved bytes from the LM head on (``logits_to_keep``: ``loss.threshold`` positions
  per row), and what the full ``[B, T, V]`` logits would have cost instead.
- **Transient** bytes (alive for part of the step) are estimates: the larger of the loss's backward (three
  ``[B x N, V]`` fp32 gradients) and the layer checkpointing recomputes, plus what is alive through all of
  backward: DeepSpeed's ZeRO-1/2 gradient bucket (allocated at each backward), ZeRO-3/FSDP2's gathered
  parameters, a 4-bit layer dequantized for its matmul. Checked on CPU: the single-device total without overhead
  is within 10% of the peak of live tensor bytes over a real optimizer step (``tests/test_plan.py``).
- **Framework overhead** is an assumption (:data:`OVERHEAD_FIXED_BYTES`, :data:`OVERHEAD_FRACTION`), stated in
  the output.

Architectures: any causal LM transformers builds from a config (checked: llama, mistral, qwen2, qwen3, gemma2,
phi3, olmo2, granite, gpt2). Mixture-of-experts models (Qwen3-MoE, Mixtral, DeepSeek-V3, gpt-oss) plan their
parameters exactly and count their activations in any dtype (transformers' grouped expert kernel runs through its
own fallback on fake tensors; a token's ``k`` experts hold ``n x k`` token-expert pairs whatever the routing); a
line gives the base model's parameters and those a token uses, what the LoRA adapter adds, and the FLOPs per token
(docs/models.md).

Shapes: ``B`` = ``train.micro_batch_size``, ``T`` = ``data.max_length``, ``N`` = ``loss.threshold``, ``V`` vocab.
``--resume CKPT`` plans the run that wrote a checkpoint (its config, plus any overrides) on ``--gpus``: it prints the
``train.gradient_accumulation_steps`` that keeps the checkpoint's global batch there (the value ``scale-train``
computes itself when the config is the checkpoint's, :func:`scale.training.state.resume_accumulation`), or why none
does.

No ``accelerate`` or ``torch.distributed`` import (``tests/test_layering.py``): planning never starts a process
group.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path


from scale.config.help import help_text
from scale.config.load import load_config
from scale.config.schema import Config
from scale.config.validation import ConfigError
from scale.planner.autobatch import auto_micro_batch
from scale.planner.census import GIB, PlanError
from scale.planner.layouts import MODE_LABELS
from scale.planner.plan import Plan, make_plan
from scale.training.state import divisors, read_state, resume_accumulation, saved_global_batch
from scale.utils.logs import ignore_known_warnings

def _gib(n: int) -> str:
    return f"{n / GIB:.2f}"


ROWS = (("base weights", "weights"), ("trainable (LoRA)", "trainable"), ("fp32 master", "master"),
        ("gradients", "gradients"), ("optimizer state", "optimizer"), ("frozen reference", "reference"),
        ("saved activations", "activations"),
        ("LM head + loss", "logits"), ("transient", "transient"), ("overhead (assumed)", "overhead"),
        ("TOTAL per rank", "total"), ("host memory per rank", "host"))


def format_plan(plan: Plan) -> str:
    """The plan as a text table (GiB per rank), fits, recommendation and assumptions."""
    a = plan.activations
    head = [
        (f"scale-plan: {plan.model} ({plan.model_type}), {plan.parameters:,} parameters, "
        f"{plan.trainable_parameters:,} trainable ({'every weight' if plan.finetune == 'full' else 'LoRA'}); {plan.gpus} GPU(s) x {plan.gpu_mem_gib:g} GiB on "
        f"{plan.nodes} node(s); micro-batch {plan.micro_batch_size} x {plan.max_length} tokens, checkpointing "
        f"{plan.checkpointing if isinstance(plan.checkpointing, str) else 'on' if plan.checkpointing else 'off'}"),
        (f"saved activations per micro-batch: checkpointing off {_gib(a['checkpointing_off'])} GiB, on "
        f"{_gib(a['checkpointing_on'])} GiB; fp32 log-probabilities the loss keeps: tail [B, N, V] "
        f"{plan.logits_tail_bytes / 2**20:.2f} MiB vs full [B, T, V] {_gib(plan.logits_full_bytes)} GiB"),
        *([plan.experts] if plan.experts else []),
        *([plan.preference["text"]] if plan.preference else []),
        *([plan.rl["text"]] if plan.rl else []),
        "",
    ]
    labels = [MODE_LABELS[r.mode] for r in plan.ranks]
    width = max(12, *(len(x) + 2 for x in labels))
    lines = [f"{'GiB per rank':<22}" + "".join(f"{x:>{width}}" for x in labels)]
    for title, attr in ROWS:
        if attr == "reference" and not any(r.reference for r in plan.ranks):
            continue  # only a full run's DPO (loss.reference=model) or GRPO (rl.beta > 0) keeps one
        title = "trained weights (all)" if attr == "trainable" and plan.finetune == "full" else title
        lines.append(f"{title:<22}" + "".join(f"{_gib(getattr(r, attr)):>{width}}" for r in plan.ranks))
    fit_cells = []
    for r in plan.ranks:
        if r.refused:
            fit_cells.append("refused")
        elif r.mode != "single" and plan.gpus == 1:
            fit_cells.append("n/a")
        elif plan.fits[r.mode]:
            fit_cells.append("yes")
        else:
            fit_cells.append("tight" if r.total <= plan.gpu_mem_gib * GIB else "no")
    lines.append(f"{f'fits in {plan.gpu_mem_gib:g} GiB':<22}" + "".join(f"{x:>{width}}" for x in fit_cells))
    rec = (f"recommended: {MODE_LABELS[plan.recommended]} (cheapest that fits)" if plan.recommended
           else f"recommended: none fits; {plan.advice}")
    notes = [f"  {MODE_LABELS[r.mode]}: {n}" for r in plan.ranks for n in r.notes]
    notes += [f"  {MODE_LABELS[r.mode]} refused: {r.refused}" for r in plan.ranks if r.refused]
    return "\n".join([*([plan.resume, ""] if plan.resume else []), *head, *lines, "", rec, "", "notes:", *notes, "",
                      "assumptions:", *(f"  - {x}" for x in plan.assumptions)])


def resume_config(checkpoint: str | Path, overrides: list[str], gpus: int) -> tuple[Config, str]:
    """The config of the run that wrote ``checkpoint`` (plus ``overrides``) as it resumes on ``gpus`` processes:
    ``train.gradient_accumulation_steps`` set to keep its global batch; and that in one line. When the checkpoint's
    micro-batch does not divide the rows a rank then trains per step (and the overrides set neither), the largest
    micro-batch that does is planned, and the line names the two keys scale-train needs.

    Raises:
        PlanError: ``checkpoint`` holds no readable ``trainer_state.json``.
        ConfigError: the global batch cannot be kept on ``gpus`` (the message lists the valid choices).
    """
    import tempfile

    import yaml

    try:
        state = read_state(checkpoint)
    except (OSError, ValueError, TypeError) as e:
        raise PlanError(f"--resume {checkpoint}: not a checkpoint ({type(e).__name__}: {str(e)[:160]}); give a "
                        f"<output_dir>/checkpoints/step_XXXXXX directory") from e
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.yaml"
        path.write_text(yaml.safe_dump(state.config), encoding="utf-8")
        cfg = load_config(path, overrides)
    t, G = state.config.get("train", {}), saved_global_batch(state)
    dp = cfg.train.data_parallel_size(gpus)
    saved = (t.get("micro_batch_size", 0), t.get("gradient_accumulation_steps", 0))
    how = "scale-train sets it when the config is the checkpoint's"
    try:
        ga = resume_accumulation(G, *saved, cfg.train.micro_batch_size, cfg.train.gradient_accumulation_steps, dp,
                                 f"checkpoint {checkpoint}")
    except ConfigError:
        # The checkpoint's micro-batch does not divide the rows each rank now trains per step: plan the largest one
        # that does (the split the user would pick), unless the overrides chose a split themselves.
        if G % dp or (cfg.train.micro_batch_size, cfg.train.gradient_accumulation_steps) != saved:
            raise
        per_rank = G // dp
        cfg.train.micro_batch_size = max(m for m in divisors(per_rank) if m <= max(1, cfg.train.micro_batch_size))
        ga = per_rank // cfg.train.micro_batch_size
        how = (f"the checkpoint's micro_batch_size={saved[0]} does not divide the {per_rank} rows a rank trains per "
               f"step: give train.micro_batch_size={cfg.train.micro_batch_size} "
               f"train.gradient_accumulation_steps={ga} to scale-train")
    cfg.train.gradient_accumulation_steps = ga
    wrote = f"{state.mode or 'an earlier version'} on {state.world_size} process(es)"
    return cfg, (f"resume {checkpoint} (step {state.step}, written by {wrote}) on {gpus} GPU(s): global_batch_size "
                 f"{G} = micro_batch_size {cfg.train.micro_batch_size} x train.gradient_accumulation_steps={ga} x {dp} "
                 f"data-parallel rank(s); {how}")


def main(argv: list[str] | None = None) -> int:
    """``scale-plan [--config PATH] [key=value ...] --gpus N [--gpu-mem GiB] [--nodes K] [--full-rows] [--json]``."""
    parser = argparse.ArgumentParser(prog="scale-plan", description=help_text(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, help="training YAML, or a shipped config's name such as tiny_cpu "
                                                       "(default: configs/train/default.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides such as train.micro_batch_size=4")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs (processes) in all, over all nodes")
    parser.add_argument("--gpu-mem", type=float, default=80.0, help="memory per GPU, GiB (default 80)")
    parser.add_argument("--nodes", type=int, default=1, help="nodes the GPUs are spread over (default 1)")
    parser.add_argument("--model-config", default=None,
                        help="a model config.json (or its directory), or a shipped name such as llama-3.1-8b, to "
                             "plan instead of model.name_or_path")
    parser.add_argument("--full-rows", action="store_true",
                        help="every row fills data.max_length (no padding): attention keeps no mask")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--resume", default=None, metavar="CKPT",
                        help="a checkpoint directory: plan its run (its config, + overrides) on --gpus, with the "
                             "gradient_accumulation_steps that keeps its global batch")
    args = parser.parse_intermixed_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        note = None
        if args.resume is not None:
            cfg, note = resume_config(args.resume, args.overrides, args.gpus)
        else:
            cfg = load_config(args.config, args.overrides)
        if cfg.train.micro_batch_size == "auto":
            dp = cfg.train.data_parallel_size(args.gpus)
            b, ga, _ = auto_micro_batch(cfg, dp, args.gpu_mem, args.model_config)
            if b == 0:
                raise PlanError(f"train.micro_batch_size=auto: not even one row fits {cfg.train.auto_memory_fraction:g}"
                                f" of {args.gpu_mem:g} GiB")
            kept = cfg.train.auto_global_batch_size
            cfg = replace(cfg, train=replace(cfg.train, micro_batch_size=b, gradient_accumulation_steps=ga,
                                             auto_global_batch_size=None))
            note = "\n".join(filter(None, [note, (
                f"train.micro_batch_size=auto: {b}, the largest whose single-GPU plan fits train.auto_memory_fraction "
                f"{cfg.train.auto_memory_fraction:g} of --gpu-mem {args.gpu_mem:g} GiB"
                + (f" and divides train.auto_global_batch_size {kept} / {dp} data-parallel ranks; "
                   f"gradient_accumulation_steps {ga}" if kept is not None else ""))]))
        plan = make_plan(cfg, args.gpus, args.gpu_mem, args.nodes, args.model_config, padded=not args.full_rows)
        plan.resume = note
    except (ConfigError, PlanError, FileNotFoundError) as e:
        sys.stderr.write(f"scale-plan: error: {type(e).__name__}: {e}\n")
        return 2
    sys.stdout.write((json.dumps(plan.to_dict(), indent=2) if args.json else format_plan(plan)) + "\n")
    return 0


def cli() -> None:
    """Console entry point. The planner counts 4-bit weights itself (:func:`scale.planner.census.nf4_bytes`) on meta
    tensors, so bitsandbytes, which peft and transformers import whenever it is installed (~3 s of CPU: it wraps its
    kernels in ``torch.compile``), is kept out of the process as in :func:`scale.cli.start_fast`; peft's call of
    transformers' deprecated ``is_gradient_checkpointing`` is not reported
    (:func:`scale.utils.logs.ignore_known_warnings`, as every command drops it)."""
    sys.modules.setdefault("bitsandbytes", None)
    ignore_known_warnings()
    sys.exit(main())



if __name__ == "__main__":
    cli()
