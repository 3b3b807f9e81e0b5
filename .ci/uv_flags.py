"""Print pip's package sources as ``uv pip install`` flags: uv reads neither pip.conf nor ``PIP_*`` variables.

    uv pip install $(python .ci/uv_flags.py) ...

Reads ``pip config list`` (every pip.conf and ``PIP_*`` variable pip itself would use) and turns ``index-url``,
``extra-index-url``, ``find-links`` and ``constraint`` into the flags of the same names, so that uv sees the
indexes and local wheels pip sees (on the CI machine: the CPU torch wheel in a find-links directory). Any other
pip setting is ignored. Prints nothing when pip has none of these settings.
"""

from __future__ import annotations

import ast
import shlex
import subprocess
import sys

KEYS = ("index-url", "extra-index-url", "find-links", "constraint")


def pip_settings() -> dict[str, list[str]]:
    """``{key: [values]}`` from ``pip config list`` lines such as ``global.find-links='/opt/wheels'``."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                         check=False).stdout
    found: dict[str, list[str]] = {}
    for line in out.splitlines():
        name, sep, value = line.partition("=")
        key = name.rpartition(".")[2]
        if not sep or key not in KEYS:
            continue
        for item in ast.literal_eval(value).split():
            if item not in found.setdefault(key, []):
                found[key].append(item)
    return found


def main() -> None:
    flags = []
    for key, values in pip_settings().items():
        if key == "index-url":
            values = values[-1:]  # one default index, as in pip
        flags += [f"--{key}={v}" for v in values]
    print(shlex.join(flags))


if __name__ == "__main__":
    main()
