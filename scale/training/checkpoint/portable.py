"""The part of a checkpoint any launch mode loads: every trainable tensor and its optimizer state, whole, by name.

    adapter_model.safetensors     the trainable (LoRA) tensors, whole, as peft saves an adapter (next to its
                                  ``adapter_config.json``); under DeepSpeed the fp32 master copy
                                  (``deepspeed.utils.safe_get_full_fp32_param``)
    optimizer_state.safetensors   {"<name>::<key>": tensor}: the optimizer's state of each trainable tensor, whole
                                  (AdamW: ``exp_avg``, ``exp_avg_sq``, ``step``; SGD without momentum: none);
                                  metadata ``param_groups``: the hyper-parameters (JSON), ``lr`` as at this step
    custom_checkpoint_0.pkl       the LR scheduler's ``state_dict`` (accelerate writes it in every mode)

``name`` is the parameter's name in the PEFT model (``base_model.model.model.layers.0...lora_A.default.weight``), the
same in every mode. The adapter file names them as peft's ``save_pretrained`` does (without the adapter name,
``...lora_A.weight``), so a checkpoint directory is a peft adapter: ``PeftModel.from_pretrained(base, ckpt)`` and
transformers' ``model.load_adapter(ckpt)`` load it (:func:`write_adapter`); :func:`parameter_names` maps the names back,
and reads a checkpoint written before (parameter names) as it is. The shards are gathered at save with each library's
own tools: torch's ``get_optimizer_state_dict(full_state_dict=True)`` for one device, DDP and FSDP2 (``DTensor`` shards
gathered), and DeepSpeed's ``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state`` for ZeRO-1/2/3 (the fp32
partitions gathered); LoRA states are small, so every rank briefly holds them whole. At load they are put back with the
same tools (``set_model_state_dict``/``set_optimizer_state_dict``; ``safe_set_full_fp32_param``/
``safe_set_full_optimizer_state`` under DeepSpeed), so a checkpoint written by ZeRO-3 on 2 processes resumes under DDP
on 4, FSDP2, or one device (:func:`load_portable`). A resume in the same mode on the same number of processes reads the
mode's own files instead (``accelerate.load_state``: bit-exact, as before).

RNG: with the same number of processes each rank restores its own ``random_states_<rank>.pkl``; with another
number the ranks' streams cannot be carried over (there is no rank 3 to take the state of), so each rank seeds
Python, NumPy and torch from :func:`derived_seed` ``(train.seed, step, rank)``: dropout masks then differ from the
uninterrupted run's (said in the log); with ``lora.dropout=0`` nothing else in training draws random numbers.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from scale.distributed.launch import ModePlan

logger = get_logger(__name__)

ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
OPTIMIZER_FILE = "optimizer_state.safetensors"
SCHEDULER_FILE = "custom_checkpoint_0.pkl"  # accelerate's name for the first registered object: the LR scheduler
PORTABLE_FILES = (ADAPTER_FILE, OPTIMIZER_FILE, SCHEDULER_FILE)
_SEP = "::"


class PortableStateError(RuntimeError):
    """The checkpoint's tensors do not fit this model (other names or shapes)."""


def _full(t: torch.Tensor) -> torch.Tensor:
    """A whole tensor on CPU; a ``DTensor`` shard (FSDP2) is gathered first: a collective, every rank calls."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().contiguous()


def _module(acc: Accelerator, plan: ModePlan, model: torch.nn.Module) -> torch.nn.Module:
    """The PEFT model inside the launch mode's wrapper (DeepSpeed engine, DDP); FSDP2 shards in place."""
    if plan.deepspeed:
        return model.module
    while isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = model.module
    return model


def _inner(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's wrapper (under DeepSpeed: the one ZeRO steps over its partitions)."""
    inner = getattr(optimizer, "optimizer", optimizer)  # AcceleratedOptimizer / DeepSpeedOptimizerWrapper
    return getattr(inner, "optimizer", inner)           # DeepSpeedZeroOptimizer -> the client optimizer


def _hyper(groups: list[dict[str, Any]]) -> str:
    """The param groups' hyper-parameters (``lr`` as set for the next step, betas, ...) as JSON, without params."""
    value = lambda v: list(v) if isinstance(v, tuple) else float(v) if torch.is_tensor(v) else v
    return json.dumps([{k: value(v) for k, v in g.items() if k != "params" and (
        v is None or torch.is_tensor(v) or isinstance(v, (bool, int, float, str, list, tuple)))} for g in groups])


def gather_portable(acc: Accelerator, plan: ModePlan, model: torch.nn.Module, optimizer: Any
                    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, str]]:
    """The trainable tensors, their optimizer state and the hyper-parameters, whole, on every rank. Collective.

    Returns:
        ``(weights, optimizer_tensors, metadata)``: ``{name: tensor}``, ``{"<name>::<key>": tensor}`` and
        ``{"param_groups": json}``, all on CPU.
    """
    module = _module(acc, plan, model)
    trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    inner = _inner(optimizer)
    if plan.deepspeed:  # the fp32 partitions of ZeRO-1/2/3, gathered by DeepSpeed (all-reduce / all-gather)
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        states = list(inner.state.values())
        keys = sorted({k for st in states for k, v in st.items() if torch.is_tensor(v) and v.dim() > 0})
        step = next((st["step"] for st in states if "step" in st), None)
        weights, tensors = {}, {}
        for name, p in trainable:  # collective, every rank in the same order
            weights[name] = safe_get_full_fp32_param(p).detach().cpu().reshape(p.ds_shape if hasattr(p, "ds_shape")
                                                                                else p.shape).contiguous()
            for key in keys:
                tensors[f"{name}{_SEP}{key}"] = safe_get_full_optimizer_state(p, key).detach().cpu().reshape(
                    weights[name].shape).contiguous()
            if step is not None:
                tensors[f"{name}{_SEP}step"] = torch.tensor(float(step), dtype=torch.float32)  # one count for all
        return weights, tensors, {"param_groups": _hyper(inner.param_groups)}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    weights = {name: _full(p) for name, p in trainable}  # collective under FSDP2
    osd = get_optimizer_state_dict(model, inner, options=StateDictOptions(full_state_dict=True))  # collective
    tensors = {f"{name}{_SEP}{key}": _full(value) for name, st in osd["state"].items() for key, value in st.items()
               if torch.is_tensor(value)}
    unknown = {k.split(_SEP)[0] for k in tensors} - set(weights)
    if unknown:
        raise PortableStateError(f"the optimizer holds state of tensors the model does not train: {sorted(unknown)[:3]}")
    return weights, tensors, {"param_groups": _hyper(osd["param_groups"])}


def write_portable(acc: Accelerator, plan: ModePlan, model: torch.nn.Module, optimizer: Any, directory: Path,
                   writer: bool) -> None:
    """Gather (:func:`gather_portable`) and, on ``writer``, write ``adapter_model.safetensors`` (as peft saves an
    adapter, :func:`write_adapter`; a full fine-tune's every weight by parameter name) and
    ``optimizer_state.safetensors`` into ``directory``. Collective."""
    weights, tensors, meta = gather_portable(acc, plan, model, optimizer)
    if writer:
        module = _module(acc, plan, model)
        if hasattr(module, "peft_config"):
            write_adapter(module, weights, directory)
        else:  # model.finetune=full: every weight by its parameter name (no adapter for peft to name)
            save_file(weights, str(directory / ADAPTER_FILE))
        save_file(tensors, str(directory / OPTIMIZER_FILE), metadata=meta)


def write_adapter(peft_model: torch.nn.Module, weights: dict[str, torch.Tensor], directory: Path) -> None:
    """Write ``weights`` (``{parameter name: whole tensor}``, the trainable LoRA tensors) into ``directory`` as peft
    saves an adapter: ``adapter_config.json`` and ``adapter_model.safetensors`` keyed without the adapter name
    (peft's ``save_pretrained(state_dict=...)``, the ``default`` adapter only; no model card). Plain peft and
    transformers then load the checkpoint as they load the final ``adapter/``. Not a collective: the tensors are
    whole already.
    """
    names = trained_aliases(peft_model)  # a tied head's copy too: peft saves every wrapper's tensor, by its name
    weights = {alias: weights[name] for alias, name in names.items() if name in weights} | weights
    peft_model.save_pretrained(str(directory), state_dict=weights, selected_adapters=["default"],
                               safe_serialization=True, save_embedding_layers=False)
    (directory / "README.md").unlink(missing_ok=True)  # peft's model card: not part of a checkpoint


def trained_aliases(model: torch.nn.Module) -> dict[str, str]:
    """``{name: the parameter's first name}`` for every name of a trainable parameter, shared ones included: with
    ``lora.modules_to_save`` on a tied head (peft's ``ensure_weight_tying``) the head's copy is the embeddings' copy
    under a second name, which ``named_parameters`` leaves out and peft's save and load ask for."""
    first: dict[int, str] = {}
    out = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        if p.requires_grad:
            out[n] = first.setdefault(id(p), n)
    return out


def parameter_names(peft_model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's adapter tensors keyed by ``peft_model``'s parameter names.

    The file names them as peft saves them (:func:`write_adapter`); peft's ``get_peft_model_state_dict`` applied to
    the model's trainable parameter names (each holding its index, not the parameter: no FSDP2 gather) gives the
    same keys, which maps each key back to its parameter. A checkpoint written with parameter names (before adapters
    were saved as peft's) passes unchanged; a key that names no trainable parameter is kept, for the caller's check to
    report.
    """
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    if set(weights) <= set(trainable):
        return weights
    from peft import get_peft_model_state_dict

    # each name's index as its tensor: peft renames the keys only (a sharded parameter itself would be gathered)
    aliases = trained_aliases(peft_model)
    index = {n: i for i, n in enumerate(trainable)}
    marks = {alias: torch.tensor(index[name]) for alias, name in aliases.items()}
    saved = get_peft_model_state_dict(peft_model, state_dict=marks, adapter_name="default",
                                      save_embedding_layers=False)
    names = {key: trainable[int(t)] for key, t in saved.items() if t.dim() == 0}
    # peft 0.15 reads a lora.modules_to_save copy from the module itself, not from the state dict it is given (fixed
    # by huggingface/peft#2450's change): its saved key is its name without the adapter's ``modules_to_save.default``
    names |= {alias.replace(".modules_to_save.default.", "."): name for alias, name in aliases.items()
              if ".modules_to_save.default." in alias and alias.replace(".modules_to_save.default.", ".") not in names}
    return {names.get(key, key): t for key, t in weights.items()}


def read_portable(directory: Path) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]],
                                            list[dict[str, Any]]]:
    """``(weights, {name: {key: tensor}}, param_groups)`` of a checkpoint, on CPU."""
    weights = load_file(str(directory / ADAPTER_FILE))
    with safe_open(str(directory / OPTIMIZER_FILE), framework="pt") as fh:
        groups = json.loads((fh.metadata() or {}).get("param_groups", "[]"))
        state: dict[str, dict[str, torch.Tensor]] = {}
        for key in fh.keys():  # noqa: SIM118 - a safetensors file handle, not a dict
            name, what = key.rsplit(_SEP, 1)
            state.setdefault(name, {})[what] = fh.get_tensor(key)
    return weights, state, groups


def load_portable(acc: Accelerator, plan: ModePlan, model: torch.nn.Module, optimizer: Any, scheduler: Any,
                  directory: Path) -> None:
    """Put a checkpoint's portable state into this run's model, optimizer and scheduler, in any launch mode.
    Collective. RNG states are :func:`restore_rng`'s.

    Raises:
        PortableStateError: the checkpoint trains other tensors than this model, or of other shapes.
    """
    weights, state, groups = read_portable(directory)
    module = _module(acc, plan, model)
    weights = parameter_names(module, weights)
    trainable = {n: p for n, p in module.named_parameters() if p.requires_grad}
    shapes = {n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in trainable.items()}
    if set(weights) != set(trainable) or any(tuple(weights[n].shape) != shapes[n] for n in weights):
        other = sorted(n for n in weights if n not in shapes or tuple(weights[n].shape) != shapes[n])
        raise PortableStateError(f"{directory / ADAPTER_FILE} holds other tensors than this model trains: "
                                 f"missing {sorted(set(trainable) - set(weights))[:3]}, other or unexpected "
                                 f"{other[:3]}")
    inner = _inner(optimizer)
    if plan.deepspeed:
        _load_deepspeed(acc, plan, trainable, inner, model, weights, state, groups)
    else:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, strict=False))
        if any(t.dim() > 0 for st in state.values() for t in st.values()):
            names = list(trainable)  # the optimizer was built over the trainable parameters in this order
            osd = {"state": {n: dict(state[n]) for n in names if n in state},
                   "param_groups": [{**g, "params": names} for g in groups[:1]]}
            set_optimizer_state_dict(model, inner, osd, options=StateDictOptions(full_state_dict=True))  # collective
        else:  # a stateless optimizer (SGD without momentum): torch's loader finds no state to place
            _set_hyper(inner, groups)
    scheduler.load_state_dict(torch.load(directory / SCHEDULER_FILE, weights_only=True))


def _prime(inner: torch.optim.Optimizer, params: list[torch.Tensor] | None = None) -> None:
    """Create the optimizer's per-tensor state with one step at learning rate 0 over zero gradients (as torch's
    ``set_optimizer_state_dict`` does, ``_init_optim_state``): AdamW and SGD then leave every parameter
    bit-identical. ``params``: the tensors it steps (default: every tensor of its param groups) get zero gradients;
    the gradients in place before (DeepSpeed offload keeps buffers there) are put back."""
    if params is None:
        params = [p for g in inner.param_groups for p in g["params"]]
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


def _load_deepspeed(acc: Accelerator, plan: ModePlan, trainable: dict[str, torch.nn.Parameter],
                    inner: torch.optim.Optimizer, engine: Any, weights: dict[str, torch.Tensor],
                    state: dict[str, dict[str, torch.Tensor]], groups: list[dict[str, Any]]) -> None:
    """ZeRO-1/2/3: the module's copy of each tensor, the fp32 master partition and the optimizer state partitions,
    each set from the whole tensor with DeepSpeed's own calls. Collective (ZeRO-3 gathers and re-partitions)."""
    import deepspeed
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    if plan.mode == "zero3":  # the partitioned module weights: changed on rank 0 inside a gather, re-partitioned
        with deepspeed.zero.GatheredParameters(list(trainable.values()), modifier_rank=0):
            if acc.is_main_process:
                for n, p in trainable.items():
                    p.data.copy_(weights[n].to(p.device, p.dtype))
    else:  # ZeRO-1/2 keep the module's weights whole on every rank
        for n, p in trainable.items():
            p.data.copy_(weights[n].to(p.device, p.dtype))
    for n, p in trainable.items():
        safe_set_full_fp32_param(p, weights[n].to(p.device))
    keys = sorted({k for st in state.values() for k in st if k != "step"})
    if keys:
        # The state DeepSpeed's setters write into must exist (it is created at the first step), per fp32 partition:
        # ZeRO-3 lists them in the optimizer's param group only while it steps them.
        zero = engine.optimizer
        partitions = getattr(zero, "fp32_partitioned_groups_flat", None) or zero.single_partition_of_fp32_groups
        own = inner.param_groups
        inner.param_groups = [{**own[0], "params": list(partitions)}]
        try:
            _prime(inner)
        finally:
            inner.param_groups = own
        if hasattr(zero, "_lazy_init_hp_params_optimizer_state"):  # ZeRO-1/2 link it to each tensor's fragment
            zero._lazy_init_hp_params_optimizer_state()
        for n, p in trainable.items():
            for key in keys:
                safe_set_full_optimizer_state(p, state[n][key].to(p.device), key)
        steps = {float(st["step"]) for st in state.values() if "step" in st}
        if len(steps) > 1:  # ZeRO keeps one count per partition of many tensors
            raise PortableStateError(f"the checkpoint's tensors were stepped different numbers of times "
                                     f"({sorted(steps)[:4]}); DeepSpeed keeps one count for all of them")
        for st in inner.state.values():
            if steps and "step" in st:
                value = next(iter(steps))
                st["step"] = st["step"].fill_(value) if torch.is_tensor(st["step"]) else type(st["step"])(value)
    _set_hyper(inner, groups)


def _set_hyper(inner: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> None:
    """The saved hyper-parameters into every param group: ``lr`` as the scheduler set it for the next step,
    betas, eps, weight decay (the scheduler's ``load_state_dict`` does not set ``lr``)."""
    for g in inner.param_groups:
        g.update({k: (tuple(v) if k == "betas" else v) for k, v in (groups[0] if groups else {}).items()
                  if k in g and k != "params"})


def derived_seed(seed: int, step: int, rank: int) -> int:
    """The seed of rank ``rank`` resuming at optimizer step ``step`` on another number of processes: NumPy's
    ``SeedSequence((seed, step, rank))`` (well spread, distinct per rank and step), as a 32-bit int."""
    return int(np.random.SeedSequence([seed, step, rank]).generate_state(1)[0])


def rng_states() -> dict[str, Any]:
    """This process's Python, NumPy and torch (CPU, and every CUDA device) RNG states under the keys of accelerate's
    ``random_states_<rank>.pkl``: what a checkpoint written now would hold."""
    states = {"random_state": random.getstate(), "numpy_random_seed": np.random.get_state(),
              "torch_manual_seed": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["torch_cuda_manual_seed"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    """Set this process's Python, NumPy and torch RNG states from :func:`rng_states`' (or a checkpoint's) mapping."""
    random.setstate(states["random_state"])
    np.random.set_state(states["numpy_random_seed"])
    torch.set_rng_state(states["torch_manual_seed"])
    if torch.cuda.is_available() and "torch_cuda_manual_seed" in states:
        torch.cuda.set_rng_state_all(states["torch_cuda_manual_seed"])


def restore_rng(acc: Accelerator, directory: Path, saved_world: int, seed: int, step: int, draws: str = "") -> str:
    """Restore this rank's Python, NumPy and torch RNG states from ``random_states_<rank>.pkl`` when the checkpoint
    was written by as many processes as this run has; else seed them by :func:`derived_seed`. Returns the rule used,
    in words, for the log: ``draws`` says what in the model draws dropout masks
    (:meth:`scale.modeling.dropout.Dropouts.text`; ``""`` when nothing does, and then the reseeding changes no number
    of training)."""
    if saved_world == acc.num_processes:
        from accelerate.utils.other import load

        set_rng_states(load(directory / f"random_states_{acc.process_index}.pkl"))  # accelerate's weights_only loader
        return "each rank's RNG states restored"
    value = derived_seed(seed, step, acc.process_index)
    random.seed(value)
    np.random.seed(value)
    torch.manual_seed(value)  # all devices
    effect = (f"dropout masks ({draws}) differ from an uninterrupted run's from here on" if draws else
              "no dropout is active, so training draws nothing from it")
    return (f"{saved_world} process(es) wrote it, this run has {acc.num_processes}: each rank's Python/NumPy/torch RNG "
            f"is seeded from (train.seed, step, rank); {effect}")
