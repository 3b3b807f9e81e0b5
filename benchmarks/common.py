"""Shared pieces of the speed benchmarks: model shapes, synthetic data, the harness run, timing statistics.

Not a benchmark itself. Everything here builds models from a ``LlamaConfig`` with random weights (no
download) and synthetic left-padded rows whose last two real tokens are a label word and EOS, exactly the
shape of the harness's own data (``scale.data.Collator`` pads them).

The harness contestant (:func:`harness_run`) is the real ``scale.train.fit`` path: ``build_accelerator``,
``acc.prepare``, ``windows()``, ``accumulate()``, ``StepMeter``, the metrics sink, the unprepared LR
scheduler, evaluation at step 0 and at the end (on one small batch, outside the timed steps). Step times
come from a scheduler subclass that records ``time.perf_counter()`` after each ``scheduler.step()``: the
loop calls it exactly once per optimizer step, so the time between two stamps is one full step of the loop
as it runs (windows, forward/backward, clipping, optimizer, metrics, progress bar), with no hook in
``scale/train.py``.
"""

from __future__ import annotations

import math
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from scale.config.schema import Config, LogConfig, LoraConfig, LossConfig, ModelConfig, OptimConfig, TrainConfig
from scale.data import Collator, Example

# SmolLM2-135M (the real model's shape) and smaller/larger Llama shapes; random weights, built in code.
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=4),
    "small": dict(vocab_size=49152, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2),
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3),
    # Llama-3.2-1B's shape (1.24e9 parameters with tied embeddings).
    "llama-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8),
}
PAD, EOS, LABELS = 0, 2, (17, 23)  # synthetic token ids: padding, end of row, the two label words


def llama_config(shape: str | dict[str, Any], max_len: int = 2048) -> Any:
    """A ``LlamaConfig`` for a named shape (or a dict of its fields); tied embeddings, no KV cache."""
    from transformers import LlamaConfig

    fields = SHAPES[shape] if isinstance(shape, str) else shape
    return LlamaConfig(**fields, max_position_embeddings=max(max_len, 128), tie_word_embeddings=True,
                       use_cache=False)


def build_lora_model(shape: str | dict[str, Any], model_cfg: ModelConfig, lora_cfg: LoraConfig, seed: int = 0,
                     device: str | torch.device = "cpu", max_len: int = 2048) -> torch.nn.Module:
    """Random-weight Llama of ``shape`` + LoRA, built the way ``scale.modeling.build.build_model`` builds
    ``tiny-llama``.

    ``model_cfg`` supplies dtype, 4-bit quantization and checkpointing; 4-bit weights are quantized at load
    time by a round trip through a temporary directory (as ``scale.modeling.build.load_base`` does), onto
    ``device``. Same ``seed`` -> same base and LoRA weights.
    """
    from transformers import LlamaForCausalLM

    from scale.modeling.build import _DTYPES, add_lora, bnb_config, disable_cpu_inference_packing, reload_from_directory

    dtype = _DTYPES[model_cfg.dtype]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device(device):
            base = LlamaForCausalLM(llama_config(shape, max_len)).to(dtype)
    if model_cfg.quantize_4bit:
        device_map = {"": torch.device(device).index or 0} if torch.device(device).type == "cuda" else "cpu"
        base = reload_from_directory(base, dtype=dtype, quantization_config=bnb_config(model_cfg),
                                     device_map=device_map)
        base.config.use_cache = False
        disable_cpu_inference_packing(base)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = add_lora(base, model_cfg, lora_cfg)
    model.train()
    return model


def synthetic_examples(n: int, seq: int, vocab: int, seed: int = 0, min_len: int | None = None,
                       tail_len: int = 2) -> list[Example]:
    """``n`` rows of ``min_len..seq`` random tokens ending in a label word and EOS (left padding by the collator).

    ``min_len=seq`` gives rows without padding. Each row's last ``tail_len`` tokens are its trained tail.
    """
    g = torch.Generator().manual_seed(seed)
    lo = max(4, seq // 2 if min_len is None else min_len)
    rows = []
    for i in range(n):
        length = int(torch.randint(lo, seq + 1, (1,), generator=g))
        ids = torch.randint(3, vocab, (length,), generator=g).tolist()
        label = i % 2
        ids[-2], ids[-1] = LABELS[label], EOS
        rows.append(Example(ids, tail_len, label, LABELS[label], label))
    return rows


def collator() -> Collator:
    return Collator(PAD, "left")


def window_batches(examples: Sequence[Example], mb: int, ga: int, steps: int) -> list[list[dict[str, torch.Tensor]]]:
    """The micro-batches of each optimizer step, in order, as the harness sees them with ``shuffle=False``.

    Epochs restart when the data runs out; the last window of an epoch may hold fewer than ``ga`` batches.
    """
    collate = collator()
    epoch = [collate(list(examples[i:i + mb])) for i in range(0, len(examples), mb)]
    out: list[list[dict[str, torch.Tensor]]] = []
    while len(out) < steps:
        for i in range(0, len(epoch), ga):
            out.append(epoch[i:i + ga])
            if len(out) == steps:
                break
    return out


def step_tokens(windows: list[list[dict[str, torch.Tensor]]]) -> list[int]:
    """Real (unpadded) tokens per optimizer step."""
    return [int(sum(b["attention_mask"].sum() for b in w)) for w in windows]


def pad_fraction(windows: list[list[dict[str, torch.Tensor]]]) -> float:
    """Padded positions over all positions of ``windows``."""
    return 1.0 - sum(step_tokens(windows)) / sum(step_positions(windows))


def step_positions(windows: list[list[dict[str, torch.Tensor]]]) -> list[int]:
    """Padded positions per optimizer step (what the hardware computes)."""
    return [sum(b["input_ids"].numel() for b in w) for w in windows]


class TimedLambdaLR(torch.optim.lr_scheduler.LambdaLR):
    """``LambdaLR`` that records ``time.perf_counter()`` after every ``step()`` (once per optimizer step)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.stamps: list[float] = []
        super().__init__(*args, **kwargs)
        self.stamps.clear()  # the constructor's initial step is not an optimizer step

    def step(self, *args: Any, **kwargs: Any) -> None:
        super().step(*args, **kwargs)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.stamps.append(time.perf_counter())


def timed_span(stamps: list[float], tokens: list[int], warmup: int) -> tuple[float, int]:
    """(seconds, tokens) of optimizer steps ``warmup+1 .. len(stamps)`` (1-based), from the stamps.

    Step ``k``'s duration is ``stamps[k-1] - stamps[k-2]``; the first ``warmup`` steps are excluded.

    Raises:
        ValueError: ``warmup < 1`` (the first step has no start stamp) or no timed step left.
    """
    if warmup < 1 or warmup >= len(stamps):
        raise ValueError(f"need 1 <= warmup < steps ({len(stamps)}), got warmup={warmup}")
    return stamps[-1] - stamps[warmup - 1], sum(tokens[warmup:len(stamps)])


@dataclass
class Job:
    """What both sides of a comparison train on: shape, sizes and the optimisation recipe."""

    shape: str = "small"
    seq: int = 128
    micro_batch_size: int = 8
    gradient_accumulation_steps: int = 2
    steps: int = 12
    warmup: int = 2
    threshold: int = 2
    lora_r: int = 16
    checkpointing: bool = False
    dtype: str = "float32"
    mixed_precision: str = "no"
    quantize_4bit: bool = False
    lr: float = 2e-4
    max_grad_norm: float = 1.0
    log_every: int = 1
    seed: int = 0
    min_len: int | None = None
    group_by_length: bool = False  # ours: scale.data.order.LengthGroupedSampler over the rows (else their order)
    mega_batch_steps: int = 16
    rows: int | None = None        # rows in the data set; None: exactly `steps` global batches (one epoch)
    optimizer: str = "adamw"       # "sgd": plain SGD (no momentum), whose updates two devices' runs compare linearly
    mixed_paths: bool = True       # under bf16: scale.modeling.mixed_paths' paths of the device, as scale-train
                                   # takes them
    kernels: str | None = None     # model.kernels ("liger": Liger-Kernel's RMSNorm/SwiGLU/RoPE, CUDA only)

    def model_cfg(self) -> ModelConfig:
        compute = "bfloat16" if self.mixed_precision == "bf16" else "float32"
        return ModelConfig(name_or_path="benchmark", dtype=self.dtype, quantize_4bit=self.quantize_4bit,
                           bnb_4bit_compute_dtype=compute, gradient_checkpointing=self.checkpointing,
                           kernels=self.kernels)

    def lora_cfg(self) -> LoraConfig:
        return LoraConfig(r=self.lora_r, alpha=2.0 * self.lora_r, dropout=0.0, target_modules="all-linear")

    def optim_cfg(self) -> OptimConfig:
        return OptimConfig(lr=self.lr, warmup_steps=min(2, self.steps - 1), max_grad_norm=self.max_grad_norm)

    def config(self, output_dir: str) -> Config:
        """The harness config of this job (trackers off, eval only at step 0 and at the end)."""
        return Config(output_dir=output_dir, model=self.model_cfg(), lora=self.lora_cfg(),
                      loss=LossConfig(threshold=self.threshold, target_position=-2), optim=self.optim_cfg(),
                      train=TrainConfig(max_steps=self.steps, micro_batch_size=self.micro_batch_size,
                                        gradient_accumulation_steps=self.gradient_accumulation_steps,
                                        eval_micro_batch_size=self.micro_batch_size, log_every=self.log_every,
                                        eval_every=0, seed=self.seed, mixed_precision=self.mixed_precision,
                                        save_adapter=False, save_every=0, save_every_minutes=None),
                      log=LogConfig(trackers=[]))

    def describe(self) -> str:
        """One line naming the model, recipe and sizes (printed above every table)."""
        base = "NF4 4-bit base (double quant), " if self.quantize_4bit else ""
        return (f"{self.shape} shape, {base}LoRA r={self.lora_r} all-linear, {self.dtype} weights, "
                f"mixed_precision={self.mixed_precision}, checkpointing={'on' if self.checkpointing else 'off'}, "
                f"micro-batch {self.micro_batch_size} x GA {self.gradient_accumulation_steps}, "
                f"T={self.min_len or max(4, self.seq // 2)}..{self.seq} "
                f"(left-padded), threshold {self.threshold}, {self.steps} optimizer steps per run "
                f"({self.warmup} warm-up not timed)")

    def examples(self) -> list[Example]:
        """The data set: ``rows`` rows, by default one epoch of exactly ``steps`` full windows."""
        vocab = SHAPES[self.shape]["vocab_size"]
        n = self.rows or self.steps * self.micro_batch_size * self.gradient_accumulation_steps
        return synthetic_examples(n, self.seq, vocab, self.seed, self.min_len, self.threshold)

    def sampler(self, examples: list[Example]) -> Any:
        """Our length-grouped sampler over ``examples`` (``group_by_length``), else None (their order)."""
        if not self.group_by_length:
            return None
        from scale.data.order import LengthGroupedSampler

        return LengthGroupedSampler([len(e.input_ids) for e in examples],
                                    self.micro_batch_size * self.gradient_accumulation_steps, self.mega_batch_steps,
                                    self.seed)

    def ordered_examples(self) -> list[Example]:
        """The rows in the order our loop trains them (epoch 0)."""
        examples = self.examples()
        sampler = self.sampler(examples)
        return examples if sampler is None else [examples[i] for i in sampler]

    def eval_examples(self) -> list[Example]:
        return synthetic_examples(self.micro_batch_size, self.seq, SHAPES[self.shape]["vocab_size"], self.seed + 1,
                                  self.min_len, self.threshold)


class MemorySink:
    """Stands in for ``scale.training.metrics.JsonlSink``: keeps the rows in memory (same interface, no file)."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        self.rows.append({"step": step, **metrics})

    def train_losses(self) -> list[float]:
        return [r["train/loss"] for r in self.rows if "train/loss" in r]


def reset_accelerate() -> None:
    """accelerate's state is process-global; reset it before building another Accelerator (or a Trainer)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@dataclass
class RunResult:
    """One contestant's run: per-step stamps, the timed span and what the loss did."""

    seconds: float
    tokens: int
    losses: list[float] = field(default_factory=list)  # per logged step (harness) or per step (others)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


class Harness:
    """The ``scale.train.fit`` path for one job: built once (like ``scale.train.run``), run many times.

    Each :meth:`run` starts a fresh optimizer and scheduler on the *same* prepared model: the model keeps
    training across runs (the timing does not care). Build a new ``Harness`` for a run that starts from the
    initial weights (loss comparisons).
    """

    def __init__(self, job: Job, device: str | None = None, model: torch.nn.Module | None = None,
                 acc: Any = None) -> None:
        from torch.utils.data import DataLoader

        from scale.data.tasks import get
        from scale.distributed.launch import build_accelerator
        from scale.objectives.tail import LossSpec

        self.job = job
        self.tmp = tempfile.TemporaryDirectory()
        self.cfg = job.config(self.tmp.name)
        self.own_acc = acc is None  # several harnesses of the same precision may share one Accelerator
        if self.own_acc:
            reset_accelerate()
            acc = build_accelerator(self.cfg)
        self.acc = acc
        self.device = device or self.acc.device
        self.model = model if model is not None else build_lora_model(job.shape, self.cfg.model, self.cfg.lora,
                                                                      job.seed, self.device, job.seq)
        if model is None and self.cfg.model.kernels is not None:
            from scale.modeling.kernels import apply_kernels

            apply_kernels(self.model, self.cfg.model.kernels)  # as scale.training.parts.model does
        if model is None and job.mixed_paths and self.cfg.train.mixed_precision == "bf16":
            from scale.modeling.mixed_paths import paths_for, use_mixed_paths

            use_mixed_paths(self.model, paths_for(torch.device(self.device).type))  # as scale.training.parts.model does
        self.spec = LossSpec.from_config(self.cfg)
        # the synthetic rows are classification rows whose two labels are one token each: what evaluation ranks
        self.task = get("classification")
        self.task.restore({"label_seqs": [[t] for t in LABELS], "label_token_ids": list(LABELS)})
        collate = collator()
        examples = job.examples()
        self.train_dl = self.acc.prepare(DataLoader(examples, batch_size=job.micro_batch_size, shuffle=False,
                                                    sampler=job.sampler(examples), collate_fn=collate))
        self.acc.even_batches = True
        self.eval_dl = self.acc.prepare(DataLoader(job.eval_examples(), batch_size=job.micro_batch_size,
                                                   shuffle=False, collate_fn=collate))
        self.model = self.acc.prepare(self.model)
        self.windows = window_batches(job.ordered_examples(), job.micro_batch_size,
                                      job.gradient_accumulation_steps, job.steps)
        self.tokens = step_tokens(self.windows)

    def run(self) -> RunResult:
        from scale.distributed.launch import ModePlan
        from scale.train import fit
        from scale.training.job import Job
        from scale.training.metrics import MetricsLog
        from scale.training.schedule import lr_factor
        from scale.training.state import TrainerState

        o, steps = self.cfg.optim, self.cfg.train.max_steps
        params = [p for p in self.model.parameters() if p.requires_grad]
        optimizer = (torch.optim.SGD(params, lr=o.lr) if self.job.optimizer == "sgd" else
                     torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay))
        scheduler = TimedLambdaLR(optimizer, lambda s: lr_factor(s, o, steps))
        optimizer = self.acc.prepare(optimizer)
        sink = MemorySink()
        state = TrainerState(step=0, epoch=0, windows_in_epoch=0, world_size=self.acc.num_processes)
        job = Job(self.cfg, self.acc, ModePlan(mode="single"), self.model, optimizer, scheduler, self.train_dl,
                  self.eval_dl, self.spec, MetricsLog(self.acc, sink), state, task=self.task)
        fit(job)
        self.acc._optimizers.remove(optimizer)  # do not keep every run's optimizer state alive
        seconds, tokens = timed_span(scheduler.stamps, self.tokens, self.job.warmup)
        return RunResult(seconds, tokens, sink.train_losses(), {"rows": sink.rows, "stamps": scheduler.stamps})

    def close(self) -> None:
        if self.own_acc:
            self.acc.free_memory()
        self.tmp.cleanup()


def spread(values: Sequence[float]) -> tuple[float, float, float]:
    """(median, min, max)."""
    return statistics.median(values), min(values), max(values)


def fmt_spread(values: Sequence[float], digits: int = 3) -> str:
    """``median (min-max)`` of ``values``, or the single value."""
    med, lo, hi = spread(values)
    if len(values) == 1:
        return f"{med:.{digits}g}"
    return f"{med:.{digits}g} ({lo:.{digits}g}-{hi:.{digits}g})"


def max_rel_diff(a: Sequence[float], b: Sequence[float]) -> float:
    """max_i |a_i - b_i| / |a_i|; infinite when the lengths differ."""
    if len(a) != len(b) or not a:
        return math.inf
    return max(abs(x - y) / max(abs(x), 1e-30) for x, y in zip(a, b))


def machine_line() -> str:
    """One line naming the threads and torch build, printed under every table."""
    import os
    import platform

    return (f"torch {torch.__version__}, {torch.get_num_threads()} threads (OMP_NUM_THREADS="
            f"{os.environ.get('OMP_NUM_THREADS', 'unset')}), {platform.machine()}, "
            f"{os.cpu_count()} logical CPUs, cuda={torch.cuda.is_available()}")
