"""Atomic file writes and file hashes. No torch.

Every file or directory the harness writes that a later run reads (the config, metrics, checkpoints, the
adapter, prepared assets) goes through here: it is written under a temporary name and renamed with one
``os.replace``, so a crash leaves either the old version or the new one, never half of either.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` through ``<path>.tmp`` and one rename."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def temp_dir_for(final: str | Path) -> Path:
    """An empty ``<final>.tmp`` directory to build ``final`` in (debris of an interrupted build is removed)."""
    tmp = Path(final).with_name(Path(final).name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def replace_dir(tmp: str | Path, final: str | Path) -> None:
    """Put the finished directory ``tmp`` at ``final``, replacing what was there.

    A directory cannot be renamed over a non-empty one, so the old one first moves aside to ``<final>.old``
    (a crash between the two renames leaves it there, complete) and is deleted after the swap.
    """
    final = Path(final)
    old = final.with_name(final.name + ".old")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
