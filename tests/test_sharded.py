"""The sharded checkpoint of full weights (scale/training/checkpoint/sharded.py): the ranges of each launch mode's
layout, the shard files, the reader that serves any range whatever cut wrote it, and the load into a live
optimizer. Pure parts here, in this process; whole runs further down."""

from __future__ import annotations

import errno
import itertools
import json
import math

import pytest
import torch

from scale.training.checkpoint import sharded
from scale.training.checkpoint.sharded import (MODES, WEIGHT, Piece, ShardedStateError, even_share, layout_ranges,
                                               local_pieces, shard_files, shard_name, write_shard)
from scale.training.checkpoint.sharded_read import ShardReader, load_pieces
from tests.conftest import TINY_DATA, tiny_cfg
from tests.test_resume_across import _edit_state

# Shapes that make every layout cut inside and across tensors: rows that do not divide by 2 or 3, a tensor smaller
# than the world, a 1-D tensor, a tensor of one row.
SHAPES = {"embed.weight": (7, 3), "layer.q.weight": (5, 4), "layer.norm.weight": (3,), "head.bias": (1,),
          "layer.up.weight": (1, 5)}


def _flat_tensors(seed: int = 0) -> dict[tuple[str, str], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {(n, what): torch.randn(math.prod(s), generator=g) for n, s in SHAPES.items()
            for what in (WEIGHT, "exp_avg", "exp_avg_sq")}


def _meta(world: int, mode: str, step: float | None = 3.0) -> dict[str, str]:
    return {"shapes": json.dumps({n: list(s) for n, s in SHAPES.items()}), "step": json.dumps(step),
            "param_groups": json.dumps([{"lr": 0.25, "betas": [0.9, 0.999]}]), "world_size": str(world), "mode": mode}


def _write_cut(directory, mode: str, world: int, drop=None):
    """Write the tensors as ``world`` ranks of ``mode`` would: each rank its ranges (``drop``: a (rank, name) whose
    piece is left out)."""
    values = _flat_tensors()
    for rank in range(world):
        pieces = [Piece(n, what, a, values[(n, what)][a:b])
                  for n, (a, b) in layout_ranges(mode, SHAPES, rank, world).items() if (rank, n) != drop
                  for what in (WEIGHT, "exp_avg", "exp_avg_sq")]
        write_shard(directory, pieces, _meta(world, mode), rank, world)
    return values


# ---- the ranges of each layout ----

def test_even_share_splits_like_zero3_and_torch_chunk():
    assert [even_share(10, r, 4) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert [even_share(2, r, 4) for r in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]  # the last ranks hold nothing
    # FSDP2's Shard(0) is torch.chunk over the rows: the same cut
    for rows, world in itertools.product(range(1, 9), range(1, 5)):
        chunks = torch.arange(rows).chunk(world)
        got = [even_share(rows, r, world) for r in range(world)]
        assert [(int(c[0]), int(c[-1]) + 1) for c in chunks] == [g for g in got if g[0] < g[1]]


def test_layout_ranges_of_each_mode():
    assert layout_ranges("zero3", {"a": (10,)}, 3, 4) == {"a": (9, 10)}  # padded to 4 x 3 values, 1 valid here
    assert layout_ranges("fsdp", {"a": (5, 3)}, 1, 2) == {"a": (9, 15)}  # rows 3..5 of 3 values each
    assert layout_ranges("fsdp", {"a": (1, 4)}, 1, 2) == {}  # one row: rank 1 holds none
    # ZeRO-1/2: a (3) and b (5) flattened into 8 values, padded to a multiple of 2 x 2, cut in two partitions of 4:
    # b crosses the boundary and has a fragment on each rank
    shapes = {"a": (3,), "b": (5,)}
    assert layout_ranges("zero2", shapes, 0, 2) == {"a": (0, 3), "b": (0, 1)}
    assert layout_ranges("zero2", shapes, 1, 2) == {"b": (1, 5)}
    # 9 values padded to 12 (align 2 x world 3): partitions of 4
    assert [layout_ranges("zero1", {"a": (9,)}, r, 3) for r in range(3)] == [{"a": (0, 4)}, {"a": (4, 8)},
                                                                                {"a": (8, 9)}]
    assert layout_ranges("single", shapes, 0, 1) == {"a": (0, 3), "b": (0, 5)}
    with pytest.raises(ValueError, match="unknown launch mode 'tp'"):
        layout_ranges("tp", shapes, 0, 1)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_the_ranks_of_a_layout_cover_every_value_once(mode, world):
    if mode == "single" and world > 1:
        return
    for name, shape in SHAPES.items():
        seen = torch.zeros(math.prod(shape), dtype=torch.int64)
        for rank in range(world):
            a, b = layout_ranges(mode, SHAPES, rank, world).get(name, (0, 0))
            seen[a:b] += 1
        assert seen.eq(1).all(), (mode, world, name, seen.tolist())


# ---- the files and the reader ----

CUTS = [("single", 1), ("ddp", 2), ("zero2", 2), ("zero1", 3), ("zero3", 2), ("zero3", 3), ("fsdp", 2), ("fsdp", 8)]


@pytest.mark.parametrize("written", CUTS, ids=[f"{m}x{w}" for m, w in CUTS])
def test_pieces_of_any_cut_reassemble_bit_exactly_in_any_other(tmp_path, written):
    mode, world = written
    values = _write_cut(tmp_path, mode, world)
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == [shard_name(r, world) for r in range(world)]
    reader = ShardReader(tmp_path)
    assert (reader.world_size, reader.mode, reader.step) == (world, mode, 3.0)
    assert reader.shapes == SHAPES and reader.whats == ["exp_avg", "exp_avg_sq"]
    assert reader.param_groups == [{"lr": 0.25, "betas": [0.9, 0.999]}]
    for (name, what), flat in values.items():  # whole
        assert torch.equal(reader.tensor(name, what), flat.view(SHAPES[name]))
    for mode2, world2 in CUTS:  # as every other layout reads its own ranges
        for rank in range(world2):
            for name, (a, b) in layout_ranges(mode2, SHAPES, rank, world2).items():
                for what in (WEIGHT, "exp_avg"):
                    assert torch.equal(reader.read(name, what, a, b), values[(name, what)][a:b])
    g = torch.Generator().manual_seed(1)  # and any range at all
    for name in SHAPES:
        n = reader.numel(name)
        for _ in range(10):
            a, b = sorted(torch.randint(0, n + 1, (2,), generator=g).tolist())
            assert torch.equal(reader.read(name, "exp_avg_sq", a, b), values[(name, "exp_avg_sq")][a:b])
    reader.close()


def test_a_range_no_shard_covers_names_the_tensor(tmp_path):
    _write_cut(tmp_path, "zero2", 2, drop=(1, "layer.q.weight"))  # rank 1's fragment of q left out
    reader = ShardReader(tmp_path)
    a, b = layout_ranges("zero2", SHAPES, 0, 2)["layer.q.weight"]
    assert (a, b) == (0, 5)  # 50 values padded to 52, partitions of 26: embed (21 values) then 5 of q on rank 0
    reader.read("layer.q.weight", WEIGHT, 0, 5)  # what rank 0 wrote is there
    with pytest.raises(ShardedStateError) as e:
        reader.read("layer.q.weight", WEIGHT, 0, 20)
    assert str(e.value) == ("the shards cover 5 of the 20 values 0..20 of layer.q.weight (weight); value 5 is in "
                            "none: a shard is missing or belongs to another run")


def test_a_missing_or_foreign_shard_file_is_named(tmp_path):
    _write_cut(tmp_path / "a", "fsdp", 3)
    (tmp_path / "a" / "weights" / shard_name(1, 3)).unlink()
    with pytest.raises(ShardedStateError) as e:
        ShardReader(tmp_path / "a")
    assert str(e.value) == (f"{tmp_path / 'a' / 'weights'}: 2 shard file(s) (shard-00000-of-00003.safetensors, "
                            f"shard-00002-of-00003.safetensors) written by world size(s) 3: a shard is missing or "
                            f"another run's is mixed in")
    _write_cut(tmp_path / "b", "ddp", 2)
    (tmp_path / "b" / "weights" / shard_name(1, 2)).rename(tmp_path / "a" / "weights" / shard_name(1, 2))
    with pytest.raises(ShardedStateError, match=r"written by world size\(s\) 2, 3: a shard is missing"):
        ShardReader(tmp_path / "a")
    with pytest.raises(ShardedStateError, match="holds no shard-"):
        ShardReader(tmp_path / "c")
    assert shard_files(tmp_path, 2) == [tmp_path / "weights" / "shard-00000-of-00002.safetensors",
                                        tmp_path / "weights" / "shard-00001-of-00002.safetensors"]


def test_a_full_disk_surfaces_as_the_os_error(tmp_path, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sharded, "save_file", full)
    with pytest.raises(OSError) as e:
        write_shard(tmp_path, [Piece("a", WEIGHT, 0, torch.zeros(2))], _meta(1, "single"), 0, 1)
    assert e.value.errno == errno.ENOSPC


# ---- into a live optimizer (one device, DDP layouts) ----

def _model_and_adamw(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    return model, torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)


def _step(model, opt, seed: int):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


@pytest.mark.parametrize("world", [1, 2, 3])
def test_adamw_state_cut_by_ranks_resumes_bit_exact_in_one_process(tmp_path, world):
    """Three AdamW steps, the state written as ``world`` DDP ranks would (each its even share of the same replica),
    loaded into a fresh model and optimizer: weights, moments and step count equal, and the next two steps give
    the uninterrupted run's weights bit for bit."""
    model, opt = _model_and_adamw(0)
    for s in range(3):
        _step(model, opt, s)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    for rank in range(world):
        pieces = local_pieces("ddp" if world > 1 else "single", model, opt, rank, world)
        assert {p.name: (p.start, p.start + p.values.numel()) for p in pieces if p.what == WEIGHT} == layout_ranges(
            "ddp", shapes, rank, world)
        meta = sharded.shard_metadata("ddp", model, opt, world, json.dumps([{"lr": 0.05}]))
        write_shard(tmp_path, pieces, meta, rank, world)
    fresh, fresh_opt = _model_and_adamw(1)  # other initial weights: everything must come from the files
    reader = ShardReader(tmp_path)
    assert reader.step == 3.0
    load_pieces("single", None, fresh, fresh_opt, reader, 0)
    for (n, p), q in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(p, q), n
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][key], fresh_opt.state[q][key])
        assert float(fresh_opt.state[q]["step"]) == 3.0
    for s in (3, 4):
        _step(model, opt, s)
        _step(fresh, fresh_opt, s)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), fresh.parameters()))


def test_a_checkpoint_of_another_model_is_refused_by_name(tmp_path):
    model, opt = _model_and_adamw(0)
    _step(model, opt, 0)
    write_shard(tmp_path, local_pieces("single", model, opt, 0, 1),
                sharded.shard_metadata("single", model, opt, 1, "[]"), 0, 1)
    other = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 4))
    with pytest.raises(ShardedStateError) as e:
        load_pieces("single", None, other, torch.optim.AdamW(other.parameters()), ShardReader(tmp_path), 0)
    assert str(e.value) == ("the checkpoint holds other tensors than this model trains: ['2.bias', '2.weight'] "
                            "differ (missing, unexpected or of another shape)")


# ---- whole runs of full weights, in this process ----

# 20 rows, micro-batch 2 x GA 2 (G = 4): 5 optimizer steps per epoch, the step-4 checkpoint 4 windows into the
# first. AdamW: the moments and step count must come back too.
FULL = ["model.finetune=full", "data.max_train_examples=20", "train.micro_batch_size=2",
        "train.gradient_accumulation_steps=2", "train.max_steps=8", "train.save_every=4", "train.log_every=1",
        "train.eval_every=0", "eval.generate_samples=0", "optim.name=adamw", "optim.lr=1e-3",
        "model.gradient_checkpointing=false", "log.peak_flops=false", "train.save_adapter=false"]


def _reset():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _run(out, *overrides):
    from scale.train import run

    try:
        run(tiny_cfg(out, *FULL, *overrides))
    finally:
        _reset()


def _losses(out):
    from scale.training.metrics import read_jsonl

    return {r["step"]: r["train/loss"] for r in read_jsonl(out / "metrics.jsonl") if "train/loss" in r}


def _shard_state(ckpt):
    """Every tensor's weight and optimizer state of a checkpoint, whole (whatever cut wrote it)."""
    reader = ShardReader(ckpt)
    try:
        return {(n, w): reader.tensor(n, w) for n in reader.shapes for w in (WEIGHT, *reader.whats)}, reader.step
    finally:
        reader.close()


@pytest.fixture(scope="module")
def full_reference(tmp_path_factory):
    """8 steps of full weights on one process, checkpoints at 4 and 8."""
    out = tmp_path_factory.mktemp("full")
    _run(out)
    return out


def test_a_full_checkpoint_holds_the_shards_and_no_adapter(full_reference):
    from scale.training.checkpoint import list_checkpoints, verify
    from scale.training.state import STATE_FILE

    ckpt = list_checkpoints(full_reference)[0]
    files = sorted(p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file())
    assert files == ["custom_checkpoint_0.pkl", "random_states_0.pkl", STATE_FILE,
                     "weights/shard-00000-of-00001.safetensors"]
    state = json.loads((ckpt / STATE_FILE).read_text())
    assert sorted(state["files"]) == [f for f in files if f != STATE_FILE] and verify(ckpt) is None
    tensors, step = _shard_state(ckpt)
    assert step == 4.0
    reader = ShardReader(ckpt)
    # every weight of the model, whole, fp32, with AdamW's two moments
    assert reader.mode == "single" and reader.world_size == 1 and reader.whats == ["exp_avg", "exp_avg_sq"]
    assert sum(math.prod(s) for s in reader.shapes.values()) == sum(t.numel() for (n, w), t in tensors.items()
                                                                    if w == WEIGHT)
    assert all(t.dtype == torch.float32 for t in tensors.values())
    reader.close()


def test_a_full_checkpoint_of_two_processes_resumes_on_one(full_reference, tmp_path, caplog):
    """The step-4 checkpoint rewritten as 2 DDP processes write it (micro-batch 2 x GA 1 x 2 ranks; each rank's
    even share of every tensor in its own shard), resumed by one process: accumulation 2, the shards read across
    the cut, RNG re-derived, and steps 5-8 and the step-8 weights, moments and step count bit for bit the
    uninterrupted run's. (The same resume unrewritten: tests/test_full_model.py.)"""
    import logging
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(full_reference / "checkpoints" / "step_000004", ckpt)
    whole, step = _shard_state(ckpt)
    reader = ShardReader(ckpt)
    shapes, groups = reader.shapes, reader.param_groups
    reader.close()
    (ckpt / "weights" / shard_name(0, 1)).unlink()
    meta = {"shapes": json.dumps({n: list(s) for n, s in shapes.items()}), "step": json.dumps(step),
            "param_groups": json.dumps(groups), "world_size": "2", "mode": "ddp"}
    for rank in range(2):
        pieces = [Piece(n, w, a, whole[(n, w)].reshape(-1)[a:b]) for n, (a, b) in
                  layout_ranges("ddp", shapes, rank, 2).items() for w in (WEIGHT, "exp_avg", "exp_avg_sq")]
        write_shard(ckpt, pieces, meta, rank, 2)
    shutil.copy(ckpt / "random_states_0.pkl", ckpt / "random_states_1.pkl")
    _edit_state(ckpt, mode="ddp", world_size=2, data_parallel_size=2, ga=1)
    with caplog.at_level(logging.INFO):
        _run(tmp_path / "out", "train.gradient_accumulation_steps=1", f"train.resume_from={ckpt}")
    assert "train.gradient_accumulation_steps 1 -> 2 keeps global_batch_size=4" in caplog.text
    assert any(m.endswith("full weights' shards: written by ddp on 2 process(es), resumed as single on 1")
               for m in caplog.messages), caplog.messages
    assert _losses(tmp_path / "out") == {s: v for s, v in _losses(full_reference).items() if s > 4}
    ref, got = (_shard_state(out / "checkpoints" / "step_000008") for out in (full_reference, tmp_path / "out"))
    assert ref[1] == got[1] == 8.0 and ref[0].keys() == got[0].keys()
    assert all(torch.equal(ref[0][k], got[0][k]) for k in ref[0])


def _cli(out, capsys, *overrides):
    from scale.cli import main
    from tests.conftest import TINY_YAML

    code = main(["--config", str(TINY_YAML), f"output_dir={out}", f"data.path={TINY_DATA}", *overrides])
    _reset()
    return code, capsys.readouterr().err


def test_lora_and_full_checkpoints_do_not_cross(full_reference, tmp_path, capsys):
    """A full checkpoint into a LoRA run, and a LoRA checkpoint into a full run: one line, exit 2, nothing
    written."""
    ckpt = full_reference / "checkpoints" / "step_000004"
    lora = [o for o in FULL if o != "model.finetune=full"]
    code, err = _cli(tmp_path / "a", capsys, *lora, f"train.resume_from={ckpt}")
    assert code == 2 and err == (f"scale-train: error: CheckpointError: checkpoint {ckpt} trained every weight "
                                 f"(model.finetune=full); this run has model.finetune=lora: resume with "
                                 f"model.finetune=full, or start a new run in another output_dir "
                                 f"(train.resume_from=null)\n")
    assert not (tmp_path / "a" / "config.yaml").exists()
    _run(tmp_path / "lora", "model.finetune=lora", "train.max_steps=1", "train.save_every=1")
    ckpt = tmp_path / "lora" / "checkpoints" / "step_000001"
    code, err = _cli(tmp_path / "b", capsys, *FULL, f"train.resume_from={ckpt}")
    assert code == 2 and err == (f"scale-train: error: CheckpointError: checkpoint {ckpt} trained a LoRA adapter "
                                 f"(model.finetune=lora); this run has model.finetune=full: resume with "
                                 f"model.finetune=lora, or start a new run in another output_dir "
                                 f"(train.resume_from=null)\n")


def test_a_disk_that_fills_during_a_save_keeps_the_previous_checkpoint(full_reference, tmp_path, capsys,
                                                                         monkeypatch):
    """Resumed from step 4, the shard write of the step-8 checkpoint fails with ENOSPC after writing part of the
    file: one line naming the rank, the error and the checkpoint a resume takes, exit 2; step 4 stays complete and
    intact, no .tmp is left, and ``latest`` takes step 4 (whose resume is bit-exact: the test above)."""
    import shutil

    from scale.training.checkpoint import list_checkpoints, resolve_resume, verify

    out = tmp_path / "run"
    root = out / "checkpoints"
    shutil.copytree(full_reference / "checkpoints" / "step_000004", root / "step_000004")
    def fills(tensors, path, metadata=None):
        with open(path, "wb") as fh:  # part of the file, then the disk is full
            fh.write(b"\0" * 100)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sharded, "save_file", fills)
    code, err = _cli(out, capsys, *FULL, "train.resume_from=latest")
    assert code == 2 and err == ("scale-train: error: CheckpointError: checkpoint step_000008 not written: rank 0: "
                                 "[Errno 28] No space left on device; the newest complete checkpoint is still "
                                 "step_000004 (nothing was replaced): free space and resume with "
                                 "train.resume_from=latest\n")
    assert sorted(p.name for p in root.iterdir()) == ["step_000004"]
    assert list_checkpoints(out) == [root / "step_000004"] and verify(root / "step_000004") is None
    assert resolve_resume("latest", out) == root / "step_000004"
    # the first checkpoint of a run: nothing to fall back on, said so
    code, err = _cli(tmp_path / "fresh", capsys, *FULL)
    assert code == 2 and err == ("scale-train: error: CheckpointError: checkpoint step_000004 not written: rank 0: "
                                 "[Errno 28] No space left on device; no complete checkpoint exists yet: free space "
                                 "and start again\n")
    assert list((tmp_path / "fresh" / "checkpoints").iterdir()) == []
