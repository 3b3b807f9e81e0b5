"""Read an offline W&B run's ``run-<id>.wandb`` file back (wandb 0.31 ships no Python reader for it).

The file is wandb's LevelDB-style record log: a 7-byte header (``:W&B``, version), 32 KiB blocks, each record
chunk with a 7-byte header (crc32, length, type FULL=1/FIRST=2/MIDDLE=3/LAST=4), each whole record a
``wandb_internal_pb2.Record`` (the format ``wandb sync`` uploads). A run killed mid-write may end in a partial
record: reading stops there.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from wandb.proto import wandb_internal_pb2 as pb

BLOCK, HEADER = 32768, 7


def records(path: str | Path):
    """Yield the ``Record`` protobufs of one ``.wandb`` file, in order."""
    buf = Path(path).read_bytes()
    pos, parts = HEADER, b""
    while pos + HEADER <= len(buf):
        if BLOCK - pos % BLOCK < HEADER:  # the block's tail is padding
            pos += BLOCK - pos % BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", buf[pos:pos + HEADER])
        if pos + HEADER + length > len(buf):
            return  # a partial record at the end of a killed run
        data = buf[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind == 0 and length == 0:
            continue
        parts = data if kind in (1, 2) else parts + data
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(parts)
            yield rec


def read_run(run_dir: str | Path) -> dict:
    """``{"id", "history": {step: {key: value}}, "artifacts": [names], "artifact_files": [(name, aliases, [paths])],
    "summary": {key: value}}`` of one
    ``offline-run-*`` directory (history rows of one step merged, as W&B shows them)."""
    out = {"id": None, "history": {}, "artifacts": [], "artifact_files": [], "summary": {}}
    for path in Path(run_dir).glob("*.wandb"):
        for rec in records(path):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                out["id"] = rec.run.run_id
            elif kind == "history":
                row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
                step = int(row.pop("_step"))
                if step in out["history"] and set(row) & set(out["history"][step]) - {"_runtime", "_timestamp"}:
                    raise AssertionError(f"step {step} logged twice in {run_dir}")
                out["history"].setdefault(step, {}).update(row)
            elif kind == "artifact":
                out["artifacts"].append(rec.artifact.name)
                out["artifact_files"].append((rec.artifact.name, list(rec.artifact.aliases),
                                              sorted(e.path for e in rec.artifact.manifest.contents)))
            elif kind == "summary":
                for i in rec.summary.update:
                    out["summary"][i.key or "/".join(i.nested_key)] = json.loads(i.value_json)
    return out
