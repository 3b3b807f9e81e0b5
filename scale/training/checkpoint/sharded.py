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
from safetensors import safe_open
from safetensors.torch import save_file

from scale.training.checkpoint.portable import SCHEDULER_FILE, _hyper, _inner, _module, _set_hyper
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


# ---- reading ----

class ShardReader:
    """Every rank's shards of a checkpoint, memory-mapped (``safetensors.safe_open``): any range of any tensor,
    whatever layout wrote it. Only the slices asked for are read from disk; :meth:`close` drops the files.

    Attributes:
        shapes: ``{name: shape}`` of the trainable tensors.
        step: the optimizer's step count, or None.
        param_groups: the hyper-parameters (``lr`` as set for the next step), a list of dicts.
        world_size, mode: what wrote the checkpoint.
        whats: the optimizer-state keys present (``weight`` excluded).

    Raises:
        ShardedStateError: no shard; fewer or more shard files than the world size that wrote them (a shard
            missing, or another run's mixed in); shards that disagree on the shapes.
    """

    def __init__(self, directory: Path) -> None:
        where = directory / SHARD_DIR
        files = sorted(where.glob("shard-*-of-*.safetensors"))
        if not files:
            raise ShardedStateError(f"{where} holds no shard-*-of-*.safetensors: not a checkpoint of full weights, "
                                    f"or its shards were deleted")
        self._handles = {f: safe_open(str(f), framework="pt") for f in files}
        self._index: dict[tuple[str, str], list[tuple[int, int, Path, str]]] = {}
        metas = []
        for f, fh in self._handles.items():
            metas.append(fh.metadata() or {})
            for key in fh.keys():  # noqa: SIM118 - a safetensors file handle, not a dict
                name, what, start = key.rsplit(_SEP, 2)
                numel = fh.get_slice(key).get_shape()[0]
                self._index.setdefault((name, what), []).append((int(start), numel, f, key))
        worlds = sorted({m.get("world_size", "?") for m in metas})
        expected = {f.name for f in shard_files(directory, int(worlds[0]))} if worlds[0].isdigit() else set()
        if len(worlds) != 1 or {f.name for f in files} != expected:
            self.close()
            raise ShardedStateError(f"{where}: {len(files)} shard file(s) ({', '.join(f.name for f in files)}) "
                                    f"written by world size(s) {', '.join(worlds)}: a shard is missing or another "
                                    f"run's is mixed in")
        if len({m.get("shapes") for m in metas}) != 1:
            self.close()
            raise ShardedStateError(f"{where}: the shards describe different tensors (their 'shapes' differ): "
                                    f"another run's shard is mixed in")
        meta = metas[0]
        self.shapes = {n: tuple(s) for n, s in json.loads(meta["shapes"]).items()}
        self.step = json.loads(meta.get("step", "null"))
        self.param_groups = json.loads(meta.get("param_groups", "[]"))
        self.world_size, self.mode = int(meta["world_size"]), meta.get("mode", "")
        self.whats = sorted({w for _, w in self._index if w != WEIGHT})

    def close(self) -> None:
        self._handles.clear()

    def numel(self, name: str) -> int:
        """The number of values of tensor ``name`` (the product of its shape)."""
        return math.prod(self.shapes[name])

    def read(self, name: str, what: str, start: int, stop: int) -> torch.Tensor:
        """``[stop - start]`` float32 on CPU: values ``start .. stop`` of the flattened ``name``'s ``what``, copied
        from the pieces that overlap the range (each overlap read once, by a slice of the memory map).

        Raises:
            ShardedStateError: the shards do not cover the range (names the tensor, what, and the first value
                missing).
        """
        out = torch.empty(max(0, stop - start), dtype=torch.float32)
        covered = torch.zeros(out.numel(), dtype=torch.bool)
        for s, n, f, key in self._index.get((name, what), []):
            lo, hi = max(start, s), min(stop, s + n)
            if lo < hi:
                out[lo - start:hi - start] = self._handles[f].get_slice(key)[lo - s:hi - s]
                covered[lo - start:hi - start] = True
        if not bool(covered.all()):
            first = start + int((~covered).nonzero()[0])
            raise ShardedStateError(f"the shards cover {int(covered.sum())} of the {out.numel()} values "
                                    f"{start}..{stop} of {name} ({what}); value {first} is in none: a shard is "
                                    f"missing or belongs to another run")
        return out

    def tensor(self, name: str, what: str = WEIGHT) -> torch.Tensor:
        """The whole tensor ``name``'s ``what``, float32 on CPU, in its shape."""
        return self.read(name, what, 0, self.numel(name)).view(self.shapes[name])


# ---- loading into a live layout ----

def _prime(inner: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    """Create the optimizer's per-tensor state with one step at learning rate 0 over zero gradients (as torch's
    ``set_optimizer_state_dict`` does, ``_init_optim_state``): AdamW and SGD then leave every parameter
    bit-identical (the update is multiplied by 0). Gradients in place before are put back."""
    grads = [p.grad for p in params]
    lrs = [g["lr"] for g in inner.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in inner.param_groups:
        g["lr"] = 0.0
    inner.step()
    for g, lr in zip(inner.param_groups, lrs):
        g["lr"] = lr
    for p, grad in zip(params, grads):
        p.grad = grad


def _set_step(inner: torch.optim.Optimizer, step: float | None) -> None:
    """Every tensor's ``step`` to the checkpoint's count (the prime step above set it to 1)."""
    if step is None:
        return
    for state in inner.state.values():
        if "step" in state:
            s = state["step"]
            if torch.is_tensor(s):
                (s.to_local() if hasattr(s, "to_local") else s).fill_(step)
            else:
                state["step"] = type(s)(step)


def _padded(reader: ShardReader, name: str, what: str, start: int, stop: int, size: int) -> torch.Tensor:
    """``[size]`` float32: values ``start .. stop`` of ``name``'s ``what``, zero-padded (ZeRO-3's partition past a
    tensor's end)."""
    out = torch.zeros(size, dtype=torch.float32)
    out[:stop - start] = reader.read(name, what, start, stop)
    return out


def load_pieces(mode: str, engine: Any, module: torch.nn.Module, inner: torch.optim.Optimizer, reader: ShardReader,
                rank: int) -> None:
    """Put the checkpoint's ranges into this rank's weights, fp32 masters and optimizer state for ``mode``'s layout:
    each rank reads only what it holds (one device and DDP every value; ZeRO-1/2 the module's weights whole, as
    ZeRO-1/2 keep them, and its fp32 fragments; ZeRO-3 and FSDP2 their partition). No collective. The optimizer's
    state is created first by :func:`_prime`, then overwritten range by range; hyper-parameters and the scheduler
    are the caller's.

    Args:
        engine: the DeepSpeed engine under ZeRO (its ``optimizer`` holds the fp32 partitions); unused otherwise.

    Raises:
        ShardedStateError: the checkpoint's tensors are not this model's (names or shapes), or a range is uncovered.
    """
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    shapes = shapes_of(module)
    if shapes != reader.shapes:
        other = sorted(n for n in set(shapes) | set(reader.shapes) if shapes.get(n) != reader.shapes.get(n))
        raise ShardedStateError(f"the checkpoint holds other tensors than this model trains: {other[:3]} differ "
                                f"(missing, unexpected or of another shape)")
    keys = reader.whats
    if mode.startswith("zero"):  # ZeRO: the state lives on the fp32 partitions, created by a step of lr 0
        zero = engine.optimizer
        partitions = (getattr(zero, "fp32_partitioned_groups_flat", None)
                      or getattr(zero, "single_partition_of_fp32_groups", None) or zero.fp32_groups_flat_partition)
        if keys:
            own = inner.param_groups
            inner.param_groups = [{**own[0], "params": list(partitions)}]
            try:
                _prime(inner, list(partitions))
            finally:
                inner.param_groups = own
            if hasattr(zero, "_lazy_init_hp_params_optimizer_state"):  # link each fragment to its state
                zero._lazy_init_hp_params_optimizer_state()
    elif keys:
        _prime(inner, [p for _, p in named])
    _set_step(inner, reader.step)
    with torch.no_grad():
        for name, p in named:
            numel = reader.numel(name)
            if mode == "zero3":
                from deepspeed.utils import safe_set_local_fp32_param, safe_set_local_optimizer_state

                part = p.ds_tensor.numel()
                a = min(numel, _zero3_rank(p, rank) * part)
                b = min(numel, a + part)

                weight = _padded(reader, name, WEIGHT, a, b, part).to(p.ds_tensor.device)
                safe_set_local_fp32_param(p, weight)
                p.ds_tensor.data.copy_(weight.to(p.ds_tensor.dtype))  # the module's partition: the master, cast
                for key in keys:
                    safe_set_local_optimizer_state(p, _padded(reader, name, key, a, b, part).to(weight.device), key)
            elif mode in ("zero1", "zero2"):
                full = reader.read(name, WEIGHT, 0, numel)
                p.data.copy_(full.view(p.shape).to(p.device, p.dtype))  # ZeRO-1/2 keep the module whole
                mapping = getattr(p, "_hp_mapping", None)
                if mapping is not None:
                    a = mapping.lp_fragment_address.start
                    b = a + mapping.lp_fragment_address.numel
                    master = mapping.get_hp_fragment()
                    master.data.copy_(full[a:b].view(master.shape).to(master.device))
                    for key in keys:
                        frag = mapping.get_hp_fragment(key)
                        frag.data.copy_(reader.read(name, key, a, b).view(frag.shape).to(frag.device))
            elif mode == "fsdp":
                start, local = _dtensor_range(p.data)
                local.copy_(reader.read(name, WEIGHT, start, start + local.numel()))
                for key in keys:
                    s, values = _dtensor_range(inner.state[p][key])
                    values.copy_(reader.read(name, key, s, s + values.numel()))
            else:
                p.copy_(reader.read(name, WEIGHT, 0, numel).view(p.shape).to(p.device, p.dtype))
                for key in keys:
                    state = inner.state[p][key]
                    state.copy_(reader.read(name, key, 0, numel).view(state.shape).to(state.device))


# ---- a run's checkpoint: what the saver and the loader call ----

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


def load_sharded(acc: Any, plan: Any, model: torch.nn.Module, optimizer: Any, scheduler: Any, directory: Path) -> None:
    """Put a full fine-tune's checkpoint into this run's weights, fp32 masters, optimizer state, hyper-parameters and
    LR scheduler, in any launch mode on any number of processes (:func:`load_pieces`). Not collective; the RNG
    states are :func:`scale.training.checkpoint.portable.restore_rng`'s.

    Raises:
        ShardedStateError: the shards do not describe this model, or leave a range uncovered (names the tensor).
    """
    module, inner = _module(acc, plan, model), _inner(optimizer)
    reader = ShardReader(directory)
    try:
        load_pieces(plan.mode, model, module, inner, reader, acc.process_index)
        _set_hyper(inner, reader.param_groups)
    finally:
        reader.close()
    scheduler.load_state_dict(torch.load(directory / SCHEDULER_FILE, weights_only=True))
