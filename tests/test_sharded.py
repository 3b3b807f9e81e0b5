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
from scale.training.checkpoint.sharded import (MODES, WEIGHT, Piece, ShardedStateError, ShardReader, even_share,
                                               layout_ranges, load_pieces, local_pieces, shard_files, shard_name,
                                               write_shard)

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
