"""Activation memory with gradient checkpointing on and off, for the same LoRA job.

    python benchmarks/checkpointing_memory.py [--batch 8] [--seq 128 256]

Counts the bytes autograd keeps for backward (unique storages, parameters excluded) during one forward
of a SmolLM2-135M-shaped Llama (random weights; config built in code, no download) with LoRA r=16 on all
linear layers and the tail loss. A count, not a timing: it is the same on any machine. With
non-reentrant checkpointing, torch's own hooks take the tensors inside each checkpointed layer, so what
our outer hook sees is what stays alive until backward.
"""

from __future__ import annotations

import argparse
import sys

import torch

import scale.loss as scale_loss
from scale.config.schema import LoraConfig, ModelConfig
from scale.modeling.build import add_lora

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True, use_cache=False)


def saved_bytes(model: torch.nn.Module, batch: dict[str, torch.Tensor], threshold: int) -> tuple[int, float]:
    """(bytes saved for backward, loss) for one forward of the tail loss."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        tail, targets = scale_loss.forward_tail(model, batch, threshold)
        num, den = scale_loss.tail_loss(tail, targets, torch.ones_like(targets, dtype=torch.float32))
    loss = num / den
    loss.backward()
    return sum(seen.values()), loss.item()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, nargs="+", default=[128, 256])
    args = parser.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    rows = ["| T | checkpointing off (MiB) | on (MiB) | ratio | same loss |", "|---|---|---|---|---|"]
    for T in args.seq:
        ids = torch.randint(3, 49152, (args.batch, T), generator=torch.Generator().manual_seed(0))
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        out = {}
        for gc_on in (False, True):
            torch.manual_seed(0)
            base = LlamaForCausalLM(LlamaConfig(**SMOLLM2))
            model = add_lora(base, ModelConfig(gradient_checkpointing=gc_on), LoraConfig(r=16, alpha=32, dropout=0.0))
            model.train()
            out[gc_on] = saved_bytes(model, batch, threshold=2)
        off, on = out[False][0] / 2**20, out[True][0] / 2**20
        rows.append(f"| {T} | {off:.1f} | {on:.1f} | {off / on:.1f}x | {out[False][1] == out[True][1]} |")
        sys.stdout.write(rows[-1] + "\n")
    sys.stdout.write(f"\nSmolLM2-135M shape, LoRA r=16 all-linear, micro-batch {args.batch}, fp32\n" + "\n".join(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
