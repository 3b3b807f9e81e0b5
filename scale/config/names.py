"""Keys by other names: TRL's ``SFTConfig`` and transformers' ``TrainingArguments`` (plus peft's ``LoraConfig``,
``BitsAndBytesConfig`` and the preference trainers' ``disable_dropout``) next to the scale key that does the same, the
closest keys to a mistyped one, and the defaults of a run that differ from TRL's.

    suggest("optim.learning_rate")   # "learning_rate is TRL/transformers' name; here it is optim.lr (...)"
    suggest("train.max_stpes")       # "did you mean train.max_steps?"

The TRL and transformers defaults are those of TRL 1.16 (``trl/trainer/sft_config.py``, ``base_config.py``) over
transformers 5.24 (``TrainingArguments``); names that only older versions have (``max_seq_length``, ``warmup_ratio``,
``group_by_length``, ``overwrite_output_dir``) say so. The table in ``docs/config.md`` is generated from
:data:`TRL_NAMES` (:func:`trl_table`). No torch: the config reader imports this module.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any, NamedTuple

from scale.config.schema import Config, DatasetConfig


class OtherName(NamedTuple):
    """One TRL/transformers/peft argument and the scale key(s) that do what it does.

    Attributes:
        name: the argument as TRL, transformers, peft or bitsandbytes spell it.
        default: its default there, as text (TRL's where TRL overrides transformers').
        keys: the scale keys that set the same (empty: not offered).
        note: how the two differ, or the value to set; one short phrase.
    """

    name: str
    default: str
    keys: tuple[str, ...]
    note: str = ""


TRL_NAMES: tuple[OtherName, ...] = (
    OtherName("output_dir", "'trainer_output'", ("output_dir",)),
    OtherName("learning_rate", "2e-05 (transformers: 5e-05)", ("optim.lr",)),
    OtherName("num_train_epochs", "3.0", ("train.num_epochs",), "whole epochs; set train.max_steps=null with it"),
    OtherName("max_steps", "-1", ("train.max_steps",), "null trains by train.num_epochs"),
    OtherName("per_device_train_batch_size", "8", ("train.micro_batch_size",)),
    OtherName("per_device_eval_batch_size", "8", ("train.eval_micro_batch_size",)),
    OtherName("gradient_accumulation_steps", "1", ("train.gradient_accumulation_steps",)),
    OtherName("warmup_ratio", "0.0 (transformers 4; 5: a warmup_steps < 1)", ("optim.warmup_ratio",),
              "replaces optim.warmup_steps when set"),
    OtherName("warmup_steps", "0", ("optim.warmup_steps",), "a value < 1 (transformers 5) is optim.warmup_ratio"),
    OtherName("lr_scheduler_type", "'linear'", ("optim.schedule", "optim.min_lr_ratio"),
              "linear | cosine | constant, decaying to min_lr_ratio x lr: 0 for transformers' linear and cosine, "
              "its min_lr_rate for cosine_with_min_lr"),
    OtherName("lr_scheduler_kwargs", "None", ("optim.min_lr_ratio",), "min_lr_rate"),
    OtherName("weight_decay", "0.0", ("optim.weight_decay",)),
    OtherName("adam_beta1", "0.9", ("optim.betas",), "[beta1, beta2]"),
    OtherName("adam_beta2", "0.999", ("optim.betas",), "[beta1, beta2]"),
    OtherName("adam_epsilon", "1e-08", ("optim.eps",)),
    OtherName("optim", "'adamw_torch_fused'", ("optim.name",), "adamw (torch.optim.AdamW) | sgd"),
    OtherName("max_grad_norm", "1.0", ("optim.max_grad_norm",), "null: no clipping"),
    OtherName("seed", "42", ("train.seed",)),
    OtherName("data_seed", "None", ("train.seed",), "one seed for the split, the order and LoRA's init"),
    OtherName("bf16", "None (TRL: true unless fp16)", ("train.mixed_precision",), "bf16; auto measures first"),
    OtherName("fp16", "False", ("train.mixed_precision",), "fp16 (CUDA only)"),
    OtherName("gradient_checkpointing", "True (transformers: False)", ("model.gradient_checkpointing",)),
    OtherName("activation_checkpointing", "None", ("model.gradient_checkpointing",), "transformers 5's name"),
    OtherName("gradient_checkpointing_kwargs", "None", ("model.use_reentrant",), "use_reentrant"),
    OtherName("activation_offloading", "False", ("model.gradient_checkpointing",), "offload"),
    OtherName("eval_strategy", "'no'", ("train.eval_every",),
              "scale always evaluates at step 0 and at the end; eval_every=0: only then"),
    OtherName("eval_steps", "None", ("train.eval_every",)),
    OtherName("eval_on_start", "False", ("train.eval_every",), "step 0 is always evaluated"),
    OtherName("save_strategy", "'steps'", ("train.save_every", "train.save_every_minutes")),
    OtherName("save_steps", "500", ("train.save_every",)),
    OtherName("save_total_limit", "None", ("train.save_total_limit",)),
    OtherName("save_on_each_node", "False", ("train.save_on_each_node",)),
    OtherName("logging_steps", "10 (transformers: 500)", ("train.log_every",)),
    OtherName("load_best_model_at_end", "False", ("train.keep_best",),
              "keeps the best checkpoint (best.json names it); adapter/ is the last step's"),
    OtherName("metric_for_best_model", "None", ("train.keep_best",), "eval/loss, eval/accuracy, ..."),
    OtherName("greater_is_better", "None", ("train.keep_best_mode",), "max | min | auto"),
    OtherName("early_stopping_patience", "1 (EarlyStoppingCallback)", ("train.early_stopping_patience",)),
    OtherName("resume_from_checkpoint", "None", ("train.resume_from",), "latest | auto | a checkpoint directory"),
    OtherName("overwrite_output_dir", "False (transformers 4)", ("train.overwrite_output_dir",)),
    OtherName("report_to", "'none'", ("log.trackers",), "[wandb] | []"),
    OtherName("run_name", "None", ("log.run_name",)),
    OtherName("project", "'huggingface'", ("log.project",)),
    OtherName("dataloader_num_workers", "0", ("data.num_workers",)),
    OtherName("group_by_length", "False (transformers 4)", ("data.group_by_length",)),
    OtherName("train_sampling_strategy", "'random'", ("data.group_by_length",), "group_by_length: true"),
    OtherName("ddp_timeout", "1800", ("train.collective_timeout_s",)),
    OtherName("deepspeed", "None", ("train.deepspeed_config",)),
    OtherName("model_init_kwargs", "None", ("model.dtype", "model.attn_implementation"), "dtype, attn_implementation"),
    OtherName("torch_dtype", "None", ("model.dtype",)),
    OtherName("attn_implementation", "None", ("model.attn_implementation",)),
    OtherName("trust_remote_code", "False", ("model.trust_remote_code",)),
    OtherName("chat_template_path", "None", ("data.chat_template",), "a Jinja file"),
    OtherName("dataset_text_field", "'text'", ("data.text_column",)),
    OtherName("dataset_num_proc", "None", ("data.num_proc",)),
    OtherName("max_length", "1024", ("data.max_length",),
              "a longer row loses its oldest tokens, keeping the trained end (TRL keep_start cuts the end)"),
    OtherName("max_seq_length", "1024 (TRL < 0.20)", ("data.max_length",), "as max_length"),
    OtherName("truncation_mode", "'keep_start'", ("data.max_length",), "scale always keeps the end"),
    OtherName("packing", "False", ("data.packing",), "best-fit decreasing, no row split (TRL's bfd)"),
    OtherName("packing_strategy", "'bfd'", ("data.packing",), "bfd only"),
    OtherName("padding_free", "False", ("data.padding_free",)),
    OtherName("completion_only_loss", "None", ("data.format",),
              "prompt_completion always trains the completion only"),
    OtherName("assistant_only_loss", "False", ("data.train_on",),
              "messages always trains assistant turns only (TRL's false trains every token); last_assistant"),
    OtherName("shuffle_dataset", "False", (), "train rows are always shuffled by train.seed"),
    OtherName("eval_packing", "None", (), "evaluation is never packed"),
    OtherName("loss_type", "'nll'", ("loss.criterion",), "'module:function' for another loss"),
    OtherName("neftune_noise_alpha", "None", (), "not offered"),
    OtherName("torch_compile", "False", (), "not offered (inexact here)"),
    OtherName("use_liger_kernel", "False", ("model.kernels", "loss.fused"),
              "liger in both: norms, SwiGLU, RoPE (model.kernels) and fused cross-entropy (loss.fused)"),
    OtherName("disable_dropout", "True (DPOConfig, CPOConfig, ORPOConfig; SFTConfig has none)",
              ("model.disable_dropout",), "null: true under dpo/simpo/orpo, false under sft; also zeroes the float "
              "rates attention passes to functional dropout (attention_dropout), which TRL's leaves on"),
    OtherName("finetuning_type", "'lora' (LLaMA-Factory)", ("model.finetune",),
              "accepted as model.finetuning_type: lora | full (LLaMA-Factory's freeze is not offered)"),
    OtherName("num_generations", "8 (GRPOConfig)", ("rl.num_generations",), "with loss.objective=grpo"),
    OtherName("max_completion_length", "512 (GRPOConfig)", ("rl.max_completion_length",)),
    OtherName("temperature", "1.0 (GRPOConfig)", ("rl.temperature",)),
    OtherName("top_p", "1.0 (GRPOConfig)", ("rl.top_p",)),
    OtherName("top_k", "0 (GRPOConfig)", ("rl.top_k",)),
    OtherName("scale_rewards", "'group' (GRPOConfig)", ("rl.scale_rewards",)),
    OtherName("epsilon_high", "None (GRPOConfig)", ("rl.epsilon_high",)),
    OtherName("importance_sampling_level", "'token' (GRPOConfig)", ("rl.importance_sampling_level",)),
    OtherName("num_iterations", "1 (GRPOConfig)", ("rl.num_iterations",)),
    OtherName("steps_per_generation", "None (GRPOConfig)", ("rl.steps_per_generation",)),
    OtherName("mask_truncated_completions", "False (GRPOConfig)", ("rl.mask_truncated_completions",)),
    OtherName("use_bias_correction_kl", "True (GRPOConfig)", ("rl.kl_bias_correction",)),
    OtherName("reward_weights", "None (GRPOConfig)", ("rl.rewards",), "a weight per entry"),
    OtherName("use_vllm", "False (GRPOConfig)", ("rl.generator",), "vllm"),
    OtherName("r", "8 (peft LoraConfig)", ("lora.r",)),
    OtherName("lora_alpha", "8 (peft)", ("lora.alpha",)),
    OtherName("lora_dropout", "0.0 (peft)", ("lora.dropout",)),
    OtherName("target_modules", "None (peft)", ("lora.target_modules",)),
    OtherName("load_in_4bit", "False (BitsAndBytesConfig)", ("model.quantize_4bit",)),
    OtherName("bnb_4bit_quant_type", "'fp4' (BitsAndBytesConfig)", ("model.bnb_4bit_quant_type",)),
    OtherName("bnb_4bit_use_double_quant", "False (BitsAndBytesConfig)", ("model.bnb_4bit_use_double_quant",)),
    OtherName("bnb_4bit_compute_dtype", "None (BitsAndBytesConfig)", ("model.bnb_4bit_compute_dtype",)),
    OtherName("bnb_4bit_quant_storage", "None (BitsAndBytesConfig)", ("model.bnb_4bit_quant_storage",)),
)
_BY_NAME = {n.name: n for n in TRL_NAMES}


def schema_fields(cls: type = Config, prefix: str = "") -> list[tuple[str, Any, dataclasses.Field]]:
    """Every key of the schema as ``(dotted key, annotation, field)``, in schema order; ``data.datasets[i].*``
    follows ``data.datasets``."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out += schema_fields(hints[f.name], f"{prefix}{f.name}.")
            continue
        out.append((f"{prefix}{f.name}", hints[f.name], f))
        if hints[f.name] == list[DatasetConfig]:
            out += schema_fields(DatasetConfig, f"{prefix}{f.name}[i].")
    return out


def default_of(f: dataclasses.Field) -> Any:
    """The schema default of a field."""
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def all_keys() -> list[str]:
    """Every dotted key of the schema (without the ``data.datasets[i].*`` entry keys)."""
    return [key for key, _, _ in schema_fields() if "[i]" not in key]


def other_name(name: str) -> OtherName | None:
    """The TRL/transformers/peft argument ``name`` (the last part of a dotted key), or None."""
    return _BY_NAME.get(name.rsplit(".", 1)[-1])


def suggest(dotted: str, known: list[str] | None = None) -> str:
    """What an unknown key ``dotted`` probably meant, as a phrase for the error line ('' when nothing is close).

    A TRL/transformers name (``learning_rate``, ``per_device_train_batch_size``) gets its scale key; any other
    key gets the closest keys (:func:`difflib.get_close_matches`) of its own section, then of every section by its
    last part (``train.warmup_steps`` -> ``optim.warmup_steps``), then, for a word without a dot, the closest
    section (``optm`` -> ``optim``). The one rule for overrides, YAML files and ``scale-train --help TOPIC``.

    Args:
        dotted: the unknown key as written (``optim.learning_rate``).
        known: the dotted keys to choose from; default: every key of the schema.
    """
    known = all_keys() if known is None else known
    section, _, last = dotted.rpartition(".")
    by_last: dict[str, list[str]] = {}
    for k in known:
        by_last.setdefault(k.rpartition(".")[2], []).append(k)
    trl = other_name(dotted)
    if trl is not None and last not in by_last:  # a name of theirs only (seed, max_steps: ours too, below)
        if not trl.keys:
            return f"TRL/transformers' {trl.name} has no scale setting ({trl.note})"
        note = f"; {trl.note}" if trl.note else ""
        return (f"TRL/transformers' {trl.name} is {' and '.join(trl.keys)} here (scale default "
                f"{_defaults(trl.keys)}; TRL {trl.default}){note}")
    close = by_last.get(last, [])  # the same name in another section: train.lr -> optim.lr
    if not close:
        same = {k.rpartition(".")[2]: k for k in known if k.rpartition(".")[0] == section}
        close = [same[name] for name in difflib.get_close_matches(last, list(same), n=2, cutoff=0.7)]
    if not close:
        close = [k for name in difflib.get_close_matches(last, list(by_last), n=2, cutoff=0.75) for k in by_last[name]]
    if not close and not section:  # a section's name: --help optm, optm={lr: 0.1}
        sections = sorted({k.split(".")[0] for k in known if "." in k})
        close = difflib.get_close_matches(last, sections, n=1, cutoff=0.6)
    return f"did you mean {' or '.join(close[:3])}?" if close else ""


def _defaults(keys: tuple[str, ...]) -> str:
    fields = {k: f for k, _, f in schema_fields()}
    return ", ".join(repr(default_of(fields[k])) for k in keys)


def trl_table() -> str:
    """The markdown table of :data:`TRL_NAMES` for ``docs/config.md``."""
    rows = ["| TRL / transformers / peft | its default | scale key | scale default | note |", "|---|---|---|---|---|"]
    for n in TRL_NAMES:
        keys = ", ".join(f"`{k}`" for k in n.keys) or "-"
        ours = f"`{_defaults(n.keys)}`" if n.keys else "-"
        cells = (f"`{n.name}`", n.default, keys, ours, n.note or "")
        rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(rows)


def rl_differences(cfg: Config) -> list[str]:
    """What a TRL ``GRPOTrainer`` user would not expect of a ``loss.objective: grpo`` run (docs/rl.md)."""
    rl, t = cfg.rl, cfg.train
    budget = cfg.data.max_length - rl.max_completion_length
    out = [(f"a prompt longer than data.max_length - rl.max_completion_length = {budget} tokens loses its oldest "
            f"tokens (TRL: prompts are not cut)"),
           ("every completion is sampled with a seed of its own (train.seed, the step, the prompt), the same on any "
            "number of ranks (TRL: the global RNG of the rank)")]
    if rl.loss_type == "bnpo":
        out.append("rl.loss_type=bnpo divides by the optimizer step's tokens on every rank (TRL: each micro-batch by "
                   "its own tokens on its own rank)")
    if (rl.steps_per_generation or t.gradient_accumulation_steps) > t.gradient_accumulation_steps:
        out.append("a round's completions are dealt to its optimizer steps round-robin, the same for any number of "
                   "ranks (TRL: shuffled first)")
    return out


def differences_from_trl(cfg: Config, warmup: int) -> list[str]:
    """The run's settings that a TRL ``SFTTrainer`` user would not expect, one phrase each, for the start-up log.

    Only what differs from TRL's defaults in this run's resolved config (a schedule set to TRL's is not named).

    Args:
        cfg: the resolved config.
        warmup: the run's warmup steps (:func:`scale.training.schedule.warmup_steps`).
    """
    o, t, d = cfg.optim, cfg.train, cfg.data
    out = []
    if (o.schedule, o.min_lr_ratio, warmup) != ("linear", 0.0, 0):
        decay = "constant" if o.schedule == "constant" else f"{o.schedule} decay to {o.min_lr_ratio:g}x lr"
        out.append(f"lr {o.lr:g}: {warmup} warmup steps, then {decay} (TRL: linear from learning_rate to 0, "
                   f"no warmup; optim.schedule, optim.min_lr_ratio, optim.warmup_steps)")
    if cfg.loss.samples_online():  # GRPO: TRL's GRPOTrainer's defaults (docs/rl.md)
        out += rl_differences(cfg)
    else:
        out.append(f"a row longer than data.max_length={d.max_length} tokens loses its oldest tokens and keeps the "
                   f"trained end (TRL: max_length=1024, truncation keeps the start)")
    every = f", every {t.eval_every} steps" if t.eval_every else ""
    out.append(f"evaluation at step 0{every} and at the end (TRL: none unless eval_strategy is set; train.eval_every)")
    if not cfg.loss.trains_pairs() and not cfg.loss.samples_online():  # pairs, completions: as TRL trains them
        out.append("a row trains only its tail, the tokens between [[ and ]] in the row shown above (TRL: every token "
                   "of a text or chat row unless assistant_only_loss=true; a prompt-completion row's completion)")
    if cfg.loss.trains_pairs() and d.pair_conventions == "scale":
        out.append("a pair's tokens follow scale's conventions (a text prompt encoded alone, the tokenizer's BOS, a "
                   "chat answer ending at its end-of-turn marker, ORPO's NLL per answer); data.pair_conventions=trl "
                   "gives TRL's (docs/preference.md)")
    if t.save_total_limit is not None:
        out.append(f"only the newest train.save_total_limit={t.save_total_limit} checkpoints are kept (TRL: all)")
    return out
