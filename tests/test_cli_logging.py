"""Third-party warnings once per run (on rank 0), DeepSpeed's logger quiet in runs without DeepSpeed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

SCRIPT = r"""
import logging, os, sys, warnings
from scale.cli import configure_logging
configure_logging(dict(os.environ), uses_deepspeed=sys.argv[1] == "ds")
logging.getLogger("bitsandbytes.backends.cpu.ops").warning("BNB-NOTICE")
logging.getLogger("DeepSpeed").warning("DS-CHATTER")
logging.getLogger("transformers.modeling_utils").error("TF-ERROR")
logging.getLogger("scale.train").warning("OURS")
warnings.warn("LIB-WARNING", UserWarning)
"""


def _stderr(rank: str, deepspeed: bool) -> str:
    env = {**os.environ, "RANK": rank}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, "ds" if deepspeed else "no"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stderr


@pytest.mark.parametrize("rank, deepspeed, shown", [
    ("0", False, {"BNB-NOTICE", "TF-ERROR", "OURS", "LIB-WARNING"}),
    ("0", True, {"BNB-NOTICE", "DS-CHATTER", "TF-ERROR", "OURS", "LIB-WARNING"}),
    ("1", False, {"TF-ERROR", "OURS"}),
    ("1", True, {"TF-ERROR", "OURS"}),
])
def test_third_party_warnings_on_rank_0_only(rank, deepspeed, shown):
    err = _stderr(rank, deepspeed)
    every = {"BNB-NOTICE", "DS-CHATTER", "TF-ERROR", "OURS", "LIB-WARNING"}
    assert {m for m in every if m in err} == shown, err
