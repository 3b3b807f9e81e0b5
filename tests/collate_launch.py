"""Worker of tests/test_sampling.py: one SGD step of the tiny model on multi-turn chats whose tails hold untrained
user turns (weight 0), the same examples collated three ways: padded (``Collator``), padding-free
(``PaddingFreeCollator``) and packed (``PackedCollator``, two bins of two chats per rank). Run in the test process
(one rank) or under ``accelerate launch`` (2 CPU processes, DDP):

    accelerate launch --config_file configs/accelerate/cpu_ddp.yaml -m tests.collate_launch OUT

Rank 0 writes ``OUT/results.json`` (per collation: loss, gradient norm, trained and tail tokens over all ranks)
and ``OUT/<collation>.safetensors`` (the LoRA weights after the step, and ``delta.<name>``: the step's update).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from safetensors.torch import save_file

from scale.config.load import load_config
from scale.data import Collator, PackedCollator, PaddingFreeCollator, build_splits
from scale.modeling.build import build_model, load_tokenizer
from scale.objectives.tail import LossSpec
from tests.launching import CHATS, TINY

CHATS_PER_RANK = 4


def chats_with_untrained_turns(cfg, tokenizer, n: int) -> list:
    """The first ``n`` train chats whose tail holds a weight-0 (user) turn between two trained assistant turns."""
    splits = build_splits(cfg.data, cfg.loss, tokenizer, cfg.data.path, cfg.train.seed)
    chats = [e for e in splits.train if e.trained is not None and 0 in e.trained]
    assert len(chats) >= n, len(chats)
    return chats[:n]


def one_step(acc: Accelerator, out: Path) -> dict[str, dict[str, float]]:
    """One SGD step (lr 0.5) per collation from the same weights; returns and (rank 0) writes the figures."""
    cfg = load_config(str(TINY), [*CHATS, "data.cache=false", "lora.dropout=0.0"])
    tokenizer = load_tokenizer(cfg.model)
    chats = chats_with_untrained_turns(cfg, tokenizer, CHATS_PER_RANK * acc.num_processes)
    mine = chats[acc.process_index::acc.num_processes]
    half = len(mine) // 2
    batches = {"padded": Collator(tokenizer.pad_token_id, "left")(mine), "padding_free": PaddingFreeCollator()(mine),
               "packed": PackedCollator()([mine[:half], mine[half:]])}
    spec = LossSpec.from_config(cfg)
    results = {}
    for name, batch in batches.items():
        model = build_model(cfg.model, cfg.lora, len(tokenizer), cfg.train.seed)
        for p in model.parameters():  # LoRA B starts at zero: give it values so every gradient path is exercised
            if p.requires_grad:
                p.data.normal_(0, 0.05, generator=torch.Generator().manual_seed(p.numel()))
        before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
        model, optimizer = acc.prepare(model, optimizer)
        weights = spec.weights(batch)
        den = acc.reduce(weights.sum(), reduction="sum")
        num = spec.loss_step(model, batch, weights)
        acc.backward(num * acc.num_processes / den)  # DDP averages over ranks: the step is sum(num) / sum(den)
        grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()
                                                          if p.grad is not None]))
        optimizer.step()
        loss = acc.reduce(num.detach(), reduction="sum") / den
        trained = acc.reduce(batch["tail_mask"].sum(), reduction="sum")
        tails = acc.reduce(torch.tensor(sum(e.tail_len for e in mine)), reduction="sum")
        results[name] = {"loss": float(loss), "grad_norm": float(grad_norm), "trained_tokens": int(trained),
                         "tail_tokens": int(tails)}
        after = {n: p.detach().clone() for n, p in acc.unwrap_model(model).named_parameters() if p.requires_grad}
        lora = {**after, **{f"delta.{n}": after[n] - before[n] for n in after}}
        if acc.is_main_process:
            save_file(lora, str(out / f"{name}.safetensors"))
        acc.free_memory(model, optimizer)
    if acc.is_main_process:
        (out / "results.json").write_text(json.dumps(results))
    acc.wait_for_everyone()
    return results


if __name__ == "__main__":
    target = Path(sys.argv[1])
    target.mkdir(parents=True, exist_ok=True)
    one_step(Accelerator(cpu=True), target)
