"""Old name of :mod:`scale.mixed_paths` (the paths were CPU-only before they ran on CUDA too); kept so that code
importing ``scale.cpu_bf16`` keeps working."""

from __future__ import annotations

from scale.mixed_paths import (  # noqa: F401
                               ATTENTION_FP32_BELOW,
                               CPU_PATHS,
                               MIXED_PATHS,
                               MIXED_SDPA,
                               cache_head_cast,
                               cast_adapter_inputs_once,
                               dequantize_in_compute_dtype,
                               fuse_adapter_sum,
                               mixed_sdpa,
                               use_mixed_paths,
                               use_mixed_sdpa,
)

CPU_MIXED_PATHS = MIXED_PATHS
"""Old name of :data:`scale.mixed_paths.MIXED_PATHS`."""

use_cpu_mixed_paths = use_mixed_paths
"""Old name of :func:`scale.mixed_paths.use_mixed_paths`."""
