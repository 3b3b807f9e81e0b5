"""Expert LoRA: the split path (``lora.expert_impl: split``) against peft's (``peft``), memory and time.

    python benchmarks/moe_experts.py                       # the layer, fp32 and bf16 (~10 min on 2 busy cores)
    python benchmarks/moe_experts.py --dtypes bf16 --repeats 2
    python benchmarks/moe_experts.py --experts 16 --tokens 2 64   # a quick look

**The layer**: one Qwen3-30B-A3B-shaped MoE block (transformers' ``Qwen3MoeSparseMoeBlock``: router + 128 experts,
top-8, hidden 2048, expert width 768), random weights in fp32 or bf16, LoRA r=16, alpha=32 on both fused expert
weights (peft's ``ParamWrapper``; float32, as peft and the harness keep adapters; ``lora_B`` random so the adapter
is not zero), forward + backward of
``sum(out * g)`` on 4 x 512 tokens whose input requires grad (as a layer's inside a model). Each path runs the same
block: peft's computes ``W + B A`` for the stack and lets transformers' grouped kernel read it; the split path
(:mod:`scale.modeling.split_experts`) adds the adapter as two small grouped products on the routed pairs. Per path:

- peak live bytes: the most tensor bytes alive at once during forward + backward (``tests.live_bytes.LiveBytes``,
  what ``torch.cuda.max_memory_allocated`` reports on a GPU), the block's weights, input and LoRA gradients
  included; and the part above what was alive before (the weights and input);
- time: the median over ``--repeats`` forward + backward passes after one warm-up pass, the two paths alternating;
- agreement: the output and the LoRA gradients of the two paths, max difference relative to the largest value;
- ``scale-plan``'s count of the same (:func:`scale.planner.moe.count_moe_layer`, on fake tensors, for a one-layer
  Qwen3-30B-A3B config of the layer's shape and the same micro-batch, LoRA and dtype) against the bytes above the
  weights measured (target: within 5%).

**The model** (``--model``, fp32): a small Qwen3-MoE (:data:`MODEL`: 2 layers, 64 experts, top-8, hidden 512,
expert width 256), random weights, LoRA r=16 on every linear layer and expert weight (``scale.modeling.build.add_lora``,
checkpointing on, as the harness builds it), trained through the real loop (``scale.train.fit`` via
``benchmarks.common.Harness``) on 4 x 256-token rows: tokens/s (median of ``--repeats`` runs of ``--steps``
optimizer steps, the first not timed, the two paths alternating) and the peak live bytes of one micro-batch's
forward + backward, weights included; and the two paths' losses and gradient norms of the first run, which must
agree.

The last line reads ``split/peft: peak P, time T``, for scripts to check: the larger peak ratio over the layer's dtypes,
the larger time ratio over the layer's dtypes and the model (inverse tokens/s ratio).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # `python benchmarks/moe_experts.py`: make `scale` and `tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dataclasses import dataclass

from benchmarks.common import Harness, Job, synthetic_examples
from scale.modeling.moe import explicit_targets
from scale.modeling.moe_lora import use_split
from tests.live_bytes import LiveBytes

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
GIB = 2**30


def moe_block(experts: int, hidden: int, width: int, top_k: int, r: int, alpha: float, dtype: torch.dtype,
              seed: int = 0) -> torch.nn.Module:
    """A holder whose ``mlp`` is a random Qwen3-MoE block with peft's LoRA on its fused expert weights."""
    from peft import LoraConfig, inject_adapter_in_model
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=width, num_experts=experts,
                         num_experts_per_tok=top_k, norm_topk_prob=True)
    cfg._experts_implementation = "grouped_mm"  # what from_pretrained / from_config set on a whole model
    torch.manual_seed(seed)
    holder = torch.nn.Module()
    holder.mlp = Qwen3MoeSparseMoeBlock(cfg)
    with torch.no_grad():
        for p in holder.mlp.parameters():
            p.normal_(0, 0.02)
    holder.to(dtype)
    with explicit_targets():
        inject_adapter_in_model(LoraConfig(r=r, lora_alpha=alpha, target_modules=[],
                                           target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
                                holder)
    for name, p in holder.named_parameters():
        if "lora_" in name:  # float32 on a bf16 block, as get_peft_model (autocast_adapter_dtype) leaves a run's
            p.data = p.data.float()
            with torch.no_grad():
                if "lora_B" in name:
                    p.normal_(0, 0.02)
        p.requires_grad_("lora_" in name)  # the base frozen, as under LoRA
    return holder


def set_path(holder: torch.nn.Module, impl: str) -> None:
    """Switch the block's experts to ``impl`` (``split`` | ``peft``), parameters untouched."""
    from peft.tuners.lora.layer import ParamWrapper

    if impl == "split":
        assert use_split(holder, ["mlp.experts"]) == {}
    else:
        holder.mlp.experts.__class__ = ParamWrapper


def step(holder: torch.nn.Module, x: torch.Tensor, g: torch.Tensor, keep: bool = False) -> torch.Tensor | None:
    """Forward + backward of ``sum(out * g)``; returns a copy of the output if ``keep``. The output itself is dropped
    before backward, as the residual add drops it inside a model."""
    out = holder.mlp(x)
    out = out[0] if isinstance(out, tuple) else out
    loss = (out.float() * g).sum()
    kept = out.detach().float().clone() if keep else None
    del out
    loss.backward()
    return kept


def clear(holder: torch.nn.Module, x: torch.Tensor) -> None:
    for p in holder.parameters():
        p.grad = None
    x.grad = None


def planned_layer(args: argparse.Namespace, label: str) -> dict[str, int]:
    """What ``scale-plan`` counts for this layer (:func:`scale.planner.moe.count_moe_layer`, fake tensors): the bytes
    its forward + backward add on each path, for a one-layer Qwen3-30B-A3B config of the layer's shape, the
    benchmark's micro-batch and LoRA, the dtype ``label``, no autocast."""
    import tempfile

    from scale.config.load import load_config
    from scale.planner.census import build_meta_model, census, load_model_config
    from scale.planner.moe import count_moe_layer

    root = Path(__file__).resolve().parents[1]
    hf = json.loads((root / "configs" / "models" / "qwen3-30b-a3b.json").read_text())
    hf.update(num_hidden_layers=1, hidden_size=args.hidden, moe_intermediate_size=args.width, num_experts=args.experts,
              num_experts_per_tok=args.top_k)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(json.dumps(hf))
        cfg = load_config(root / "configs" / "train" / "tiny_cpu.yaml", [
            "log.trackers=[]", f"model.name_or_path={path}", f"model.dtype={str(DTYPES[label]).removeprefix('torch.')}",
            "model.quantize_4bit=false", "train.mixed_precision=no", f"train.micro_batch_size={args.tokens[0]}",
            f"data.max_length={args.tokens[1]}", f"lora.r={args.r}", f"lora.alpha={args.alpha}"])
        model = build_meta_model(cfg, load_model_config(cfg.model))
        return count_moe_layer(cfg, model, census(cfg, model))


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def layer_rows(args: argparse.Namespace) -> tuple[list[dict], dict[str, tuple[float, float]]]:
    """Measure both paths per dtype: table rows and, per dtype, ``(peak ratio, time ratio)`` split/peft."""
    rows, ratios = [], {}
    B, T = args.tokens
    for label in args.dtypes:
        dtype = DTYPES[label]
        holder = moe_block(args.experts, args.hidden, args.width, args.top_k, args.r, args.alpha, dtype).to(args.device)
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(B, T, args.hidden, generator=gen).to(args.device, dtype).requires_grad_()
        g = torch.randn(B, T, args.hidden, generator=gen).to(args.device)
        result: dict[str, dict] = {}
        for impl in ("peft", "split"):  # peak bytes, then the values, one pass each
            set_path(holder, impl)
            clear(holder, x)
            live = LiveBytes(*holder.parameters(), *holder.buffers(), x, g)
            with live:
                step(holder, x, g)
            clear(holder, x)
            out = step(holder, x, g, keep=True)
            grads = {n: p.grad.float() for n, p in holder.named_parameters() if p.grad is not None}
            result[impl] = {"peak": live.peak, "added": live.peak - live.before, "out": out, "grads": grads,
                            "times": []}
            del out
        for _ in range(args.repeats + 1):  # alternating; the first pass of each is the warm-up
            for impl in ("peft", "split"):
                set_path(holder, impl)
                clear(holder, x)
                sync(args.device)
                start = time.perf_counter()
                step(holder, x, g)
                sync(args.device)
                result[impl]["times"].append(time.perf_counter() - start)
        planned = planned_layer(args, label)
        ref = result["peft"]
        dev = max(float((result["split"]["grads"][n] - ref["grads"][n]).abs().max() / ref["grads"][n].abs().max())
                  for n in ref["grads"])
        dev = max(dev, float((result["split"]["out"] - ref["out"]).abs().max() / ref["out"].abs().max()))
        for impl in ("peft", "split"):
            r = result[impl]
            seconds = statistics.median(r["times"][1:])
            rows.append({"dtype": label, "path": impl, "peak": r["peak"], "added": r["added"], "seconds": seconds,
                         "tokens_per_s": B * T / seconds, "dev": dev if impl == "split" else 0.0,
                         "planned": planned[impl]})
        ratios[label] = (result["split"]["peak"] / ref["peak"],
                         statistics.median(result["split"]["times"][1:]) / statistics.median(ref["times"][1:]))
        del holder, result, ref
    return rows, ratios


# The model part's Qwen3-MoE on the CPU: experts dominate its matmuls, as in the real family.
MODEL = {"vocab_size": 8192, "hidden_size": 512, "intermediate_size": 1024, "moe_intermediate_size": 256,
         "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64, "num_experts": 64,
         "num_experts_per_tok": 8, "max_position_embeddings": 512, "tie_word_embeddings": True, "use_cache": False,
         "decoder_sparse_step": 1}
# The dry runs' (tests, benchmarks/gpu_check.py --dry-run): the same code paths in seconds.
TINY = {**MODEL, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8,
        "num_experts_per_tok": 2}
CONFIGS = {"small": MODEL, "tiny": TINY}


@dataclass
class MoeJob(Job):
    """:class:`benchmarks.common.Job` on a Qwen3-MoE config (its rows drawn from the config's vocabulary)."""

    hf: dict | None = None  # the config.json fields

    def examples(self) -> list:
        n = self.rows or self.steps * self.micro_batch_size * self.gradient_accumulation_steps
        return synthetic_examples(n, self.seq, self.hf["vocab_size"], self.seed, self.min_len, self.threshold)

    def eval_examples(self) -> list:
        return synthetic_examples(self.micro_batch_size, self.seq, self.hf["vocab_size"], self.seed + 1,
                                  self.min_len, self.threshold)

    def describe(self) -> str:
        c = self.hf
        return (f"Qwen3-MoE {c['num_hidden_layers']} layers, {c['num_experts']} experts, "
                f"top-{c['num_experts_per_tok']}, "
                f"hidden {c['hidden_size']}, expert width {c['moe_intermediate_size']}, vocabulary {c['vocab_size']}, "
                + super().describe().split(" shape, ", 1)[1])


def moe_model(job: MoeJob, device: str) -> torch.nn.Module:
    """The job's random Qwen3-MoE, built on ``device`` in the job's dtype, with LoRA as the harness adds it."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from scale.modeling.build import add_lora

    torch.manual_seed(job.seed)
    fields = {k: v for k, v in job.hf.items() if not k.startswith("_") and k not in ("architectures", "model_type")}
    with torch.device(device):
        base = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**{**fields, "use_cache": False}),
                                                dtype=getattr(torch, job.dtype))
    model = add_lora(base, job.model_cfg(), job.lora_cfg())
    model.train()
    return model


def set_model_path(model: torch.nn.Module, impl: str) -> None:
    """Switch every experts module of ``model`` to ``impl``, parameters untouched."""
    from peft.tuners.lora.layer import ParamWrapper

    from scale.modeling.moe import moe_layout

    experts = moe_layout(model).experts
    if impl == "split":
        assert use_split(model, experts) == {}
    else:
        for name in experts:
            model.get_submodule(f"base_model.model.{name}").__class__ = ParamWrapper


def first_step(model: torch.nn.Module, batch: dict, threshold: int) -> tuple[int, float, float]:
    """One micro-batch's forward (the tail loss) + backward from the current weights: (peak live bytes, weights and
    batch included; the loss; the LoRA gradients' norm)."""
    from scale.loss import tail as scale_loss

    live = LiveBytes(*model.parameters(), *model.buffers(), *batch.values())
    with live:
        tail, targets = scale_loss.forward_tail(model, batch, threshold)
        num, den = scale_loss.tail_loss(tail.float(), targets, torch.ones_like(targets, dtype=torch.float32))
        loss = num / den
        loss.backward()
    norm = float(torch.linalg.vector_norm(torch.stack([p.grad.double().norm() for p in model.parameters()
                                                       if p.grad is not None])))
    for p in model.parameters():
        p.grad = None
    return live.peak, float(loss.detach()), norm


def model_job(args: argparse.Namespace) -> MoeJob:
    """The model part's job: full rows, checkpointing on, AdamW, LoRA r=16 on every linear layer and expert."""
    name = args.model_config
    config = CONFIGS[name] if name in CONFIGS else json.loads(Path(name).read_text())
    bf16 = args.model_dtype == "bf16"
    return MoeJob(shape="qwen3-moe", seq=args.model_tokens[1], micro_batch_size=args.model_tokens[0],
                  gradient_accumulation_steps=1, steps=args.steps, warmup=1, min_len=args.model_tokens[1],
                  checkpointing=True, optimizer="adamw", dtype="bfloat16" if bf16 else "float32",
                  mixed_precision="bf16" if bf16 else "no", hf=config)


def model_rows(args: argparse.Namespace) -> tuple[list[dict], tuple[float, float]]:
    """Both paths on one model through the real loop: table rows and ``(peak ratio, time ratio)`` split/peft."""
    job = model_job(args)
    harness = Harness(job, model=moe_model(job, args.device), device=args.device)
    batch = {k: v.to(args.device) for k, v in harness.windows[0][0].items()}
    first, rates, peaks = {}, {"peft": [], "split": []}, {"peft": [], "split": []}
    for impl in ("peft", "split"):  # the same initial weights: the loss and gradient norm must agree
        set_model_path(harness.model, impl)
        first[impl] = first_step(harness.model, batch, job.threshold)
    for _ in range(args.repeats):
        for impl in ("peft", "split"):  # each run continues training the same model: only its speed is compared
            set_model_path(harness.model, impl)
            if args.device == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            try:
                rates[impl].append(harness.run().tokens_per_s)
            except torch.OutOfMemoryError:
                rates[impl].append(float("nan"))
            if args.device == "cuda":
                peaks[impl].append(torch.cuda.max_memory_allocated())
    harness.close()
    dev = max(abs(first["split"][i] - first["peft"][i]) / abs(first["peft"][i]) for i in (1, 2))
    rows = [{"path": impl, "peak": first[impl][0], "run_peak": max(peaks[impl], default=0),
             "tokens_per_s": statistics.median(rates[impl]), "dev": dev if impl == "split" else 0.0}
            for impl in ("peft", "split")]
    return rows, (first["split"][0] / first["peft"][0],
                  statistics.median(rates["peft"]) / statistics.median(rates["split"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtypes", nargs="*", default=["fp32", "bf16"], choices=sorted(DTYPES),
                        help="the layer's dtypes (none: skip the layer)")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--width", type=int, default=768, help="expert width (moe_intermediate_size)")
    parser.add_argument("--tokens", type=int, nargs=2, default=[4, 512], metavar=("ROWS", "LENGTH"))
    parser.add_argument("--r", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=32.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", action="store_true", help="also a full model through the real loop")
    parser.add_argument("--model-config", default="small",
                        help="small (MODEL), tiny (TINY) or a config.json (configs/models/qwen3-30b-a3b.json on a GPU)")
    parser.add_argument("--model-tokens", type=int, nargs=2, default=[4, 256], metavar=("ROWS", "LENGTH"))
    parser.add_argument("--model-dtype", default="fp32", choices=sorted(DTYPES))
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per run of the model part")
    args = parser.parse_args(argv)
    ratios: dict[str, tuple[float, float]] = {}
    if args.dtypes:
        print(f"# MoE layer: {args.experts} experts, top-{args.top_k}, hidden {args.hidden}, expert width "
              f"{args.width}, LoRA r={args.r}; forward + backward on {args.tokens[0]} x {args.tokens[1]} tokens on "
              f"{args.device}; torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
        rows, ratios = layer_rows(args)
        print("\n| dtype | path | peak live GiB | above weights GiB | scale-plan GiB (planned/measured) | fwd+bwd s | "
              "tokens/s | split vs peft |")
        print("|---|---|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            print(f"| {r['dtype']} | {r['path']} | {r['peak'] / GIB:.3g} | {r['added'] / GIB:.3g} | "
                  f"{r['planned'] / GIB:.3g} ({r['planned'] / r['added']:.3f}) | {r['seconds']:.2f} | "
                  f"{r['tokens_per_s']:.0f} | {r['dev']:.1e} |")
        for label, (peak, seconds) in ratios.items():
            print(f"{label}: split/peft peak {peak:.2f}, time {seconds:.2f}")
    if args.model:
        job_rows, (peak, seconds) = model_rows(args)
        print(f"\n# model: {model_job(args).describe()}; the real loop (scale.train.fit) on {args.device}, "
              f"{args.repeats} runs per path (alternating, one model switched between the paths)")
        print("\n| path | peak live GiB (one micro-batch) | peak allocated GiB (runs) | tokens/s | "
              "loss, grad norm vs peft |")
        print("|---|---:|---:|---:|---:|")
        for r in job_rows:
            print(f"| {r['path']} | {r['peak'] / GIB:.3g} | {r['run_peak'] / GIB:.3g} | {r['tokens_per_s']:.0f} | "
                  f"{r['dev']:.1e} |")
        print(f"model: split/peft peak {peak:.2f}, time {seconds:.2f}")
        ratios["model time"] = (0.0, seconds)  # the model's target is its time (tokens/s); its peak holds attention
    if ratios:
        peak = max(p for p, _ in ratios.values())
        seconds = max(t for _, t in ratios.values())
        print(f"split/peft: peak {peak:.2f}, time {seconds:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
