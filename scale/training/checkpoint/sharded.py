"""The checkpoint of a full fine-tune: every rank writes the ranges of the fp32 weights and optimizer state it holds,
and any launch mode on any number of processes reads back the ranges its own layout needs.

    <checkpoint>/weights/shard-00000-of-00002.safetensors    rank 0's ranges
    <checkpoint>/weights/shard-00001-of-00002.safetensors    rank 1's ranges

An entry is ``"<name>::<what>::<start>"`` -> a 1-D float32 tensor: the values ``start .. start + numel`` of the
flattened parameter ``name`` (its name in the model, the same in every mode); ``what`` is ``weight`` (the fp32
master: the parameter itself under one device, DDP and FSDP2, DeepSpeed's fp32 partition under ZeRO) or an
optimizer-state key (AdamW: ``exp_avg``, ``exp_avg_sq``; SGD with momentum: ``momentum_buffer``). Each file's
metadata: ``shapes`` (``{name: shape}``), ``step`` (the optimizer's step count, one for every tensor, or null),
``param_groups`` (the hyper-parameters, ``lr`` as set for the next step), ``world_size`` and ``mode``.

Why ranges: in every launch mode a rank's piece of a parameter is ONE contiguous range of its flattened values
(:func:`layout_ranges` computes them from the shapes alone; :func:`local_pieces` reads them off the live objects):

- one device, DDP: the whole tensor on every rank (replicated): rank ``r`` writes the ``r``-th of ``world`` even
  shares (:func:`even_share`), so the ranks share the writing and no rank writes twice what another writes;
- ZeRO-1/2: a fragment of the flat fp32 partition (``param._hp_mapping.lp_fragment_address``, DeepSpeed's own
  accessor): the trainable tensors are concatenated, padded and cut into ``world`` equal partitions, so a fragment
  may hold part of a tensor, a partition boundary crossing it;
- ZeRO-3: the ``ds_tensor`` partition (``rank x ceil(numel / world)``, padded past the tensor's end);
- FSDP2: a ``Shard(0)`` of rows (``torch.chunk``'s cut: ``ceil(rows / world)`` rows each, the last ones short or
  empty), a range of the flattened tensor.

Writing is here; reading, and the load into a live layout, in :mod:`scale.training.checkpoint.sharded_read`.
A rank never holds a whole tensor it does not already hold, at save or at load, and no collective runs while
writing (a rank that fails says so afterwards, :func:`scale.training.checkpoint.saving.save_checkpoint`).
DeepSpeed's universal checkpoint (arXiv:2406.18820) describes the same ranges, but offline (``ds_to_universal`` over
saved ZeRO files, and it loads into DeepSpeed only); ``torch.distributed.checkpoint`` reshards DTensors but has no
description of ZeRO's flat partitions. These files are read by every mode here.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate.checkpointing import save_accelerator_state, save_custom_state
from safetensors.torch import save_file

from scale.training.checkpoint.portable import _hyper, _inner, _module
from scale.training.checkpoint.store import CheckpointError

SHARD_DIR = "weights"
WEIGHT = "weight"
_SEP = "::"
MODES = ("single", "ddp", "zero1", "zero2", "zero3", "fsdp")


class ShardedStateError(CheckpointError):
    """The shards do not describe this model (other names or shapes), or leave a range of a tensor uncovered."""


def shard_name(rank: int, world: int) -> str:
    """``shard-<rank>-of-<world>.safetensors`` (five digits each), the file rank ``rank`` of ``world`` writes."""
    return f"shard-{rank:05d}-of-{world:05d}.safetensors"


def shard_files(directory: Path, world: int) -> list[Path]:
    """The ``world`` shard files a checkpoint written by ``world`` ranks holds (what a resume needs)."""
    return [directory / SHARD_DIR / shard_name(r, world) for r in range(world)]


# ---- the ranges of each layout, from the shapes alone ----

def even_share(numel: int, rank: int, world: int) -> tuple[int, int]:
    """``(start, stop)`` of rank ``rank``'s share when ``world`` ranks split ``numel`` values evenly:
    ``ceil(numel / world)`` each, the last ones shorter or empty (``start == stop``).

    This is also ZeRO-3's partition of a tensor (``ds_tensor``: ``ceil(numel / world)`` values, zero-padded past
    the end; DeepSpeed ``partition_parameters.py`` ``_partition_param``) and, applied to the rows, FSDP2's
    ``Shard(0)`` (``torch.chunk`` over dim 0)."""
    per = -(-numel // world)
    start = min(numel, rank * per)
    return start, min(numel, start + per)


def layout_ranges(mode: str, shapes: dict[str, tuple[int, ...]], rank: int, world: int, align: int = 2
                  ) -> dict[str, tuple[int, int]]:
    """``{name: (start, stop)}``: the range of each flattened tensor rank ``rank`` of ``world`` holds in ``mode``
    (tensors it holds nothing of are left out). Pure: computed from the shapes, in the order given (the optimizer's
    parameter order).

    - ``single``/``ddp``: :func:`even_share` of each tensor (the share the rank writes of its whole copy);
    - ``zero3``: :func:`even_share` of each tensor (the ``ds_tensor`` partition);
    - ``fsdp``: :func:`even_share` of the rows, times the row's size;
    - ``zero1``/``zero2``: the tensors concatenated, padded to a multiple of ``align x world`` (DeepSpeed
      ``stage_1_and_2.py``: ``flatten_dense_tensors_aligned(..., nccl_start_alignment_factor x world)``,
      factor 2) and cut into ``world`` equal partitions: a tensor crossing a boundary has a fragment on each side.

    Raises:
        ValueError: an unknown ``mode``.
    """
    if mode not in MODES:
        raise ValueError(f"unknown launch mode {mode!r}: one of {MODES}")
    out: dict[str, tuple[int, int]] = {}
    if mode in ("zero1", "zero2"):
        total = sum(math.prod(s) for s in shapes.values())
        unit = align * world
        part = -(-total // unit) * unit // world
        lo, hi = rank * part, (rank + 1) * part
        offset = 0
        for name, shape in shapes.items():
            numel = math.prod(shape)
            a, b = max(lo, offset), min(hi, offset + numel)
            if a < b:
                out[name] = (a - offset, b - offset)
            offset += numel
        return out
    for name, shape in shapes.items():
        if mode == "fsdp" and len(shape) > 0:
            row = math.prod(shape[1:])
            a, b = even_share(shape[0], rank, world)
            a, b = a * row, b * row
        else:
            a, b = even_share(math.prod(shape), rank, world)
        if a < b:
            out[name] = (a, b)
    return out


@dataclass
class Piece:
    """One range of one tensor a rank writes.

    Attributes:
        name: the parameter's name in the model.
        what: ``weight`` (the fp32 master) or an optimizer-state key.
        start: offset of ``values`` in the flattened tensor (elements).
        values: ``[n]`` the values (a view into the rank's own storage; written as float32).
    """

    name: str
    what: str
    start: int
    values: torch.Tensor


# ---- the ranges of the live objects ----

def _dtensor_range(t: Any) -> tuple[int, torch.Tensor]:
    """``(start, local values flattened)`` of an FSDP2 ``DTensor`` sharded on dim 0 (its rows are a contiguous range
    of the flattened tensor). torch's ``compute_local_shape_and_global_offset`` gives the rows' offset."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    if any(o for o in offset[1:]):
        raise ShardedStateError(f"a DTensor sharded on a dimension other than 0 ({t.placements}) is not a range")
    row = math.prod(t.shape[1:])
    return (offset[0] * row if t.dim() else 0), t.to_local().reshape(-1)


def reshard_fsdp(module: torch.nn.Module) -> None:
    """Put every FSDP2 unit of ``module`` back in its sharded state (``FSDPModule.reshard``), so each parameter is its
    dim-0 ``DTensor`` again. A forward that no backward follows (an evaluation, the frozen reference) leaves the
    root unit's parameters unsharded (FSDP2 keeps them for the backward it expects, ``reshard_after_forward`` is not
    applied to the root): ``p.data`` is then the whole plain tensor. A no-op for modules FSDP2 did not wrap."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6: no FSDP2 to reshard
        return
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def _state_keys(inner: torch.optim.Optimizer) -> list[str]:
    """The per-element optimizer-state keys (AdamW: ``exp_avg``, ``exp_avg_sq``; the scalar ``step`` excluded)."""
    return sorted({k for st in inner.state.values() for k, v in st.items() if torch.is_tensor(v) and v.dim() > 0})


def _zero3_rank(p: Any, rank: int) -> int:
    """The index of this rank's ``ds_tensor`` partition: its rank in the parameter's ZeRO-3 process group."""
    group = getattr(p, "ds_process_group", None)
    if group is None:
        return rank
    import torch.distributed as dist

    return dist.get_rank(group=group)


def local_pieces(mode: str, module: torch.nn.Module, inner: torch.optim.Optimizer, rank: int, world: int
                 ) -> list[Piece]:
    """The ranges this rank holds of every trainable parameter's fp32 master and optimizer state.

    Args:
        mode: the launch mode (:attr:`scale.distributed.launch.ModePlan.mode`): ``single``, ``ddp``, ``zero1``,
            ``zero2``, ``zero3`` or ``fsdp``.
        module: the model inside the mode's wrapper (the DeepSpeed engine's ``module``; FSDP2 shards in place).
        inner: the torch optimizer (under DeepSpeed the one ZeRO steps over its fp32 partitions).
        rank, world: this process and the number of processes.

    Returns:
        ``Piece`` s whose ``values`` are views of the rank's own storage (float32 masters, on its device).
    """
    out: list[Piece] = []
    keys = _state_keys(inner)
    if mode == "fsdp":
        reshard_fsdp(module)
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        if mode == "zero3":  # the partition: rank x partition size, padded past the tensor's end
            from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_optimizer_state

            part, numel = p.ds_tensor.numel(), p.ds_numel
            start = _zero3_rank(p, rank) * part
            valid = max(0, min(part, numel - start))
            if valid:
                out.append(Piece(name, WEIGHT, start, safe_get_local_fp32_param(p).reshape(-1)[:valid]))
                out += [Piece(name, key, start, safe_get_local_optimizer_state(p, key).reshape(-1)[:valid])
                        for key in keys]
        elif mode in ("zero1", "zero2"):  # a fragment of the flat fp32 partition, or nothing on this rank
            mapping = getattr(p, "_hp_mapping", None)
            if mapping is None:
                continue
            start = mapping.lp_fragment_address.start
            out.append(Piece(name, WEIGHT, start, mapping.get_hp_fragment().reshape(-1)))
            out += [Piece(name, key, start, mapping.get_hp_fragment(key).reshape(-1))
                    for key in sorted(mapping.get_optim_state_keys())]
        elif mode == "fsdp":  # DTensor rows
            start, values = _dtensor_range(p.data)
            out.append(Piece(name, WEIGHT, start, values))
            for key, state in sorted(inner.state.get(p, {}).items()):
                if torch.is_tensor(state) and state.dim():
                    out.append(Piece(name, key, *_dtensor_range(state)))
        else:  # one device, DDP: replicated; rank r writes the r-th even share
            a, b = even_share(p.numel(), rank, world)
            if a < b:
                out.append(Piece(name, WEIGHT, a, p.detach().reshape(-1)[a:b]))
                for key, state in sorted(inner.state.get(p, {}).items()):
                    if torch.is_tensor(state) and state.dim():
                        out.append(Piece(name, key, a, state.reshape(-1)[a:b]))
    return out


def step_count(inner: torch.optim.Optimizer) -> float | None:
    """The optimizer's step count (AdamW's ``step``: one for every tensor in every mode here), or None (SGD keeps
    none)."""
    for state in inner.state.values():
        if "step" in state:
            step = state["step"]
            return float(step.full_tensor() if hasattr(step, "full_tensor") else step)
    return None


def shapes_of(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of the trainable parameters, whole (ZeRO-3's ``ds_shape``, a DTensor's global shape)."""
    return {n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in module.named_parameters() if p.requires_grad}


def write_shard(directory: Path, pieces: list[Piece], metadata: dict[str, str], rank: int, world: int) -> Path:
    """Write ``pieces`` to ``<directory>/weights/shard-<rank>-of-<world>.safetensors`` with ``metadata`` (strings,
    safetensors' header); returns the file. Not collective.

    Raises:
        OSError: the write failed (a full disk: ``ENOSPC``); the caller agrees on it with the other ranks.
    """
    target = directory / SHARD_DIR
    target.mkdir(parents=True, exist_ok=True)
    tensors = {f"{p.name}{_SEP}{p.what}{_SEP}{p.start}": p.values.detach().to("cpu", torch.float32).contiguous()
               for p in pieces}
    path = target / shard_name(rank, world)
    save_file(tensors, str(path), metadata=metadata)
    return path


def shard_metadata(mode: str, module: torch.nn.Module, inner: torch.optim.Optimizer, world: int,
                   param_groups: str) -> dict[str, str]:
    """The header every shard carries: shapes, step count, hyper-parameters (``param_groups``, JSON), world size,
    mode."""
    return {"shapes": json.dumps({n: list(s) for n, s in shapes_of(module).items()}),
            "step": json.dumps(step_count(inner)), "param_groups": param_groups, "world_size": str(world),
            "mode": mode}


def write_sharded(acc: Any, plan: Any, model: torch.nn.Module, optimizer: Any, directory: Path) -> None:
    """This rank's part of a full fine-tune's checkpoint into ``directory`` (the checkpoint's ``.tmp``): its shard
    (:func:`local_pieces`, :func:`write_shard`), its RNG states (``random_states_<rank>.pkl``, accelerate's writer and
    keys) and, on the writer, the registered objects (``custom_checkpoint_<i>.pkl``: the LR scheduler). The mode's
    own files (DeepSpeed's ``pytorch_model/``, ``optimizer.bin``, FSDP's DCP directories) are not written: the
    shards are the whole state, exact in every mode. Not collective.

    Args:
        acc: the ``Accelerator``; plan: the :class:`scale.distributed.launch.ModePlan`; model, optimizer: as
            ``prepare`` returned them.

    Raises:
        OSError: a write failed (``ENOSPC``): :func:`scale.training.checkpoint.saving.save_checkpoint` agrees on it
            with the other ranks before anyone waits on a barrier.
    """
    module, inner = _module(acc, plan, model), _inner(optimizer)
    rank, world = acc.process_index, acc.num_processes
    pieces = local_pieces(plan.mode, module, inner, rank, world)
    write_shard(directory, pieces, shard_metadata(plan.mode, module, inner, world, _hyper(inner.param_groups)), rank,
                world)
    each_node = acc.project_configuration.save_on_each_node
    save_accelerator_state(str(directory), [], [], [], [], rank, acc.step, acc.scaler, save_on_each_node=each_node)
    for i, obj in enumerate(acc._custom_objects):
        save_custom_state(obj, str(directory), i, save_on_each_node=each_node)
