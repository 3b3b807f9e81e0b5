"""The launch mode: the Accelerator, start-up guards, DeepSpeed reconciliation and the mode plan.

Everything that differs between one device, DDP, DeepSpeed ZeRO-1/2/3 and several nodes is decided here,
once, from the environment the launcher set up (``accelerate launch``, ``torchrun``, ``deepspeed``) and the
training config, and recorded in a :class:`ModePlan` that the rest of the harness reads instead of asking
``acc.distributed_type`` again.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator, DataLoaderConfiguration, PartialState
from accelerate.utils import DistributedType, GradientAccumulationPlugin, InitProcessGroupKwargs, ProjectConfiguration

from scale.config.load import configs_dir
from scale.config.schema import Config
from scale.config.validation import ConfigError
from scale.distributed.inputs import check_inputs
from scale.distributed.rendezvous import init_elastic_process_group, with_rendezvous_retries
from scale.distributed.topology import ranks_problem, usable_cores


class LaunchError(RuntimeError):
    """The launch mode contradicts itself or the training config; the message names the fix."""


def check_launch_environment(env: dict[str, str] | None = None) -> None:
    """Fail fast on launches that would start fewer processes than asked, before any work is done.

    ``accelerate launch --cpu --num_processes 2`` and a ``MULTI_CPU`` YAML start ONE process (accelerate
    1.15): it is recognisable by a rendezvous address without a ``WORLD_SIZE``.

    Raises:
        LaunchError: the environment is such a launch.
    """
    env = os.environ if env is None else env
    launched_by_accelerate = "ACCELERATE_MIXED_PRECISION" in env
    if launched_by_accelerate and "MASTER_ADDR" in env and "WORLD_SIZE" not in env:
        raise LaunchError("accelerate launch started ONE process for a multi-process CPU launch (--cpu with "
                          "--num_processes > 1, or distributed_type: MULTI_CPU). Use "
                          "--config_file configs/accelerate/cpu_ddp.yaml (MULTI_GPU, num_processes: 2): on a "
                          "machine without CUDA the loop then runs a real gloo process group.")


def check_ranks_per_machine(env: dict[str, str] | None = None) -> None:
    """Refuse more ranks on this machine than it has devices (:func:`scale.distributed.topology.ranks_problem`): an
    ``accelerate launch`` of a YAML written for 8 GPUs started 8 ranks, and an 8x global batch, on a 2-core CPU.

    Raises:
        LaunchError: ``LOCAL_WORLD_SIZE`` (torchrun, accelerate) or ``LOCAL_SIZE`` (deepspeed) exceeds the visible
            GPUs, or without a GPU ``max(2, CPU cores)``.
    """
    env = os.environ if env is None else env
    local = int(env.get("LOCAL_WORLD_SIZE", env.get("LOCAL_SIZE", "1")))
    problem = ranks_problem(local, torch.cuda.device_count() if torch.cuda.is_available() else 0, usable_cores())
    if local > 1 and problem:
        raise LaunchError(f"{problem}: launch with --num_processes N (accelerate launch, or scale-train "
                          f"--accelerate-config NAME --num-processes N; without it the shipped topologies take one "
                          f"process per visible GPU)")


def resolve_deepspeed_file(env: Any = None) -> None:
    """Make the DeepSpeed JSON that an accelerate config names readable from any directory.

    ``accelerate launch`` hands the YAML's ``deepspeed_config_file`` to the ranks as written
    (``ACCELERATE_DEEPSPEED_CONFIG_FILE``), and the ranks read it relative to the current directory. The
    shipped YAMLs name it relative to themselves (``../deepspeed/zero2.json``): a relative path that is not
    found from the current directory is read relative to the shipped accelerate configs (and the repository
    root, for older YAMLs), and the environment is updated before the Accelerator reads it.

    Raises:
        ConfigError: the file is found nowhere.
    """
    env = os.environ if env is None else env
    value = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if not value or value == "none" or Path(value).is_absolute() or Path(value).is_file():
        return
    for base in (configs_dir() / "accelerate", configs_dir().parent):
        if (base / value).is_file():
            env["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = str((base / value).resolve())
            return
    raise ConfigError(f"the accelerate config's deepspeed_config_file={value!r} exists neither in the current "
                      f"directory ({os.getcwd()}) nor next to the shipped accelerate configs; write an absolute "
                      f"path, or launch with `scale-train --accelerate-config <yaml>` (read relative to the YAML)")


def cpu_threads_per_rank(env: dict[str, str]) -> None:
    """The ``deepspeed`` launcher leaves ``OMP_NUM_THREADS`` unset: 2 ranks on 2 cores ran 37x slower."""
    local = int(env.get("LOCAL_WORLD_SIZE", env.get("LOCAL_SIZE", "1")))
    if local > 1 and "OMP_NUM_THREADS" not in env and not torch.cuda.is_available():
        threads = max(1, (os.cpu_count() or 1) // local)
        torch.set_num_threads(threads)
        logging.getLogger(__name__).warning("OMP_NUM_THREADS unset with %d local ranks: using %d threads per rank",
                                            local, threads)


def skip_deepspeed_shm_op() -> None:
    """Keep DeepSpeed on CPU from JIT-compiling its shared-memory collective op, which training never uses.

    On CPU, DeepSpeed's ``TorchBackend`` builds ``deepspeed_shm_comm`` (C++ through ninja: ~27 s here, up to
    ~100 s on a busy machine, on the first launch of a machine; cached in ``~/.cache/torch_extensions``)
    whenever the op is marked compatible (deepspeed/comm/torch.py ``build_shm_op``, DeepSpeed 0.19). The op
    serves only ``inference_all_reduce``; training collectives go through ``torch.distributed`` (gloo) either
    way. DeepSpeed computes ``deepspeed.ops.__compatible_ops__`` once and keeps the dict ("edits to it
    persist", deepspeed/ops/__init__.py), so marking the op incompatible before the process group starts
    skips the build. Remove if a DeepSpeed training path starts using the op.
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def deepspeed_op_notice(ds: dict[str, Any]) -> str | None:
    """The one-line notice for a DeepSpeed config whose first launch on this machine JIT-compiles an op; else None.

    Optimizer offload (``offload_optimizer.device`` cpu/nvme, with DeepSpeed's default
    ``zero_force_ds_cpu_optimizer``) makes accelerate swap our AdamW for ``DeepSpeedCPUAdam``
    (accelerate/utils/deepspeed.py ``map_pytorch_optim_to_deepspeed``), whose ``cpu_adam`` op is compiled on
    first use (~46 s measured here; cached in ``~/.cache/torch_extensions`` or ``$TORCH_EXTENSIONS_DIR``) unless
    DeepSpeed was installed with it prebuilt (``DS_BUILD_CPU_ADAM=1``).
    """
    offload = ds.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none")
    if offload in (None, "none") or not ds.get("zero_force_ds_cpu_optimizer", True):
        return None
    from deepspeed.git_version_info import installed_ops
    from torch.utils.cpp_extension import _get_build_directory

    if installed_ops.get("cpu_adam"):
        return None
    build = _get_build_directory("cpu_adam", verbose=False)
    if any(name.endswith(".so") for name in (os.listdir(build) if os.path.isdir(build) else [])):
        return None
    return (f"optimizer offload ({offload}): DeepSpeed swaps AdamW for DeepSpeedCPUAdam and compiles its cpu_adam op "
            f"on this first launch (about a minute, once per machine; cached in {build}; prebuild it with "
            f"DS_BUILD_CPU_ADAM=1 pip install deepspeed)")


def build_accelerator(cfg: Config, settle: Callable[[], Any] | None = None) -> Accelerator:
    """Create the Accelerator for the launch mode found in the environment, with start-up guards.

    Args:
        cfg: the run's config; ``train.mixed_precision`` must be resolved (not ``auto``) when the Accelerator is
            made.
        settle: called on every rank once the process group is up and before the Accelerator is made, to agree
            on what the Accelerator needs (``scale.training.job`` resolves ``train.mixed_precision: auto`` there, rank
            0's choice broadcast); collectives allowed. The group is started as the Accelerator starts it
            (accelerate's ``PartialState`` with the same ``cpu`` flag and process-group arguments).

    Raises:
        ConfigError: see :func:`check_inputs`.
        LaunchError: several processes were launched but accelerate did not set up a process group; a
            DeepSpeed config contradicts the training config (gradient_accumulation_steps, gradient_clipping);
            see also :func:`check_launch_environment`.
    """
    check_launch_environment()
    check_ranks_per_machine()
    check_inputs(cfg)
    resolve_deepspeed_file()
    use_deepspeed = (os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
                     or cfg.train.deepspeed_config is not None)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    check_sequence_parallel_launch(cfg.train.sequence_parallel_size, use_deepspeed, world)
    parallelism = sequence_parallelism_config(cfg, world)  # accelerate's own checks, before any process group
    on_cpu = not torch.cuda.is_available()
    # DeepSpeed on CPU needs gloo (cpu=True would silently drop DeepSpeed); otherwise accelerate picks.
    # The timeout bounds how long a rank waits for a peer that died on another node.
    # Starting the group gets train.rendezvous_timeout_s per try (a restarted torchrun group's gloo connect was seen
    # to hang); its collectives then get train.collective_timeout_s (set below).
    handlers = [InitProcessGroupKwargs(backend="gloo" if on_cpu and use_deepspeed else None,
                                       timeout=timedelta(seconds=min(cfg.train.rendezvous_timeout_s,
                                                                     cfg.train.collective_timeout_s)))]
    if use_deepspeed and on_cpu:
        skip_deepspeed_shm_op()
    plugin = None
    if cfg.train.deepspeed_config is not None:  # e.g. under the `deepspeed` launcher or torchrun
        from accelerate.utils import DeepSpeedPlugin

        plugin = DeepSpeedPlugin(hf_ds_config=cfg.train.deepspeed_config)
    tries = iter(range(cfg.train.rendezvous_retries + 1))

    def start() -> Accelerator:
        init_elastic_process_group(next(tries), timedelta(seconds=min(cfg.train.rendezvous_timeout_s,
                                                                      cfg.train.collective_timeout_s)))
        if settle is not None:
            PartialState(on_cpu and not use_deepspeed, **handlers[0].to_kwargs())  # what Accelerator() would start
            settle()
        return make()

    make = lambda: Accelerator(
        cpu=on_cpu and not use_deepspeed,
        mixed_precision=cfg.train.mixed_precision,
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=cfg.train.gradient_accumulation_steps, sync_with_dataloader=False),
        # even_batches=False: no sample is repeated to even out ranks (that would change the maths).
        dataloader_config=DataLoaderConfiguration(even_batches=False, use_seedable_sampler=True),
        deepspeed_plugin=plugin,
        log_with=[t for t in cfg.log.trackers if t != "none"] or None,
        parallelism_config=parallelism,
        project_config=ProjectConfiguration(project_dir=cfg.output_dir,
                                            save_on_each_node=cfg.train.save_on_each_node),
        kwargs_handlers=handlers,
    )
    acc = with_rendezvous_retries(start, cfg.train.rendezvous_retries)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        from torch.distributed.distributed_c10d import _set_pg_timeout  # torch >= 2.2

        _set_pg_timeout(timedelta(seconds=cfg.train.collective_timeout_s))
    cpu_threads_per_rank(dict(os.environ))
    if world > 1 and acc.distributed_type == DistributedType.NO:
        raise LaunchError(f"WORLD_SIZE={world} but accelerate runs DistributedType.NO: the processes would "
                          f"train unsynced replicas. Launch with a MULTI_GPU/DEEPSPEED accelerate config.")
    if use_deepspeed and acc.distributed_type != DistributedType.DEEPSPEED:
        raise LaunchError(f"a DeepSpeed launch ended up as {acc.distributed_type}: DeepSpeed was dropped")
    fsdp = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    if fsdp and acc.distributed_type != DistributedType.FSDP:
        raise LaunchError(f"an FSDP launch ended up as {acc.distributed_type}: accelerate enters FSDP only on GPUs (it "
                          f"would train unsharded replicas here); on CPU shard with configs/accelerate/cpu_zero3.yaml")
    if acc.distributed_type == DistributedType.DEEPSPEED:
        reconcile_deepspeed(cfg, acc.state.deepspeed_plugin.deepspeed_config)
        notice = deepspeed_op_notice(acc.state.deepspeed_plugin.deepspeed_config)
        if notice and acc.is_main_process:
            logging.getLogger(__name__).warning(notice)
    return acc


def check_sequence_parallel_launch(sp_size: int, use_deepspeed: bool, world: int) -> None:
    """``train.sequence_parallel_size`` fits the launch: a DeepSpeed mode, and a divisor of the process count.

    Sequence parallelism runs through DeepSpeed Ulysses (:mod:`scale.distributed.ulysses`); DDP, FSDP2 and one device
    have no sequence-parallel backend here (torch's ring context parallelism has no CPU kernel, and is not proven on
    GPUs).

    Raises:
        LaunchError: ``sp_size > 1`` outside DeepSpeed, or ``sp_size`` does not divide ``world``.
    """
    if sp_size == 1:
        return
    if not use_deepspeed:
        raise LaunchError(f"train.sequence_parallel_size={sp_size} needs a DeepSpeed launch (ZeRO-1/2/3: "
                          f"configs/accelerate/zero2.yaml, cpu_zero2.yaml on CPU, or train.deepspeed_config); one "
                          f"device, DDP and FSDP2 have no sequence-parallel backend here")
    if world % sp_size:
        raise LaunchError(f"train.sequence_parallel_size={sp_size} does not divide the {world} launched process(es): "
                          f"each row is shared by {sp_size} ranks; launch a multiple of {sp_size} processes or "
                          f"choose a divisor of {world}")


def sequence_parallelism_config(cfg: Config, world: int) -> Any:
    """accelerate's ``ParallelismConfig`` for ``train.sequence_parallel_size > 1`` (DeepSpeed Ulysses), else None.

    ``dp_shard_size`` is the data-parallel degree ``world / N``: accelerate sets DeepSpeed's ``train_batch_size``
    from it (``micro_batch_size x gradient_accumulation_steps x data-parallel degree``).

    Built before the Accelerator (:func:`build_accelerator`): accelerate checks these values as the objects are made
    (``DeepSpeedSequenceParallelConfig.__post_init__`` refuses ``eager`` and, in accelerate 1.16, ``flex_attention``;
    ``ParallelismConfig.__post_init__`` the sizes), so a refusal is one line here instead of a ``ValueError``
    traceback on every rank from inside ``Accelerator()``.

    Raises:
        ConfigError: accelerate refused the values (its reason, and the keys that set them).
    """
    n = cfg.train.sequence_parallel_size
    if n == 1:
        return None
    import accelerate
    from accelerate.utils import ParallelismConfig
    from accelerate.utils.dataclasses import DeepSpeedSequenceParallelConfig

    attn = cfg.model.attn_implementation or "sdpa"
    try:
        return ParallelismConfig(dp_replicate_size=1, dp_shard_size=world // n, tp_size=1, cp_size=1, sp_size=n,
                                 sp_backend="deepspeed", sp_handler=DeepSpeedSequenceParallelConfig(
                                     sp_seq_length_is_variable=True, sp_attn_implementation=attn))
    except ValueError as e:
        raise ConfigError(f"train.sequence_parallel_size={n} with model.attn_implementation={attn} on {world} "
                          f"process(es): accelerate {accelerate.__version__} refuses it ({' '.join(str(e).split())}); "
                          f"set model.attn_implementation=sdpa (or null), or train.sequence_parallel_size=1") from None


def reconcile_deepspeed(cfg: Config, ds: dict[str, Any]) -> None:
    """Make the DeepSpeed JSON agree with the training config; a contradiction is an error.

    DeepSpeed's ``gradient_accumulation_steps`` silently wins over ours (accelerate only warns), and an
    unset ``gradient_clipping: "auto"`` becomes 1.0; both would change the maths without a word. A full fine-tune
    under bf16 gets ``data_types.grad_accum_dtype: fp32`` (DeepSpeed's default is the module's bf16).

    Raises:
        LaunchError: the JSON sets one of these keys to another value than the training config, or a
            ``grad_accum_dtype`` other than fp32 for a full fine-tune under bf16.
    """
    ours = {"gradient_accumulation_steps": cfg.train.gradient_accumulation_steps,
            "gradient_clipping": cfg.optim.max_grad_norm if cfg.optim.max_grad_norm is not None else 0.0,
            "train_micro_batch_size_per_gpu": cfg.train.micro_batch_size}
    for key, value in ours.items():
        theirs = ds.get(key, "auto")
        if theirs == "auto":
            ds[key] = value
        elif float(theirs) != float(value):
            raise LaunchError(f"the DeepSpeed config sets {key}={theirs} but the training config has {value} "
                              f"(train.*/optim.*); set it to \"auto\" in the JSON so the training config owns it")
    if ds.get("train_batch_size", "auto") == "auto":
        ds.pop("train_batch_size", None)  # DeepSpeed derives it from micro-batch x GA x world size
    if cfg.model.finetune == "full" and cfg.train.mixed_precision == "bf16":
        # DeepSpeed accumulates gradients in the module's dtype by default (engine.get_data_types): bf16 sums of
        # every weight's micro-batch gradients. fp32 accumulation (ZeRO-1 then steps with DeepSpeed's BF16_Optimizer).
        types = ds.setdefault("data_types", {})
        theirs = types.get("grad_accum_dtype")
        if theirs is None:
            types["grad_accum_dtype"] = "fp32"
        elif theirs != "fp32":
            raise LaunchError(f"the DeepSpeed config sets data_types.grad_accum_dtype={theirs} and the run has "
                              f"model.finetune=full with train.mixed_precision=bf16: full weights accumulate "
                              f"gradients in fp32; set it to \"fp32\" or remove it from the JSON")


@dataclass
class ModePlan:
    """Every knob that differs by launch mode, decided in one place (:func:`plan_for_mode`) and logged.

    Attributes:
        mode: ``single``, ``ddp``, ``zero1``/``zero2``/``zero3`` or ``fsdp``.
        deepspeed: the model is a DeepSpeed engine: it steps inside ``backward()`` and saves its own files.
        partitioned: weights are sharded over ranks (ZeRO-3, FSDP): reading full tensors (adapter, checks)
            is a collective gather.
        use_reentrant: the gradient-checkpointing kind (``model.use_reentrant``), checked against the mode.
        device_map: where ``from_pretrained`` puts a 4-bit base: this rank's device, or ``None`` under ZeRO-3
            (DeepSpeed places and partitions it).
        save_state_kwargs: extra arguments to ``accelerate.save_state`` (DeepSpeed: frozen weights excluded).
        load_state_kwargs: extra arguments to ``accelerate.load_state`` (DeepSpeed: non-strict, frozen base absent).
        data_parallel_size: ranks that each train other rows (the world size divided by
            ``sequence_parallel_size``: a sequence-parallel group counts once): ``global_batch_size =
            micro_batch_size x gradient_accumulation_steps x data_parallel_size``. DDP and ZeRO average the
            gradients over these ranks (and sum them over the ranks of a sequence-parallel group).
        sequence_parallel_size: ranks sharing each row along its length (``train.sequence_parallel_size``).
        gradient_average_size: what the mode divides the gradient summed over all ranks by (``acc.backward``'s
            loss is multiplied by it back, :func:`scale.train.train_window`): the world size, except ZeRO-1/2
            under sequence parallelism, which divide by the data-parallel degree (DeepSpeed 0.19
            ``stage_1_and_2.py``: ``world / sequence_parallel_size``, so a group's ranks are summed). ZeRO-3's
            reduce-scatter divides by the world size whatever the sequence-parallel degree (``stage3.py``
            ``__avg_scatter_grads``: ``reduce_scatter_coalesced`` pre-divides by the group size).
        notes: the decisions in words, for the start-up log.
    """

    mode: str
    deepspeed: bool = False
    partitioned: bool = False
    use_reentrant: bool = False
    device_map: Any = None
    save_state_kwargs: dict[str, Any] = field(default_factory=dict)
    load_state_kwargs: dict[str, Any] = field(default_factory=dict)
    data_parallel_size: int = 1
    sequence_parallel_size: int = 1
    gradient_average_size: int = 1
    notes: list[str] = field(default_factory=list)


def plan_for_mode(cfg: Config, acc: Accelerator) -> ModePlan:
    """Decide checkpointing, QLoRA placement and the checkpoint path for the resolved launch mode.

    - Re-entrant checkpointing under DDP with LoRA fails ("Expected to mark a variable ready only once",
      peft#313, trl#921): an error, with the fix. Non-reentrant also works under ZeRO-3 + PEFT here
      (measured: ZeRO-3 parity within 4e-7 of single device, benchmarks/parity.py), so we do not force
      re-entrant there as TRL does.
    - QLoRA: each rank loads its 4-bit model onto its own device (``device_map`` per local rank). Under
      ZeRO-3 or FSDP the packed 4-bit weights are only partitioned when their storage dtype is a float
      equal to the compute dtype (``bnb_4bit_quant_storage``).
    - DeepSpeed checkpoints hold DeepSpeed's own files, without the frozen base.

    Raises:
        LaunchError: one of the combinations above, or ``on_nonfinite=skip`` under DeepSpeed.
    """
    dt = acc.distributed_type
    ds = dt == DistributedType.DEEPSPEED
    zero = acc.state.deepspeed_plugin.zero_stage if ds else None
    mode = {DistributedType.NO: "single", DistributedType.DEEPSPEED: f"zero{zero}",
            DistributedType.FSDP: "fsdp"}.get(dt, "ddp")
    m = cfg.model
    sp = cfg.train.sequence_parallel_size
    plan = ModePlan(mode=mode, deepspeed=ds, partitioned=mode in ("zero3", "fsdp"), use_reentrant=m.use_reentrant,
                    data_parallel_size=cfg.train.data_parallel_size(acc.num_processes), sequence_parallel_size=sp,
                    gradient_average_size=acc.num_processes)
    if sp > 1 and zero in (1, 2):
        plan.gradient_average_size = plan.data_parallel_size
    if sp > 1 and zero == 3 and not acc.state.deepspeed_plugin.deepspeed_config.get(
            "zero_optimization", {}).get("reduce_scatter", True):
        raise LaunchError("zero_optimization.reduce_scatter=false under ZeRO-3 with train.sequence_parallel_size > 1: "
                          "DeepSpeed 0.19 then divides some gradient buckets by the data-parallel degree and others "
                          "by the world size; remove it from the DeepSpeed JSON (the default is true)")
    if sp > 1:
        plan.notes.append(f"sequence parallel: {sp} ranks per row (DeepSpeed Ulysses, "
                          f"{m.attn_implementation or 'sdpa'} attention), {plan.data_parallel_size} data-parallel")
        local = int(os.environ.get("LOCAL_WORLD_SIZE", acc.num_processes))
        if local % sp:  # groups are consecutive ranks: some span two nodes
            plan.notes.append(f"WARNING: train.sequence_parallel_size={sp} does not divide the {local} processes of a "
                              f"node: some rows' ranks sit on two nodes and every attention call crosses the network")
    if m.gradient_checkpointing and m.use_reentrant and mode in ("ddp", "zero1", "zero2") and acc.num_processes > 1:
        raise LaunchError("model.use_reentrant=true with LoRA under data parallelism fails with 'marked ready "
                          "twice' (peft#313, trl#921); set model.use_reentrant=false")
    if cfg.train.on_nonfinite == "skip" and ds:
        raise LaunchError("train.on_nonfinite=skip cannot work under DeepSpeed: its optimizer steps inside "
                          "backward(), before the loop sees the gradient norm; use train.on_nonfinite=error")
    grown = [f"{k}={v}" for k, v in (("lora.modules_to_save", cfg.lora.modules_to_save if m.finetune == "lora" else None),
                                      ("model.new_tokens", m.new_tokens),
                                      ("model.new_special_tokens", m.new_special_tokens)) if v]
    if grown and plan.partitioned:
        raise LaunchError(f"{', '.join(grown)} under {mode}: resizing and training whole modules inside a partitioned "
                          f"model is not tested here (peft 0.15 saves a module's local partition); launch with DDP "
                          f"or ZeRO-1/2")
    if m.gradient_checkpointing:
        plan.notes.append(f"checkpointing use_reentrant={m.use_reentrant}")
    if m.quantize_4bit:
        if mode != "zero3":  # transformers refuses a device_map under ZeRO-3
            plan.device_map = {"": acc.local_process_index} if acc.device.type == "cuda" else "cpu"
        plan.notes.append(f"4-bit base on {plan.device_map or 'ZeRO-3 placement'}, "
                          f"storage {m.bnb_4bit_quant_storage}")
        if plan.partitioned and m.bnb_4bit_quant_storage != m.bnb_4bit_compute_dtype:
            raise LaunchError(f"{mode} shards 4-bit weights only when model.bnb_4bit_quant_storage equals the "
                              f"compute dtype; set model.bnb_4bit_quant_storage={m.bnb_4bit_compute_dtype}")
    if ds:
        plan.save_state_kwargs = {"exclude_frozen_parameters": True}
        plan.load_state_kwargs = {"load_module_strict": False}
        plan.notes.append("checkpoints: DeepSpeed's files, frozen base excluded")
    if plan.partitioned:
        plan.notes.append("adapter and checks gather the partitioned weights (collective)")
    return plan
