"""Length-grouped sampling: a deterministic permutation per epoch, the same rows per optimizer step in every
launch mode (it depends on the global batch only), less padding, and resume/epochs through accelerate."""

from __future__ import annotations

import json
import random

import pytest
import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from scale.data.order import LengthGroupedSampler, length_grouped_order, pad_fraction


def _lengths(n, seed=0):
    rng = random.Random(seed)
    return [rng.randint(10, 86) for _ in range(n)]


def test_order_is_a_deterministic_permutation_per_epoch():
    lengths = _lengths(203)
    a = length_grouped_order(lengths, 8, 4, seed=1234, epoch=0)
    assert sorted(a) == list(range(203))
    assert a == length_grouped_order(lengths, 8, 4, seed=1234, epoch=0)
    assert a != length_grouped_order(lengths, 8, 4, seed=1234, epoch=1)
    assert a != length_grouped_order(lengths, 8, 4, seed=1235, epoch=0)


def test_global_batches_are_grouped_and_the_partial_one_is_last():
    lengths = _lengths(203)                      # 25 full global batches of 8, then 3 rows
    G, k = 8, 4
    order = length_grouped_order(lengths, G, k, seed=0)
    batches = [order[i:i + G] for i in range(0, len(order), G)]
    assert [len(b) for b in batches] == [8] * 25 + [3]
    for b in batches:                            # longest first inside every global batch
        assert [lengths[i] for i in b] == sorted((lengths[i] for i in b), reverse=True)
    perm = torch.randperm(203, generator=torch.Generator().manual_seed(0)).tolist()
    for m in range(0, 203, G * k):               # a mega-batch keeps its rows (grouping happens inside it)
        assert set(order[m:m + G * k]) == set(perm[m:m + G * k])
    # The partial batch holds the shortest rows of the last mega-batch.
    last_mega = order[(203 // (G * k)) * G * k:]
    assert max(lengths[i] for i in batches[-1]) <= min(lengths[i] for i in last_mega[:-3])


def test_less_padding_than_random_batches():
    lengths = _lengths(800)
    random_order = torch.randperm(800, generator=torch.Generator().manual_seed(0)).tolist()
    grouped = length_grouped_order(lengths, 8, 16, seed=0)
    assert pad_fraction(lengths, random_order, 8) > 0.3
    assert pad_fraction(lengths, grouped, 8) < 0.06
    assert pad_fraction([3, 3, 1, 1], [0, 1, 2, 3], 2) == 0.0 and pad_fraction([3, 1], [0, 1], 2) == 1 - 4 / 6


def test_bad_sizes():
    with pytest.raises(ValueError, match="must be >= 1"):
        LengthGroupedSampler([1, 2], global_batch_size=0, mega_batch_steps=2, seed=0)


def _rows_per_step(acc, lengths, mb, ga, world, epoch, skip=0):
    """Rows of each optimizer step when ``world`` ranks shard the loader as accelerate does."""
    G = mb * ga * world
    steps = {}
    for rank in range(world):
        sampler = LengthGroupedSampler(lengths, G, 4, seed=7)
        dl = DataLoader(list(range(len(lengths))), batch_size=mb, sampler=sampler, collate_fn=torch.tensor)
        from accelerate.data_loader import prepare_data_loader, skip_first_batches

        dl = prepare_data_loader(dl, num_processes=world, process_index=rank, even_batches=False,
                                 use_seedable_sampler=True, put_on_device=False)
        dl.set_epoch(epoch)
        if skip:
            dl = skip_first_batches(dl, skip * ga)
            dl.set_epoch(epoch)
        for i, batch in enumerate(dl):
            steps.setdefault(skip + i // ga, set()).update(batch.tolist())
    return steps


def test_same_rows_per_step_in_every_mode_and_after_resume():
    Accelerator(cpu=True)                         # accelerate's sharding needs its state
    lengths = _lengths(100)
    ref = _rows_per_step(None, lengths, mb=8, ga=1, world=1, epoch=1)
    assert len(ref) == 13 and sum(len(r) for r in ref.values()) == 100
    for mb, ga, world in [(2, 4, 1), (2, 2, 2), (4, 1, 2), (1, 2, 4)]:
        assert _rows_per_step(None, lengths, mb, ga, world, epoch=1) == ref, (mb, ga, world)
    resumed = _rows_per_step(None, lengths, mb=2, ga=2, world=2, epoch=1, skip=5)
    assert resumed == {s: rows for s, rows in ref.items() if s >= 5}


def test_accelerate_keeps_the_sampler_and_passes_the_epoch(tmp_path, tokenizer):
    from scale.data import build_splits
    from scale.training.parts.loaders import make_loaders
    from tests.conftest import tiny_cfg

    cfg = tiny_cfg(tmp_path, "data.group_by_length=true", "data.mega_batch_steps=2")
    splits = build_splits(cfg.data, cfg.loss, tokenizer, cfg.data.path, cfg.train.seed)
    acc = Accelerator(cpu=True)
    train_dl, _ = make_loaders(cfg, splits, tokenizer.pad_token_id, acc.num_processes)
    prepared = acc.prepare(train_dl)
    from accelerate.data_loader import get_sampler

    sampler = get_sampler(prepared)
    assert isinstance(sampler, LengthGroupedSampler) and sampler.global_batch_size == 16
    lengths = [len(e.input_ids) for e in splits.train]
    for epoch in (0, 3):
        prepared.set_epoch(epoch)
        assert sampler.epoch == epoch
        seen = [r for b in prepared for r in b["row"].tolist()]
        expected = [splits.train[i].row for i in length_grouped_order(lengths, 16, 2, cfg.train.seed, epoch)]
        assert seen == expected


def test_grouped_resume_mid_epoch_is_bit_exact(tmp_path):
    """Grouping + dropout: resuming mid-epoch continues bit for bit (the loader draws no global RNG)."""
    from accelerate.state import AcceleratorState, GradientState
    from safetensors.torch import load_file

    from scale.train import run
    from scale.training.metrics import read_jsonl
    from tests.conftest import tiny_cfg

    job = ["data.max_train_examples=20", "train.micro_batch_size=2", "train.gradient_accumulation_steps=2",
           "train.max_steps=8", "train.log_every=1", "train.eval_every=0", "lora.dropout=0.1",
           "data.group_by_length=true", "data.mega_batch_steps=2"]
    run(tiny_cfg(tmp_path / "ref", *job, "train.save_every=4"))
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    run(tiny_cfg(tmp_path / "got", *job, f"train.resume_from={tmp_path}/ref/checkpoints/step_000004"))
    losses = [{r["step"]: r["train/loss"] for r in read_jsonl(tmp_path / d / "metrics.jsonl") if "train/loss" in r}
              for d in ("ref", "got")]
    assert sorted(losses[1]) == [5, 6, 7, 8] and all(losses[1][s] == losses[0][s] for s in losses[1])
    a, b = (load_file(tmp_path / d / "adapter" / "adapter_model.safetensors") for d in ("ref", "got"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


PACKED_LENS = (9, 4, 15, 6)  # rows of padding_free_case, with tails of 2, 1, 5 and 3 tokens


def padding_free_case(tokenizer, checkpointing: bool, type_of=lambda i: i % 2):
    """The tiny LoRA model (every LoRA weight non-zero) and four rows of :data:`PACKED_LENS` tokens as a padded and
    as a padding-free batch: ``(model, padded, packed)``. ``type_of(i)``: row ``i``'s type indicator."""
    from scale.config.schema import LoraConfig, ModelConfig
    from scale.data import Collator, Example
    from scale.data.collate import PaddingFreeCollator
    from scale.modeling.build import build_model

    model = build_model(ModelConfig(name_or_path="tiny-llama", gradient_checkpointing=checkpointing),
                        LoraConfig(r=4, dropout=0.0), len(tokenizer), seed=0)
    for p in model.parameters():  # LoRA B starts at zero: give it values so every gradient path is exercised
        if p.requires_grad:
            p.data.normal_(0, 0.05, generator=torch.Generator().manual_seed(p.numel()))
    g = torch.Generator().manual_seed(3)
    # Each row's own tail inside the packed row, right-aligned in tail_mask.
    examples = [Example(torch.randint(3, 300, (n,), generator=g).tolist(), tail_len=t, type_indicator=type_of(i),
                        target_token=7, row=i) for i, (n, t) in enumerate(zip(PACKED_LENS, (2, 1, 5, 3)))]
    return model, Collator(tokenizer.pad_token_id, "left")(examples), PaddingFreeCollator()(examples)


def test_padding_free_matches_padded_loss_and_gradients(tokenizer):
    """One packed row with restarting position ids = the padded batch: same tail loss and LoRA gradients."""
    from scale.loss.tail import forward_tail

    model, padded, packed = padding_free_case(tokenizer, checkpointing=False)
    assert packed["input_ids"].shape == (1, 34) and packed["seq_lens"].tolist() == [9, 4, 15, 6]
    assert packed["position_ids"][0, 9:13].tolist() == [0, 1, 2, 3]
    assert torch.equal(packed["tail_mask"], padded["tail_mask"]) and packed["tail_mask"].sum(1).tolist() == [2, 1, 5, 3]
    (a_logits, a_t), (b_logits, b_t) = forward_tail(model, padded), forward_tail(model, packed)
    mask = padded["tail_mask"].bool()
    assert torch.equal(a_t[mask], b_t[mask]) and a_logits.shape == b_logits.shape == (4, 5, len(tokenizer))
    # Padded and packed rows attend over the same keys in other orders and shapes: fp32 paths apart by at most
    # fp32_paths_rel (tests/bounds.py: vocabulary-long reductions, MLP-wide dot products), relative to the largest.
    from tests.bounds import fp32_paths_rel

    rel = fp32_paths_rel(len(tokenizer), model.config.intermediate_size)
    scale = a_logits[mask].abs().max()
    assert (a_logits[mask] - b_logits[mask]).abs().max() <= rel * scale
    grads = []
    for batch in (padded, packed):
        model.zero_grad()
        weights = _spec().weights(batch)
        num = _spec().loss_step(model, batch, weights)
        num.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    worst = max(float((grads[0][n] - grads[1][n]).abs().max() / grads[0][n].abs().max()) for n in grads[0])
    assert worst <= rel, (worst, rel)
    # Without restarting position ids the rows would attend to each other: the check above fails on that.
    crossed = dict(packed, position_ids=torch.arange(34)[None])
    assert (forward_tail(model, crossed)[0][mask] - a_logits[mask]).abs().max() > rel * scale


def _spec():
    from scale.objectives.tail import LossSpec

    return LossSpec(padding_side="left", type_weights=None, criterion=None)


def _same_step_as_padded(out):
    """What :mod:`tests.collate_launch` wrote: padding-free and packed batches of the same chats take padded's
    step (loss, gradient norm, LoRA weights and the step's update within 1e-5) and train the same tokens, fewer
    than the tails hold (the user turns inside them weigh 0). Returns the figures."""
    from safetensors.torch import load_file

    got = json.loads((out / "results.json").read_text())
    ref = got["padded"]
    assert ref["trained_tokens"] < ref["tail_tokens"], ref
    a = load_file(out / "padded.safetensors")
    for name in ("padding_free", "packed"):
        assert got[name]["trained_tokens"] == ref["trained_tokens"] and got[name]["tail_tokens"] == ref["tail_tokens"]
        assert abs(got[name]["loss"] - ref["loss"]) <= 1e-5 * ref["loss"], (name, got[name], ref)
        assert abs(got[name]["grad_norm"] - ref["grad_norm"]) <= 1e-5 * ref["grad_norm"], (name, got[name], ref)
        b = load_file(out / f"{name}.safetensors")
        assert a.keys() == b.keys()
        weights = [k for k in a if not k.startswith("delta.")]
        worst = max(float((a[k] - b[k]).abs().max() / a[k].abs().max()) for k in weights)
        # the update against the step's size (its largest element over every LoRA tensor): fp32 round-off only
        step = max(float(a[k].abs().max()) for k in a if k.startswith("delta."))
        update = max(float((a[k] - b[k]).abs().max()) for k in a if k.startswith("delta.")) / step
        assert worst <= 1e-5 and update <= 1e-5, (name, worst, update)
    return got


def test_packed_and_padding_free_train_what_padded_trains_on_multi_turn_chats(tmp_path):
    """Multi-turn chats (configs/data/tiny_chats.jsonl) whose tails hold weight-0 user turns: one SGD step on the
    same examples, padded, padding-free and packed, in this process (one rank)."""
    from tests.collate_launch import one_step

    got = one_step(Accelerator(cpu=True), tmp_path)
    assert _same_step_as_padded(tmp_path) == got


@pytest.mark.launch
def test_packed_and_padding_free_train_what_padded_trains_in_two_processes(tmp_path):
    """The same step under DDP (2 CPU processes, 4 chats per rank): every collation gives padded's step."""
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT
    from tests.launching import free_port

    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "configs" / "accelerate" / "cpu_ddp.yaml"), "--main_process_port", str(free_port()),
           "-m", "tests.collate_launch", str(tmp_path)]
    proc = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=ROOT, capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    got = _same_step_as_padded(tmp_path)
    assert got["padded"]["trained_tokens"] > 0


@pytest.mark.parametrize("data", ["tiny_reviews", "tiny_completions",
                                  pytest.param("tiny_chats", marks=pytest.mark.slow)])  # chats: ~25 s
def test_padding_free_job_matches_padded_job(tmp_path, data):
    """The tiny jobs (2-token tails; completion tails of 2 to 12 tokens; multi-turn chats whose tails hold
    weight-0 user turns), grouped, padded vs padding-free: the same per-step losses and gradient norms; no padded
    position at all."""
    from accelerate.state import AcceleratorState, GradientState

    from scale.train import run
    from scale.training.metrics import read_jsonl
    from tests.conftest import ROOT, tiny_cfg
    from tests.launching import CHATS

    job = ["data.max_train_examples=40", "train.max_steps=4", "train.log_every=1", "train.eval_every=0",
           "data.group_by_length=true", "optim.name=sgd", "optim.lr=0.5", "train.save_adapter=false",
           f"data.path={ROOT / 'configs' / 'data' / f'{data}.jsonl'}", *(CHATS[1:] if data == "tiny_chats" else [])]
    rows = {}
    for free in ("false", "true"):
        run(tiny_cfg(tmp_path / free, *job, f"data.padding_free={free}"))
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        rows[free] = [r for r in read_jsonl(tmp_path / free / "metrics.jsonl") if "train/loss" in r]
    for a, b in zip(rows["false"], rows["true"]):
        assert abs(a["train/loss"] - b["train/loss"]) <= 1e-5 * a["train/loss"]
        assert abs(a["train/grad_norm"] - b["train/grad_norm"]) <= 1e-5 * a["train/grad_norm"]
        assert a["train/tokens_per_s"] > 0 and b["train/pad_fraction"] == 0.0 <= a["train/pad_fraction"]
        assert 0 < b["train/mfu"] < 1
    assert len(rows["true"]) == 4 and any(a["train/pad_fraction"] > 0 for a in rows["false"])


def test_pack_bfd_fills_bins_best_fit_decreasing():
    """Every row in exactly one bin, no bin over capacity, the textbook BFD result, deterministic, errors."""
    from scale.data.order import pack_bfd

    # Longest first: 7 opens bin 0, 6 bin 1, 5 bin 2; 3 goes to bin 0 (room 3, the best fit, not bin 1's 4),
    # 3 then to bin 1 (room 4 -> 1), 2 to bin 2 (room 5 -> 3), 2 again to bin 2 (3 -> 1); the last 1 fits bins
    # 1 and 2 alike (room 1 each) and goes to the one that got that room last, bin 2.
    assert pack_bfd([2, 7, 3, 5, 6, 1, 3, 2], 10) == [[1, 2], [4, 6], [3, 0, 7, 5]]
    lengths = _lengths(2000)
    bins = pack_bfd(lengths, 128)
    assert sorted(i for b in bins for i in b) == list(range(2000))
    loads = [sum(lengths[i] for i in b) for b in bins]
    assert max(loads) <= 128 and len(bins) == pack_bfd(lengths, 128).__len__() and bins == pack_bfd(lengths, 128)
    assert len(bins) <= -(-sum(lengths) // 128) * 1.03  # within 3% of the lower bound on these lengths
    with pytest.raises(ValueError, match="row 1 has 200 tokens; packing needs 1..128"):
        pack_bfd([5, 200], 128)


def test_packed_loader_trains_every_row_once_and_matches_padded(tmp_path, tokenizer):
    """`data.packing`: an epoch of the real loader holds every train row once, in micro-batches of 2 bins of
    at most `max_length` tokens each; a packed micro-batch's tail loss and LoRA gradients equal the padded
    batch of the same examples within fp32 round-off (tests/bounds.py)."""
    from scale.data import Collator, build_splits
    from scale.modeling.build import build_model
    from scale.training.parts.loaders import make_loaders
    from tests.conftest import tiny_cfg

    cfg = tiny_cfg(tmp_path, "data.packing=true", "data.max_length=96", "train.micro_batch_size=2",
                   "data.cache=false")
    splits = build_splits(cfg.data, cfg.loss, tokenizer, cfg.data.path, cfg.train.seed)
    train_dl, _ = make_loaders(cfg, splits, tokenizer.pad_token_id)
    seen = []
    for batch in train_dl:
        assert batch["input_ids"].shape[1] == batch["seq_lens"].sum() <= 2 * 96
        seen.extend(batch["row"].tolist())
    assert sorted(seen) == sorted(int(e.row) for e in splits.train) and len(seen) == len(splits.train)
    assert len(train_dl) < len(splits.train) / 2 / 3  # > 3 rows per bin on the tiny reviews (10-86 tokens)

    model = build_model(cfg.model, cfg.lora, len(tokenizer), seed=0)
    for p in model.parameters():  # LoRA B starts at zero: give it values so every gradient path is exercised
        if p.requires_grad:
            p.data.normal_(0, 0.05, generator=torch.Generator().manual_seed(p.numel()))
    bins = next(iter(DataLoader(train_dl.dataset, batch_size=2, collate_fn=list)))
    packed = train_dl.collate_fn(bins)
    padded = Collator(tokenizer.pad_token_id, "left")([e for b in bins for e in b])
    spec, grads, losses = _spec(), [], []
    for batch in (padded, packed):
        model.zero_grad()
        num = spec.loss_step(model, batch, spec.weights(batch))
        num.backward()
        losses.append(float(num.detach()))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    from tests.bounds import fp32_paths_rel

    rel = fp32_paths_rel(len(tokenizer), model.config.intermediate_size)   # two fp32 paths (tests/bounds.py)
    assert abs(losses[0] - losses[1]) <= rel * abs(losses[0])
    worst = max(float((grads[0][n] - grads[1][n]).abs().max() / grads[0][n].abs().max()) for n in grads[0])
    assert worst <= rel, (worst, rel)


def test_packed_epoch_job_counts_its_steps_in_bins(tmp_path):
    """`train.num_epochs` with `data.packing`: one epoch is ceil(bins / global batch) optimizer steps (not rows),
    every step trains a padding-free micro-batch, and the run ends after exactly that many steps."""
    from scale.data.order import pack_bfd
    from scale.train import run
    from scale.training.metrics import read_jsonl
    from tests.conftest import tiny_cfg

    cfg = tiny_cfg(tmp_path, "data.packing=true", "data.max_length=96", "data.max_train_examples=48",
                   "train.max_steps=null", "train.num_epochs=1", "train.micro_batch_size=2", "train.gradient_accumulation_steps=1", "train.log_every=1",
                   "train.eval_every=0", "train.save_adapter=false", "data.cache=false")
    run(cfg)
    rows = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "train/loss" in r]
    from scale.data import build_splits
    from scale.modeling.build import load_tokenizer

    splits = build_splits(cfg.data, cfg.loss, load_tokenizer(cfg.model), cfg.data.path, cfg.train.seed)
    bins = pack_bfd([len(e.input_ids) for e in splits.train], 96)
    G = 2 * cfg.train.gradient_accumulation_steps
    assert len(bins) < 48 / 3 and [r["step"] for r in rows] == list(range(1, -(-len(bins) // G) + 1))
    assert all(r["train/pad_fraction"] == 0.0 for r in rows)
