"""Logits memory: our tail loss vs the original loop's full-logits loss on the same batch.

    python benchmarks/logits_memory.py [--batch 4] [--seq 256 1024 2048]

SmolLM2-135M shape (vocab 49,152; random weights from a config, no download), fp32. For each length it
runs the original loop's formula (``model(ids).logits`` -> ``[B, T, V]``, then the last ``threshold`` predictions)
and ours (``forward_tail``: ``logits_to_keep`` -> ``[B, N, V]``) and records the bytes of every tensor the
LM head returns (a count, not a timing), and checks both give the same loss.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

import scale.loss as scale_loss

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True, use_cache=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, nargs="+", default=[256, 1024, 2048])
    parser.add_argument("--threshold", type=int, default=2)
    args = parser.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2)).eval()
    logits_bytes: list[int] = []
    model.lm_head.register_forward_hook(lambda m, i, out: logits_bytes.append(out.numel() * out.element_size()))
    N = args.threshold
    rows = ["| T | original loop: full logits (MiB) | ours: tail logits (MiB) | ratio | loss diff |", "|---|---|---|---|---|"]
    worst_ratio = float("inf")
    for T in args.seq:
        ids = torch.randint(3, 49152, (args.batch, T), generator=torch.Generator().manual_seed(T))
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        with torch.no_grad():
            logits_bytes.clear()
            logits = model(input_ids=ids, attention_mask=batch["attention_mask"]).logits          # [B, T, V]
            original = F.cross_entropy(logits[:, -N - 1:-1].reshape(-1, logits.shape[-1]), ids[:, -N:].reshape(-1))
            full = sum(logits_bytes)
            del logits
            logits_bytes.clear()
            tail, targets = scale_loss.forward_tail(model, batch, N)                                        # [B, N, V]
            num, den = scale_loss.tail_loss(tail, targets, torch.ones(args.batch, N))
            ours = sum(logits_bytes)
        ratio = full / ours
        worst_ratio = min(worst_ratio, ratio)
        rows.append(f"| {T} | {full / 2**20:.1f} | {ours / 2**20:.2f} | {ratio:.0f}x | "
                    f"{abs((num / den).item() - original.item()):.1e} |")
        sys.stdout.write(rows[-1] + "\n")
    sys.stdout.write(f"\nSmolLM2-135M shape, micro-batch {args.batch}, threshold {N}, fp32\n" + "\n".join(rows) + "\n")
    sys.stdout.write(f"smallest ratio: {worst_ratio:.0f}x\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
