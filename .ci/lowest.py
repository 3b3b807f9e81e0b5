"""Print the lowest declared version of each direct dependency as a ``name==version`` pin, one a line.

    python .ci/lowest.py > lowest.txt && uv pip install -c lowest.txt -e '.[test]'

Reads ``[project].dependencies`` of ``pyproject.toml`` and pins each ``name>=bound`` to ``name==bound``, so that
the lowest-versions test tier (``make test-lowest``) installs exactly the bounds the package declares: a bound that
cannot be installed (another dependency needs more) or fails the unit tests is a bound to raise. torch is left out:
PyPI's Linux torch wheels of old versions are multi-GB CUDA builds, so that tier keeps CI's CPU wheel (the
Makefile's ``TORCH``). uv's ``--resolution lowest-direct`` would instead move a conflicting bound up silently.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

SKIP = {"torch"}  # CI's CPU wheel, installed first (Makefile TORCH)


def dependencies(pyproject: Path) -> list[str]:
    """``[project].dependencies`` of ``pyproject.toml`` (tomllib from Python 3.11; on 3.10 the array's quoted items)."""
    text = pyproject.read_text()
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        block = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M).group(1)
        return re.findall(r'^\s*"([^"]+)"', block, re.M)
    return tomllib.loads(text)["project"]["dependencies"]


def lowest_pins(pyproject: Path) -> list[str]:
    """``["accelerate==1.10", ...]``: each ``[project].dependencies`` entry's ``>=`` bound as an ``==`` pin.

    Raises:
        ValueError: a dependency other than torch declares no ``>=`` lower bound.
    """
    pins = []
    for dep in dependencies(pyproject):
        m = re.fullmatch(r"\s*([A-Za-z0-9_.\-]+)(\[[^\]]*\])?\s*>=\s*([0-9][^,;\s]*)\s*(,.*)?", dep)
        if m is None:
            raise ValueError(f"{dep!r} has no '>=' lower bound to test")
        if m.group(1).lower() not in SKIP:
            pins.append(f"{m.group(1)}=={m.group(3)}")
    return pins


if __name__ == "__main__":
    print("\n".join(lowest_pins(Path(sys.argv[1] if len(sys.argv) > 1 else "pyproject.toml"))))
