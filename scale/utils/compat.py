"""The one place where the package meets a library API that moved between its declared bounds and today.

Each change below names the library version it happened in; a call site that would differ between the bounds
goes through a function here, so the rest of ``scale/`` is written against one API. The ranges in
:data:`TESTED` are the ones the unit tier passed on: the lower end is ``pyproject.toml``'s bound (``make
test-lowest`` installs exactly those versions), the upper end the newest release the registry served when the
unit tier last ran on it (``make test``'s ``.venv``, resolved to the highest versions).

| library | what changed | in | handled by |
|---|---|---|---|
| transformers | ``activation_checkpointing_enable(activation_checkpointing_kwargs, every_n_layers, offload)`` \
added; ``gradient_checkpointing_enable`` a deprecated alias (FutureWarning, removal announced for v6) | 5.23.0 | \
:func:`enable_checkpointing` |
| transformers | ``gradient_checkpointing_enable(every_n_layers=)`` (``gradient_checkpointing=every_n``) | 5.16.0 | \
the bound, 5.17 |
| transformers | ``gradient_checkpointing_enable(offload=)`` (``model.gradient_checkpointing=offload``) | 5.17.0 | the \
bound, 5.17 (what a CUDA image ships) |
| transformers | ``from_pretrained(dtype=)`` for ``torch_dtype=``; ``logits_to_keep`` as a tensor | 5.0 | the bound |
| transformers | requires ``safetensors>=0.8``, ``huggingface-hub>=1.5`` | 5.17.0 | the bound, safetensors 0.8 |
| datasets | requires ``tqdm>=4.66.3`` | 3.0.0 | the bound, tqdm 4.66.3 |
| accelerate | log lines of ``get_logger`` prefixed ``[RANK n]`` (docs/outputs.md, the tests read them) | 1.13.0 | \
the bound, 1.13 |
| accelerate | ``ParallelismConfig(sp_size=, sp_backend="deepspeed")``, ``DeepSpeedSequenceParallelConfig`` \
(``train.sequence_parallel_size``: DeepSpeed Ulysses) | 1.12.0 | the bound, 1.12 |
| accelerate | ``DataLoaderConfiguration(use_seedable_sampler=)``, ``GradientAccumulationPlugin`` | < 1.10 | the bound |
| peft | ``save_pretrained(state_dict=)``, ``target_modules="all-linear"`` | < 0.15 | the bound |
| peft | ``LoraConfig(target_parameters=)`` (LoRA on the fused 3-D experts of transformers 5 MoE models) | 0.17.0 \
| :func:`peft_adapts_parameters`: a MoE model on an older peft is refused in one line |
| peft | the transformers-4 conversion keeps a listed linear layer a linear target (huggingface/peft#3945): the \
adapter of a MoE model with shared experts or dense layers (DeepSeek-V3) loads with plain \
``PeftModel.from_pretrained`` | 0.22.0 | :func:`scale.modeling.moe.load_rewrites`: a start-up warning on peft \
0.18-0.21 (training, scale-generate and scale-export are unaffected) |

(A trailing backslash continues a row.) "the bound" means ``pyproject.toml``'s lower bound already includes the
change, so no branch is needed here; the lowest-versions tier proves it.

torch: PyPI's Linux wheels are CUDA builds of several GB, so every tier runs CI's CPU wheel 2.13.0; the declared
``>=2.4`` is not exercised by a test and 2.13.0 is the whole tested range.
"""

from __future__ import annotations

import re
from importlib import metadata
from typing import Any

# distribution -> (lowest tested, newest tested). Lowest = pyproject.toml's bound (tests/test_compat.py checks they
# agree), installed by `make test-lowest`; newest = what `make test`'s .venv resolved to on 2026-12-07.
TESTED: dict[str, tuple[str, str]] = {
    "torch": ("2.13.0", "2.13.0"),  # CI's CPU wheel only (see the module docstring)
    "accelerate": ("1.13", "1.16.0"),
    "transformers": ("5.17", "5.25.0"),
    "peft": ("0.15", "0.22.0"),
    "pyyaml": ("6.0", "6.0.4"),
    "tqdm": ("4.66.3", "4.70.1"),
    "gguf": ("0.10", "0.19.0"),
    "safetensors": ("0.8", "0.8.0"),
    "datasets": ("3.0", "5.2.0"),
}


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: ``"2.13.0+cpu"`` -> ``(2, 13, 0)``, ``"5.0.0rc1"`` -> ``(5, 0, 0)``."""
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", version)
    return tuple(int(p) for p in m.group(1).split(".")) if m else ()


def in_tested_range(version: str, lowest: str, newest: str) -> bool:
    """Whether ``version`` lies in the tested range: not below ``lowest`` and no newer minor release than
    ``newest`` (a patch release of the newest tested minor counts as tested: ``5.25.1`` for ``5.25.0``).

    Trailing zeros do not count (``"1.10"`` == ``"1.10.0"``).
    """
    def pad(r: tuple[int, ...], n: int = 3) -> tuple[int, ...]:
        return r + (0,) * (n - len(r))

    v = pad(release(version))
    return v >= pad(release(lowest)) and v[:2] <= pad(release(newest))[:2]


def installed(name: str) -> str | None:
    """The installed version of distribution ``name``, or None when it is not installed."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def untested_dependencies(tested: dict[str, tuple[str, str]] | None = None) -> str | None:
    """One line naming each installed dependency outside its tested range, or None when all are inside.

    Args:
        tested: ``{distribution: (lowest, newest)}``; :data:`TESTED` by default.

    Returns:
        e.g. ``"untested dependency versions: transformers 5.16.0 (tested 5.17..5.25.0); scale-env prints the
        whole environment for a bug report"``.
    """
    outside = []
    for name, (lowest, newest) in (TESTED if tested is None else tested).items():
        version = installed(name)
        if version is not None and not in_tested_range(version, lowest, newest):
            outside.append(f"{name} {version} (tested {lowest}..{newest})")
    if not outside:
        return None
    return ("untested dependency versions: " + ", ".join(outside)
            + "; scale-env prints the whole environment for a bug report")


def peft_adapts_parameters() -> bool:
    """Whether the installed peft adapts parameters (``LoraConfig(target_parameters=)``, its ``ParamWrapper``), which
    LoRA on a mixture-of-experts model's fused experts needs (:mod:`scale.modeling.moe`)."""
    from peft import LoraConfig

    return "target_parameters" in getattr(LoraConfig, "__dataclass_fields__", {})


def enable_checkpointing(model: Any, activation_checkpointing_kwargs: dict[str, Any] | None = None,
                         every_n_layers: int = 1, offload: bool = False) -> None:
    """Turn on activation (gradient) checkpointing of a transformers model, on either API.

    transformers 5.23 added ``activation_checkpointing_enable`` and deprecated ``gradient_checkpointing_enable``
    (a FutureWarning; removal announced for v6); 5.16/5.17 gave the old name ``every_n_layers`` and ``offload``,
    the lowest version this package supports. Both make the input embeddings' output require grad, so a frozen
    base still passes gradient to LoRA (peft#137).

    Args:
        model: a ``transformers.PreTrainedModel``.
        activation_checkpointing_kwargs: passed on to ``torch.utils.checkpoint.checkpoint`` (``use_reentrant``).
        every_n_layers: checkpoint every n-th decoder layer (1: all).
        offload: keep the saved layer inputs in pinned host memory.

    Raises:
        ValueError: from transformers, when the model does not support checkpointing.
    """
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.23
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=activation_checkpointing_kwargs,
                                              every_n_layers=every_n_layers, offload=offload)
    else:  # transformers 5.17 .. 5.22
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=activation_checkpointing_kwargs,
                                            every_n_layers=every_n_layers, offload=offload)


def warn_untested(log: Any) -> str | None:
    """Log :func:`untested_dependencies`'s line as one warning on ``log`` (a ``logging.Logger`` or accelerate's
    ``MultiProcessAdapter``) when there is one; returns the line (None when every dependency is inside)."""
    line = untested_dependencies()
    if line is not None:
        log.warning(line)
    return line
