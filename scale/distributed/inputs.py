"""The run's inputs, checked before any process group, file or model exists: paths (``model.name_or_path``,
``model.tokenizer``, ``train.deepspeed_config``, ``output_dir``), kernels that need a GPU (fp16, Liger) and trackers.
Each refusal is one :class:`~scale.config.validation.ConfigError` line naming the key.
"""

from __future__ import annotations

import importlib
import os
import re
import tempfile
from pathlib import Path

import torch

from scale.config.schema import Config
from scale.config.validation import ConfigError, get_key


_EMBEDDED_MODELS = ("smollm2-135m", "tiny-llama")
_HUB_ID = re.compile(r"^(?:[\w\-.]{1,96}/)?[\w\-.]{1,96}$")  # huggingface_hub's repo-id shape
_TRACKER_PACKAGES = {"wandb": "'scale[wandb]'", "comet_ml": "comet-ml"}


def check_inputs(cfg: Config) -> None:
    """Reject inputs that would fail later with a traceback or a silent wrong result, before any process
    group, file or model exists. Every rank runs it and reaches the same verdict (shared storage).

    Raises:
        ConfigError: ``train.mixed_precision=fp16`` without a GPU; ``loss.fused=liger`` or ``model.kernels=liger``
            without a GPU or liger-kernel; ``output_dir`` is a file or not writable;
            ``model.name_or_path``/``model.tokenizer``/``train.deepspeed_config`` name a path that does not exist;
            an unknown tracker or one whose package is missing.
    """
    if cfg.train.mixed_precision == "fp16" and not torch.cuda.is_available():
        raise ConfigError("train.mixed_precision=fp16 needs a CUDA GPU: on CPU it would silently run in fp32 while "
                          "config.yaml says fp16; use train.mixed_precision=bf16 or no")
    if cfg.loss.fused == "liger":
        check_liger("loss.fused", "liger_kernel.transformers.functional",
                    "scale.loss.chunked's loss, exact on any device")
    check_kernels(cfg)
    check_output_dir(cfg.output_dir)
    check_model_paths(cfg)
    ds = cfg.train.deepspeed_config
    if ds is not None and not Path(ds).is_file():
        raise ConfigError(f"train.deepspeed_config={ds!r} does not exist (a relative path is read from the current "
                          f"directory, {os.getcwd()})")
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS, get_available_trackers

    available = {str(t) for t in get_available_trackers()}
    for name in cfg.log.trackers:
        if name == "none":
            continue
        if name not in LOGGER_TYPE_TO_CLASS:
            raise ConfigError(f"log.trackers: unknown tracker {name!r}; known: {sorted(LOGGER_TYPE_TO_CLASS)}, "
                              f"or [] for none")
        if name not in available:
            raise ConfigError(f"log.trackers: {name!r} needs its package: pip install "
                              f"{_TRACKER_PACKAGES.get(name, name)}, or drop it from log.trackers")


def check_kernels(cfg: Config) -> None:
    """``model.kernels: liger`` needs a CUDA GPU and liger-kernel; the model family is checked once the model is built
    (:func:`scale.modeling.kernels.apply_kernels`).

    Raises:
        ConfigError: ``model.kernels=liger`` without a CUDA GPU or without liger-kernel.
    """
    if cfg.model.kernels == "liger":
        check_liger("model.kernels", "liger_kernel.transformers", "transformers' own RMSNorm, SwiGLU and RoPE")


def check_liger(key: str, module: str, instead: str) -> None:
    """``<key>=liger`` needs a CUDA GPU and liger-kernel (its kernels are Triton only).

    Args:
        key: the config key set to ``liger`` (``loss.fused``, ``model.kernels``).
        module: the liger-kernel module the key uses.
        instead: what ``<key>=null`` runs, for the message.

    Raises:
        ConfigError: no CUDA GPU, or ``module`` does not import.
    """
    if not torch.cuda.is_available():
        raise ConfigError(f"{key}=liger needs a CUDA GPU (Liger-Kernel's Triton kernels); on CPU set {key}=null "
                          f"({instead})")
    try:
        importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"{key}=liger needs liger-kernel ({e}): pip install liger-kernel, or set "
                          f"{key}=null") from None


def check_model_paths(cfg: Config) -> None:
    """``model.name_or_path`` and ``model.tokenizer`` name a model directory, an embedded model or a hub id, checked
    from the names alone (no library is imported: ``scale-train`` runs it before transformers and bitsandbytes).

    Raises:
        ConfigError: a path that does not exist, a file, or a directory without ``config.json``.
    """
    for key in ("model.name_or_path", "model.tokenizer"):
        value = get_key(cfg, key)
        if value is None or value in _EMBEDDED_MODELS:
            continue
        path = Path(value).expanduser()
        if path.is_dir():
            if key == "model.name_or_path" and not (path / "config.json").is_file():
                raise ConfigError(f"{key}={value!r} is a directory without config.json, not a transformers model "
                                  f"(write one with save_pretrained)")
        elif path.exists():
            raise ConfigError(f"{key}={value!r} is a file; point it at a model directory or a hub id")
        elif not _HUB_ID.match(value) or value.startswith((".", "~")):
            raise ConfigError(f"{key}={value!r} does not exist (a relative path is read from the current directory, "
                              f"{os.getcwd()})")


def check_output_dir(output_dir: str) -> None:
    """``output_dir`` is a directory this process can write to, or can be created; nothing is left behind.

    Raises:
        ConfigError: it (or a parent) is a file, or the nearest existing directory refuses a file.
    """
    out = Path(output_dir).expanduser().absolute()
    existing = next(p for p in (out, *out.parents) if p.exists())
    if not existing.is_dir():
        where = "is a file" if existing == out else f"cannot be created: {existing} is a file"
        raise ConfigError(f"output_dir={output_dir} {where}; point output_dir at a directory")
    try:  # os.access says yes to root on a read-only mount: try a nameless temporary file instead
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise ConfigError(f"output_dir={output_dir} is not writable ({existing}: {e.strerror}); choose a directory "
                          f"you can write to") from None
