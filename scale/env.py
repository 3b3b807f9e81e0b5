"""``scale-env``: the environment as one Markdown block to paste into a bug report.

As ``accelerate env`` and ``transformers env`` do for theirs: the version of every dependency and whether it lies in
the range the tests passed on (:data:`scale.utils.compat.TESTED`), Python and the platform, CUDA and the driver, each
GPU's name and memory, the CPU's model and the instruction-set flags the numerics depend on (AVX2, AVX-512,
AVX512-BF16, AMX, read from ``/proc/cpuinfo``), bf16 support, and the launcher's variables (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``ACCELERATE_*``, ``SLURM_*``, ...). Nothing is written; exit code 0.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

from scale.utils.compat import TESTED, in_tested_range, installed

# Optional extras: reported with their version, no tested range of their own (pyproject's extras name the floor).
OPTIONAL = ("bitsandbytes", "deepspeed", "wandb", "matplotlib", "lm_eval", "trl", "liger-kernel", "flash-attn",
            "huggingface-hub", "tokenizers", "numpy", "triton")
# The /proc/cpuinfo flags that decide which kernels torch/oneDNN run (and so the last bits of an fp32 sum).
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")
# Environment variables a launcher (torchrun, accelerate, deepspeed, SLURM) sets or reads.
LAUNCHER_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR",
                  "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "TORCHELASTIC_RUN_ID")
LAUNCHER_PREFIXES = ("ACCELERATE_", "SLURM_", "PMI_", "OMPI_COMM_WORLD_", "NCCL_", "TORCH_DISTRIBUTED_", "DS_")


def cpu_info(cpuinfo: str | None = None) -> tuple[str, dict[str, bool]]:
    """The CPU's model name and which of :data:`CPU_FLAGS` it has.

    Args:
        cpuinfo: the text of ``/proc/cpuinfo``; read from the file when None (an empty text where there is none,
            e.g. macOS: then the model is ``platform.processor()`` and every flag False).

    Returns:
        ``("AMD EPYC 9454 48-Core Processor", {"avx2": True, ...})``.
    """
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text() if path.exists() else ""
    model, flags = None, None
    for line in cpuinfo.splitlines():  # the first processor's lines
        key, _, value = line.partition(":")
        if key.strip() == "model name" and model is None:
            model = value.strip()
        elif key.strip() == "flags" and flags is None:
            flags = set(value.split())
    model, flags = model or platform.processor() or "unknown", flags or set()
    return model, {f: f in flags for f in CPU_FLAGS}


def launcher_variables(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The launcher variables that are set: :data:`LAUNCHER_NAMES` and every name under :data:`LAUNCHER_PREFIXES`,
    sorted by name. Secrets do not appear: no prefix matches a token or key variable."""
    env = os.environ if environ is None else environ
    return {k: env[k] for k in sorted(env) if k in LAUNCHER_NAMES or k.startswith(LAUNCHER_PREFIXES)}


def driver_version() -> str:
    """The NVIDIA driver version from ``nvidia-smi``, or ``"none"`` where there is no such tool or GPU."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return "none"
    return out.splitlines()[0].strip() if out.strip() else "none"


def report() -> str:
    """The environment as one Markdown block: bullet lists under ``## scale-env`` and three ``###`` headings."""
    import torch

    lines = ["## scale-env", "", f"- scale: {installed('scale') or 'not installed (source tree)'}",
             f"- Python: {sys.version.split()[0]} ({platform.python_implementation()})",
             f"- platform: {platform.platform()}", "", "### dependencies (tested range: make test-lowest .. make test)"]
    for name, (lowest, newest) in TESTED.items():
        version = installed(name)
        where = ("not installed" if version is None
                 else "inside" if in_tested_range(version, lowest, newest) else "OUTSIDE")
        lines.append(f"- {name}: {version or '-'} ({where} the tested range {lowest}..{newest})")
    optional = ", ".join(f"{n} {installed(n)}" for n in OPTIONAL if installed(n))
    lines.append(f"- optional: {optional or 'none installed'}")
    lines += ["", "### devices"]
    cuda = torch.cuda.is_available()
    lines.append(f"- torch CUDA build: {torch.version.cuda or 'none (CPU build)'}; available: {cuda}; "
                 f"driver: {driver_version()}")
    if cuda:
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            lines.append(f"- GPU {i}: {p.name}, {p.total_memory / 2**30:.1f} GiB, compute capability "
                         f"{p.major}.{p.minor}")
    model, flags = cpu_info()
    lines.append(f"- CPU: {model}; {os.cpu_count()} logical cores; flags: "
                 + " ".join(f"{f}={'yes' if on else 'no'}" for f, on in flags.items()))
    native_cpu_bf16 = flags["avx512_bf16"] or flags["amx_bf16"]
    lines.append(f"- bf16: GPU {'yes' if cuda and torch.cuda.is_bf16_supported() else 'no'}; CPU "
                 f"{'native (AVX512-BF16/AMX)' if native_cpu_bf16 else 'emulated (no AVX512-BF16/AMX)'}; "
                 f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}")
    lines += ["", "### launcher variables"]
    found = launcher_variables()
    lines += [f"- {k}={v}" for k, v in found.items()] or ["- none set"]
    return "\n".join(lines)


def main() -> None:
    """Write :func:`report` to stdout (the ``scale-env`` console script), as ``scale-plan`` writes its plan."""
    sys.stdout.write(report() + "\n")


if __name__ == "__main__":
    main()
