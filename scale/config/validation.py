"""The config's rules: allowed choices, bounds and combinations, checked when a :class:`scale.config.schema.Config` is
built (``Config.__post_init__``), and :class:`ConfigError`, the error they raise. Plain Python, no torch.

The schema imports this module, not the other way round: the rules read a config (and its sections) through
attributes and :func:`get_key`, so they take it as ``Any``; each docstring names the schema class it reads.
"""

from __future__ import annotations

import math
from typing import Any


class ConfigError(ValueError):
    """A config key is unknown, has the wrong type, or contradicts another key."""


def get_key(cfg: Any, dotted: str) -> Any:
    """Return ``cfg.a.b`` for ``dotted == "a.b"``."""
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


_CHOICES = {
    "model.finetune": ("lora", "full"),
    "model.dtype": ("float32", "bfloat16", "float16"),
    "model.bnb_4bit_quant_type": ("nf4", "fp4"),
    "model.bnb_4bit_compute_dtype": ("float32", "bfloat16", "float16", "auto"),
    "model.bnb_4bit_quant_storage": ("uint8", "float32", "bfloat16", "float16"),
    "data.padding_side": ("left", "right"),
    "data.train_on": ("all_assistant", "all_assistant_as_last", "last_assistant"),
    "data.truncation": ("keep_end", "drop"),
    "data.pair_conventions": ("scale", "trl"),
    "model.gradient_checkpointing": (True, False, "every_n", "offload"),
    "model.attn_implementation": (None, "sdpa", "eager", "flash_attention_2", "flex_attention"),
    "model.kernels": (None, "liger"),
    "model.qlora_residual_dtype": ("float32", "compute"),
    "lora.expert_impl": (None, "split", "peft"),
    "loss.objective": ("sft", "dpo", "simpo", "orpo", "grpo"),  # what scale.objectives.build_objective builds
    "loss.dpo_loss": ("sigmoid", "ipo", "hinge"),
    "loss.reference": ("adapter", "model", "precomputed"),
    "data.format": ("auto", "text", "classification", "prompt_completion", "prompts", "messages", "preference"),
    "rl.scale_rewards": ("group", "batch", "none"),
    "rl.loss_type": ("grpo", "dr_grpo", "dapo", "bnpo"),
    "rl.importance_sampling_level": ("token", "sequence"),
    "rl.generator": ("transformers", "vllm"),
    "data.stopping_strategy": ("first_exhausted", "all_exhausted"),
    "loss.criterion_mode": ("plain", "input"),
    "loss.fused": (None, "liger"),
    "optim.name": ("adamw", "sgd"),
    "optim.schedule": ("cosine", "linear", "constant"),
    "train.mixed_precision": ("auto", "no", "bf16", "fp16"),
    "train.on_nonfinite": ("error", "skip"),
    "train.keep_best_mode": ("auto", "min", "max"),
}
_POSITIVE = ("train.micro_batch_size", "train.gradient_accumulation_steps",
             "train.eval_micro_batch_size", "train.log_every", "data.max_length", "lora.r",
             "data.mega_batch_steps", "model.checkpoint_every_n_layers",
             "train.sequence_parallel_size")


def _validate_auto_batch(t: Any) -> None:
    """``train.micro_batch_size: auto`` and its two keys (a :class:`scale.config.schema.TrainConfig`)."""
    if not 0 < t.auto_memory_fraction <= 1:
        raise ConfigError(f"train.auto_memory_fraction={t.auto_memory_fraction} must be in (0, 1]: the share of one "
                          f"GPU's memory train.micro_batch_size=auto may plan for (default 0.75)")
    if t.auto_global_batch_size is not None and t.micro_batch_size != "auto":
        raise ConfigError(f"train.auto_global_batch_size={t.auto_global_batch_size} is read only with "
                          f"train.micro_batch_size=auto: drop it, or set train.micro_batch_size=auto")
    if t.auto_global_batch_size is not None and t.auto_global_batch_size < 1:
        raise ConfigError(f"train.auto_global_batch_size={t.auto_global_batch_size} must be >= 1, or null")


def validate(cfg: Any) -> None:
    """Check every rule of a :class:`scale.config.schema.Config` (choices, bounds, combinations).

    Raises:
        ConfigError: one line naming the field and the fix.
    """
    for key, allowed in _CHOICES.items():
        value = get_key(cfg, key)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not one of {list(allowed)}")
    for key in _POSITIVE:
        if key == "train.micro_batch_size" and cfg.train.micro_batch_size == "auto":
            continue
        if isinstance(get_key(cfg, key), str):  # train.micro_batch_size, the one such key that takes a word
            raise ConfigError(f"{key}={get_key(cfg, key)!r} must be a number >= 1 or 'auto'")
        if get_key(cfg, key) < 1:
            raise ConfigError(f"{key}={get_key(cfg, key)} must be >= 1")
    _validate_auto_batch(cfg.train)
    _validate_length(cfg.train)
    if cfg.data.num_proc is not None and cfg.data.num_proc < 1:
        raise ConfigError(f"data.num_proc={cfg.data.num_proc} must be >= 1, or null for the CPUs this process may use")
    _validate_datasets(cfg.data)
    _validate_preference(cfg)
    _validate_finetune(cfg)
    _validate_tokens(cfg)
    _validate_reference(cfg)
    _validate_rl(cfg)
    if cfg.train.eval_every < 0:
        raise ConfigError("train.eval_every must be >= 0 (0 evaluates only at step 0 and the end)")
    if cfg.train.save_every < 0:
        raise ConfigError("train.save_every must be >= 0 (0 writes a checkpoint only when pre-empted)")
    if cfg.train.save_every_minutes is not None and not cfg.train.save_every_minutes > 0:
        raise ConfigError(f"train.save_every_minutes={cfg.train.save_every_minutes} must be > 0, or null for no time "
                          f"interval")
    if cfg.train.save_total_limit is not None and cfg.train.save_total_limit < 1:
        raise ConfigError(f"train.save_total_limit={cfg.train.save_total_limit} must be >= 1, or null to keep all")
    peak = cfg.log.peak_flops
    if peak is True or isinstance(peak, str) and peak != "measure" or isinstance(peak, float) and not 0 < peak < math.inf:
        raise ConfigError(f"log.peak_flops={peak!r} must be a positive number (FLOP/s), 'measure', false (no MFU) "
                          f"or null")
    _validate_best(cfg)
    if cfg.train.rendezvous_timeout_s <= 0:
        raise ConfigError(f"train.rendezvous_timeout_s={cfg.train.rendezvous_timeout_s} must be > 0 (seconds)")
    if cfg.train.rendezvous_retries < 0:
        raise ConfigError(f"train.rendezvous_retries={cfg.train.rendezvous_retries} must be >= 0 (0: no retry)")
    if cfg.log.wandb_log_model not in (False, "end", "checkpoint"):
        raise ConfigError(f"log.wandb_log_model={cfg.log.wandb_log_model!r} must be false, 'end' or 'checkpoint'")
    if cfg.train.collective_timeout_s <= 0:
        raise ConfigError(f"train.collective_timeout_s={cfg.train.collective_timeout_s} must be > 0 (seconds)")
    if not cfg.data.template.endswith("{label}") or "{text}" not in cfg.data.template:
        raise ConfigError(f"data.template={cfg.data.template!r} must contain '{{text}}' and end with '{{label}}'")
    threshold = cfg.loss.threshold
    if threshold != "all" and not (isinstance(threshold, int) and threshold >= 1):
        raise ConfigError(f"loss.threshold={threshold!r} must be a number of tokens >= 1, or 'all' (the text format "
                          f"trains every token of the row after the first)")
    if cfg.loss.target_position > -1 or threshold != "all" and cfg.loss.target_position < -threshold:
        raise ConfigError(
            f"loss.target_position={cfg.loss.target_position} is outside the tail: it must be between "
            f"-{cfg.loss.threshold if threshold != 'all' else 'the row length'} and -1 (loss.threshold="
            f"{cfg.loss.threshold}); raise loss.threshold or move it")
    if len({label.strip() for label in cfg.data.labels}) < 2 or any(not label.strip() for label in cfg.data.labels):
        raise ConfigError(f"data.labels={cfg.data.labels} needs at least two distinct, non-empty labels "
                          f"(surrounding spaces are ignored)")
    if cfg.loss.type_weights is not None and not all(0 <= w < math.inf for w in cfg.loss.type_weights):
        raise ConfigError(f"loss.type_weights={cfg.loss.type_weights} must be finite and non-negative")
    if cfg.loss.criterion is not None and ":" not in cfg.loss.criterion:
        raise ConfigError(f"loss.criterion={cfg.loss.criterion!r} must look like 'package.module:function'")
    if cfg.loss.criterion is not None and cfg.loss.type_weights is not None:
        raise ConfigError("loss.criterion and loss.type_weights cannot be combined: a user criterion gets weight 1 "
                          "for every tail token, so the weights would be ignored. Drop loss.type_weights, or weigh "
                          "inside the criterion (loss.criterion_mode=input passes it the type ids)")
    if cfg.loss.fused == "liger" and (cfg.loss.type_weights is not None or cfg.loss.criterion is not None):
        raise ConfigError("loss.fused=liger computes an unweighted cross-entropy: it cannot apply loss.type_weights or "
                          "loss.criterion. Drop them, or set loss.fused=null (scale.loss.chunked's loss takes both)")
    chunk = cfg.loss.chunk_size
    if chunk != "auto" and not (isinstance(chunk, int) and chunk >= 0):
        raise ConfigError(f"loss.chunk_size={chunk!r} must be 'auto', 0 (unchunked) or a number of positions >= 1")
    if cfg.data.eval_size < 1:
        raise ConfigError(f"data.eval_size={cfg.data.eval_size} must be >= 1: the run reports held-out figures "
                          f"(eval/loss, eval/accuracy) at step 0 and at the end; use a small value such as 32 to "
                          f"keep most rows for training")
    for key in ("data.max_train_examples", "data.max_text_chars"):
        if get_key(cfg, key) is not None and get_key(cfg, key) < 1:
            raise ConfigError(f"{key}={get_key(cfg, key)} must be >= 1, or null for no limit")
    if cfg.data.num_workers < 0:
        raise ConfigError(f"data.num_workers={cfg.data.num_workers} must be >= 0")
    o = cfg.optim
    if o.max_grad_norm is not None and not o.max_grad_norm > 0:
        raise ConfigError(f"optim.max_grad_norm={o.max_grad_norm} must be > 0, or null to turn clipping off (0 "
                          f"would freeze the weights under DDP but mean 'off' under DeepSpeed)")
    for key, ok, rule in (("optim.lr", 0 < o.lr < math.inf, "must be > 0 and finite"),
                          ("optim.eps", 0 < o.eps < math.inf, "must be > 0 and finite"),
                          ("optim.weight_decay", 0 <= o.weight_decay < math.inf, "must be >= 0 and finite"),
                          ("optim.min_lr_ratio", 0 <= o.min_lr_ratio <= 1, "must lie in [0, 1]"),
                          ("optim.warmup_steps", o.warmup_steps >= 0, "must be >= 0"),
                          ("optim.warmup_ratio", o.warmup_ratio is None or 0 <= o.warmup_ratio <= 1,
                           "must lie in [0, 1] (a fraction of the run's optimizer steps), or null"),
                          ("optim.betas", len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas),
                           "must be two numbers in [0, 1)"),
                          ("lora.dropout", 0 <= cfg.lora.dropout < 1, "must lie in [0, 1)"),
                          ("lora.alpha", 0 < cfg.lora.alpha < math.inf, "must be > 0 and finite")):
        if not ok:
            raise ConfigError(f"{key}={get_key(cfg, key)} {rule}")
    if cfg.train.mixed_precision in ("bf16", "fp16") and cfg.model.quantize_4bit and \
            cfg.model.bnb_4bit_compute_dtype == "float32":
        want = "bfloat16" if cfg.train.mixed_precision == "bf16" else "float16"
        raise ConfigError(f"train.mixed_precision={cfg.train.mixed_precision} needs model.bnb_4bit_compute_dtype to "
                          f"match: it is float32; set model.bnb_4bit_compute_dtype={want} (or auto)")
    if cfg.model.qlora_residual_dtype == "compute" and not cfg.model.quantize_4bit:
        raise ConfigError("model.qlora_residual_dtype=compute applies to QLoRA only (model.quantize_4bit=true): "
                          f"without it the norms and embeddings stay in model.dtype={cfg.model.dtype} already; drop "
                          "the key or set model.quantize_4bit=true")


def _validate_datasets(d: Any) -> None:  # a DataConfig
    """Each ``data.datasets`` entry has a path, a weight > 0, a known format and a name of its own."""
    names: dict[str, int] = {}
    for i, ds in enumerate(d.datasets):
        key = f"data.datasets[{i}]"
        if not ds.path:
            raise ConfigError(f"{key}.path is missing: give each data set a source, e.g. {{path: data/a.jsonl, "
                              f"weight: 1}}")
        if not 0 < ds.weight < math.inf:
            raise ConfigError(f"{key}.weight={ds.weight} must be > 0 and finite (its share of the mixed train split "
                              f"is weight / sum of weights); remove the entry to leave the source out")
        if ds.format is not None and ds.format not in _CHOICES["data.format"]:
            raise ConfigError(f"{key}.format={ds.format!r} is not one of {list(_CHOICES['data.format'])}")
        name = dataset_name(ds)
        if name in names:
            raise ConfigError(f"{key} and data.datasets[{names[name]}] are both named {name!r} (data/{name}/* "
                              f"metrics); set {key}.name")
        names[name] = i


def dataset_name(ds: Any) -> str:
    """A :class:`scale.config.schema.DatasetConfig`'s ``name``, else the source's last path part without its extension
    (``data/a.jsonl`` -> ``a``)."""
    if ds.name:
        return ds.name
    parts = [p for p in str(ds.path).replace("\\", "/").split("/") if p and not any(c in p for c in "*?[")]
    last = parts[-1] if parts else str(ds.path)
    stem, dot, ext = last.rpartition(".")
    return stem if dot and ext.lower() in ("jsonl", "json", "csv", "tsv", "parquet", "arrow") else last


def best_mode(metric: str, mode: str = "auto") -> str:
    """``min`` or ``max``: how ``train.keep_best``'s metric improves (``mode`` unless it is ``auto``).

    Raises:
        ConfigError: ``auto`` and the name says neither (a loss/NLL/perplexity falls, an accuracy/match rises).
    """
    if mode in ("min", "max"):
        return mode
    name = metric.rsplit("/", 1)[-1]
    if name.endswith(("loss", "nll", "ppl", "perplexity")):
        return "min"
    if name.endswith(("accuracy", "exact_match", "f1")):
        return "max"
    raise ConfigError(f"train.keep_best={metric!r}: cannot tell whether lower or higher is better; set "
                      f"train.keep_best_mode=min or max")


def _validate_best(cfg: Any) -> None:  # a Config
    t, e = cfg.train, cfg.eval
    if e.generate_samples < 0 or e.max_new_tokens < 1:
        raise ConfigError(f"eval.generate_samples={e.generate_samples} must be >= 0 (0: no generation) and "
                          f"eval.max_new_tokens={e.max_new_tokens} >= 1")
    if t.keep_best is not None:
        if not t.keep_best.startswith("eval/"):
            raise ConfigError(f"train.keep_best={t.keep_best!r} must name an evaluation metric such as eval/loss, "
                              f"eval/accuracy or eval/gen_exact_match")
        best_mode(t.keep_best, t.keep_best_mode)
    if t.early_stopping_patience is not None:
        if t.early_stopping_patience < 1:
            raise ConfigError(f"train.early_stopping_patience={t.early_stopping_patience} must be >= 1, or null")
        if t.keep_best is None:
            raise ConfigError("train.early_stopping_patience needs train.keep_best: the metric whose improvement it "
                              "waits for (e.g. train.keep_best=eval/loss)")


def _validate_length(t: Any) -> None:  # a TrainConfig
    """Exactly one of ``train.max_steps`` and ``train.num_epochs``, and it is >= 1."""
    if (t.max_steps is None) == (t.num_epochs is None):
        if t.max_steps is None:
            raise ConfigError("set train.max_steps or train.num_epochs (exactly one): how long to train")
        raise ConfigError(f"train.max_steps={t.max_steps} and train.num_epochs={t.num_epochs} are both set; set "
                          f"exactly one (train.max_steps=null to train by epochs)")
    for key, value in (("train.max_steps", t.max_steps), ("train.num_epochs", t.num_epochs)):
        if value is not None and value < 1:
            raise ConfigError(f"{key}={value} must be >= 1")


def _validate_finetune(cfg: Any) -> None:  # a Config
    """``model.finetune=full`` with keys that only make sense for an adapter over a frozen base, or that would step
    16-bit weights: each refused in one line naming both keys and the fix."""
    m = cfg.model
    if m.finetune != "full":
        return
    full = "model.finetune=full"
    if m.quantize_4bit:
        raise ConfigError(f"{full} with model.quantize_4bit=true: QLoRA trains an adapter over a frozen 4-bit base, "
                          f"4-bit weights cannot be trained; set model.quantize_4bit=false or model.finetune=lora")
    if m.adapter is not None:
        raise ConfigError(f"{full} with model.adapter={m.adapter}: a full run starts from a model directory; merge the "
                          f"adapter (scale-export RUN) and set model.name_or_path=RUN/merged, model.adapter=null")
    if m.dtype != "float32":
        raise ConfigError(f"{full} with model.dtype={m.dtype}: the optimizer would step {m.dtype} weights (updates "
                          f"below |w|/256 vanish in bfloat16); set model.dtype=float32 (the fp32 masters) and "
                          f"train.mixed_precision=bf16 for bf16 compute")
    if cfg.train.mixed_precision == "fp16":
        raise ConfigError(f"{full} with train.mixed_precision=fp16: the loss scaler's state is not kept for full "
                          f"weights; set train.mixed_precision=bf16 (or no)")


def _validate_reference(cfg: Any) -> None:  # a Config
    """``loss.reference=model`` (a frozen copy of the starting weights) is a full run's: a LoRA run's in-step
    reference is the same base with its adapter switched off, at no memory (refused in one line naming the fix)."""
    if cfg.loss.objective == "dpo" and cfg.loss.reference == "model" and cfg.model.finetune != "full":
        raise ConfigError(f"loss.reference=model with model.finetune={cfg.model.finetune}: the reference is the "
                          f"base itself with the LoRA adapter switched off (no second copy of the weights); set "
                          f"loss.reference=adapter (or precomputed)")


def _validate_tokens(cfg: Any) -> None:  # a Config
    """``model.new_tokens``/``new_special_tokens`` and ``lora.modules_to_save``: non-empty names, each once; new tokens
    under LoRA need ``lora.modules_to_save`` (which modules it must name is checked on the model:
    :func:`scale.modeling.tokens.check_new_rows_train`)."""
    m, save = cfg.model, cfg.lora.modules_to_save
    for key, names in (("model.new_tokens", m.new_tokens), ("model.new_special_tokens", m.new_special_tokens),
                       ("lora.modules_to_save", save or [])):
        bad = [n for n in names if not isinstance(n, str) or not n]
        if bad or len(set(names)) != len(names):
            raise ConfigError(f"{key}={names!r}: every entry must be a non-empty string, each once")
    added = [("model.new_tokens", m.new_tokens), ("model.new_special_tokens", m.new_special_tokens)]
    key, names = next(((k, v) for k, v in added if v), (None, None))
    if key is not None and m.finetune == "lora" and not save:
        raise ConfigError(f"{key}={names} with model.finetune=lora and no lora.modules_to_save: the new tokens' "
                          f"embedding rows would never train; set lora.modules_to_save=[embed_tokens, lm_head] (the "
                          f"model's embedding and head) or model.finetune=full")


def _validate_preference(cfg: Any) -> None:
    """The preference objectives' numbers, and their data format."""
    loss = cfg.loss
    if not loss.trains_pairs():
        if cfg.data.pair_conventions != "scale":
            raise ConfigError(f"data.pair_conventions={cfg.data.pair_conventions} sets the tokens of preference pairs "
                              f"(loss.objective dpo, simpo or orpo); loss.objective={loss.objective} trains none: "
                              f"remove it")
        return
    if not loss.beta > 0:
        raise ConfigError(f"loss.beta={loss.beta} must be > 0 (DPO's usual 0.1; SimPO's 2 to 2.5)")
    if not 0 <= loss.label_smoothing < 0.5:
        raise ConfigError(f"loss.label_smoothing={loss.label_smoothing} must be in [0, 0.5): the probability that a "
                          f"pair's preference is flipped")
    if cfg.data.format not in ("auto", "preference"):
        raise ConfigError(f"loss.objective={loss.objective} trains preference pairs; data.format={cfg.data.format} "
                          f"has none: set data.format=preference (or auto)")


def _validate_rl(cfg: Any) -> None:  # a Config
    """``loss.objective: grpo`` and the ``rl`` section: the numbers, whole groups per rank, rounds of whole
    optimizer steps, room for a prompt, and the batch layouts rollouts come in (padded rows, one rank per row)."""
    if not cfg.loss.samples_online():
        return
    rl, t, d = cfg.rl, cfg.train, cfg.data
    if d.format not in ("auto", "prompts"):
        raise ConfigError(f"loss.objective=grpo samples completions of prompts; data.format={d.format} has none: set "
                          f"data.format=prompts (a prompt column, or data.prompt_template over the columns)")
    for key, ok, rule in (("rl.num_generations", rl.num_generations >= 2, "must be >= 2 (a group's advantages)"),
                          ("rl.max_completion_length", rl.max_completion_length >= 1, "must be >= 1"),
                          ("rl.temperature", 0 < rl.temperature < math.inf, "must be > 0 and finite"),
                          ("rl.top_p", 0 < rl.top_p <= 1, "must lie in (0, 1] (1: off)"),
                          ("rl.top_k", rl.top_k >= 0, "must be >= 0 (0: off)"),
                          ("rl.epsilon", 0 <= rl.epsilon < 1, "must lie in [0, 1)"),
                          ("rl.epsilon_high", rl.epsilon_high is None or rl.epsilon_high >= 0, "must be >= 0, or null"),
                          ("rl.beta", 0 <= rl.beta < math.inf, "must be >= 0 and finite (0: no reference)"),
                          ("rl.num_iterations", rl.num_iterations >= 1, "must be >= 1"),
                          ("rl.log_completions", rl.log_completions >= 0, "must be >= 0 (0: none)"),
                          ("rl.vllm_gpu_memory_utilization", 0 < rl.vllm_gpu_memory_utilization < 1,
                           "must lie in (0, 1)")):
        if not ok:
            raise ConfigError(f"{key}={get_key(cfg, key)} {rule}")
    if rl.max_completion_length >= d.max_length:
        raise ConfigError(f"rl.max_completion_length={rl.max_completion_length} leaves no room for a prompt in "
                          f"data.max_length={d.max_length} (prompt + completion); raise data.max_length or lower "
                          f"rl.max_completion_length")
    if t.micro_batch_size == "auto":
        raise ConfigError("train.micro_batch_size=auto is not planned for loss.objective=grpo yet (the rollout's KV "
                          "cache is not in the search); set a number of completions per micro-batch")
    ga = t.gradient_accumulation_steps
    spg = ga if rl.steps_per_generation is None else rl.steps_per_generation
    if spg < 1 or spg % ga:
        raise ConfigError(f"rl.steps_per_generation={rl.steps_per_generation} must be a multiple of "
                          f"train.gradient_accumulation_steps={ga} (a round of rollouts trains whole optimizer "
                          f"steps), or null for one step's micro-batches")
    if (t.micro_batch_size * spg) % rl.num_generations:
        raise ConfigError(f"rl.num_generations={rl.num_generations} does not divide the completions of a round on "
                          f"one rank (train.micro_batch_size={t.micro_batch_size} x rl.steps_per_generation={spg}): "
                          f"a prompt's group never spans two ranks; make train.micro_batch_size (or "
                          f"rl.steps_per_generation) a multiple of rl.num_generations / their common factors")
    if not rl.rewards:
        raise ConfigError("rl.rewards is empty: loss.objective=grpo needs a reward function, e.g. "
                          "rl.rewards=[{fn: exact_match, column: answer}] or ['my_rewards:exact_answer']")
    for key, on in (("data.packing", d.packing), ("data.padding_free", d.padding_free),
                    ("data.group_by_length", d.group_by_length)):
        if on:
            raise ConfigError(f"{key}=true does not apply to loss.objective=grpo: rollouts are padded rows of "
                              f"prompt + completion built each round; set {key}=false")
    if t.sequence_parallel_size != 1:
        raise ConfigError("loss.objective=grpo does not run under train.sequence_parallel_size > 1 yet; set it to 1")
