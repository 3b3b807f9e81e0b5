"""Tokenize once: the tokenized splits in a memory-mapped Arrow cache, keyed by everything that changes tokens.

    splits = load_splits(cfg, tokenizer, data_path)   # a hit memory-maps; a miss builds (one process, num_proc workers)

A cache entry is ``<data.cache_dir>/<fingerprint>/`` holding ``train.arrow`` and ``eval.arrow`` (Arrow IPC files,
one record batch per chunk of rows: ``input_ids`` (uint16/uint32) and ``trained`` (uint8 tail flags; empty: all)
as lists, per row ``length``, ``tail_len``, ``type_indicator``, ``target_token``, ``label``, ``row``), ``meta.json``
(the format and what its task found in the rows (label tokens, ...), the counts, the token fingerprint and template
hash: a hit prepares the format's task again and restores what it found, reading no row) and ``build.json``: the build
record (fingerprint inputs, host, pid, rank, seconds, rows, tokens, size and sha256 of every file).

``builds.jsonl`` beside the entries gets one line per build.

- **Fingerprint** (:func:`fingerprint`): the sha256 of each source (a file's bytes, a directory's file hashes, a
  hub id's revision), the tokenizer (serialized ``tokenizer.json``, special tokens, chat template, ids of a probe),
  the ``data.chat_template`` file, every ``data.*`` key that shapes tokens or the split (``chat_template_kwargs``,
  ``train_on``...), ``loss.threshold``, ``train.seed`` (and ``loss.objective`` under ``data.pair_conventions:
  trl``, whose tokens are the objective's TRL trainer's), the source of the modules that shape tokens
  (:data:`TOKEN_MODULES`: every stage of :mod:`scale.data` up to this one, the format modules included).
- **One builder**: the entry is built under an exclusive ``flock`` on ``<fingerprint>.lock`` (one process per
  node builds; the others wait, then memory-map; on a shared filesystem one node builds for all), in
  ``<fingerprint>.tmp`` and renamed into place; ``build.json`` is written last. An entry whose files do not match
  its build record (half-written, truncated, edited) is deleted and rebuilt, never read.
- **Memory**: :class:`TokenTable` is a sequence of :class:`scale.data.tasks.base.Example` read from the memory map on
  access; a rank holds the pages it touches (shared with the other ranks through the page cache), not the data set.

No torch.distributed, no accelerate.
"""

from __future__ import annotations

import copy
import dataclasses
import fcntl
import hashlib
import itertools
import json
import logging
import multiprocessing
import os
import shutil
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from scale.config.validation import ConfigError
from scale.data.mixing import sources_digests
from scale.data.read import DataError
from scale.data.tasks import get
from scale.data.tasks.base import Builder
from scale.data.tasks.chat_template import chat_template_path
from scale.data.token_table import LISTS, SCALARS, TEXTS, TokenTable
from scale.data.tokenize import BatchEncoded, Splits, _tokenize, build_splits, fingerprint_bytes, with_task
from scale.utils.fileio import sha256_file, temp_dir_for, write_text_atomic

logger = logging.getLogger(__name__)

CACHE_VERSION = 3  # bump when the cache layout changes (2: the trained flags; 3: meta.json holds format and found)
# data.* keys that do not change the tokens or the split: batching and the cache itself.
RUNTIME_KEYS = ("num_workers", "group_by_length", "mega_batch_steps", "padding_free", "packing", "padding_side", "cache",
                "cache_dir", "cache_max_gib", "num_proc", "path", "eval_path", "chat_template")
# the stages of scale/data/ that shape tokens (tasks/: every format module): their source is part of the fingerprint
TOKEN_MODULES = ("read.py", "sources.py", "tasks/*.py", "split.py", "mixing.py", "tokenize.py", "token_table.py",
                 "cache.py")
CHUNK_ROWS = 4096  # rows per tokenizer task and per record batch


def default_cache_dir(cfg: Any) -> Path:
    """``data.cache_dir``, else ``$SCALE_CACHE/data`` or ``~/.cache/scale/data``."""
    if cfg.data.cache_dir is not None:
        return Path(cfg.data.cache_dir).expanduser()
    return Path(os.environ.get("SCALE_CACHE", Path.home() / ".cache" / "scale")) / "data"


def tokenizer_digest(tokenizer: Any) -> str:
    """A sha256 of everything about ``tokenizer`` that changes token ids: its serialized fast tokenizer (or its
    vocabulary), special tokens, chat template and the ids it gives a probe with special tokens."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update(backend.to_str().encode() if backend is not None else
             json.dumps(tokenizer.get_vocab(), sort_keys=True).encode())
    probe = tokenizer("a b\n c", add_special_tokens=True)["input_ids"]
    h.update(json.dumps({"class": type(tokenizer).__name__, "len": len(tokenizer), "probe": list(probe),
                         "eos": tokenizer.eos_token_id, "bos": tokenizer.bos_token_id,
                         "specials": sorted(map(str, tokenizer.all_special_tokens)),
                         "chat_template": getattr(tokenizer, "chat_template", None)}, sort_keys=True).encode())
    return h.hexdigest()


def fingerprint(cfg: Any, tokenizer: Any, path: str) -> tuple[str, dict[str, Any]]:
    """The cache key of ``cfg``'s splits and what went into it (see the module docstring).

    Returns:
        ``(hex sha256, inputs)``; ``inputs`` is stored in the build record.

    Raises:
        DataError: a source that cannot be hashed (see :func:`scale.data.sources.source_digest`).
    """
    here = Path(__file__).resolve().parent
    code = hashlib.sha256(b"".join(f.read_bytes() for m in TOKEN_MODULES for f in sorted(here.glob(m))))
    template = chat_template_path(cfg.data.chat_template)  # a file, or a shipped template's name
    inputs = {
        "cache_version": CACHE_VERSION,
        "code": code.hexdigest(),
        **sources_digests(cfg.data, path),
        "tokenizer": tokenizer_digest(tokenizer),
        "chat_template": sha256_file(template) if template is not None else cfg.data.chat_template,
        "data": {k: v for k, v in dataclasses.asdict(cfg.data).items() if k not in RUNTIME_KEYS},
        "loss.threshold": cfg.loss.threshold,
        "train.seed": cfg.train.seed,
        # data.pair_conventions=trl: the tokens are the objective's TRL trainer's (DPOTrainer's or CPO/ORPO's)
        **({"loss.objective": cfg.loss.objective} if cfg.data.pair_conventions == "trl" else {}),
    }
    key = hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()
    return key, inputs


# ---- building ----

_WORK: dict[str, Any] = {}  # set before the pool forks: the rows, task, builder and loss config the workers read


def _tokenize_span(span: tuple[int, int]) -> tuple[dict[str, np.ndarray], tuple[list[int], list[tuple[int, str]]],
                                                   dict[str, int]]:
    """Tokenize rows ``[start, end)`` of ``_WORK["rows"]``; return packed columns, the dropped rows (with their
    lengths and what dropped them) and the builder's notes (counts the format reports once)."""
    rows, builder, task = _WORK["rows"][span[0]:span[1]], copy.copy(_WORK["builder"]), _WORK["task"]
    builder.dropped, builder.drop_info, builder.notes = [], [], {}
    texts = [t for r in rows for t in task.texts(r, builder.cfg)]  # what the format's encode() will encode
    builder.tokenizer = BatchEncoded(_WORK["builder"].tokenizer, texts)
    examples = _tokenize(rows, task, builder, _WORK["loss"])
    lengths = np.fromiter((len(e.input_ids) for e in examples), dtype=np.int32, count=len(examples))
    values = np.fromiter(itertools.chain.from_iterable(e.input_ids for e in examples), dtype=_WORK["dtype"],
                         count=int(lengths.sum()))
    cols = {"values": values, "length": lengths}
    for name, attr, dtype in (("tail_len", "tail_len", np.int32), ("type_indicator", "type_indicator", np.int64),
                              ("target_token", "target_token", np.int64), ("label", "label", np.int32),
                              ("row", "row", np.int64)):
        cols[name] = np.fromiter((getattr(e, attr) for e in examples), dtype=dtype, count=len(examples))
    flags = [e.trained or [] for e in examples]  # None -> [] (a tail is never empty)
    cols["trained_length"] = np.fromiter(map(len, flags), dtype=np.int32, count=len(examples))
    cols["trained"] = np.fromiter(itertools.chain.from_iterable(flags), dtype=np.uint8,
                                  count=int(cols["trained_length"].sum()))
    cols["extra"] = [e.extra or "" for e in examples]  # text columns: a Python list (pa.array reads it as is)
    cols["fingerprint"] = b"".join(map(fingerprint_bytes, examples))  # hashed in row order by the writer
    return cols, (builder.dropped, builder.drop_info), builder.notes


def _arrow(a: np.ndarray) -> pa.Array:
    """A 1-D numpy array as an Arrow array, zero-copy (``pa.array(ndarray)`` would import pandas: seconds)."""
    a = np.ascontiguousarray(a)
    return pa.Array.from_buffers(pa.from_numpy_dtype(a.dtype), len(a), [None, pa.py_buffer(a)])


def _list_array(lengths: np.ndarray, values: np.ndarray) -> pa.ListArray:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.ListArray.from_arrays(_arrow(offsets), _arrow(values))


def _record_batch(cols: dict[str, np.ndarray]) -> pa.RecordBatch:
    ids = _list_array(cols["length"], cols["values"])
    lists = [_list_array(cols[f"{c}_length"], cols[c]) for c in LISTS]
    texts = [pa.array(list(cols[c]), type=pa.large_string()) for c in TEXTS]
    return pa.RecordBatch.from_arrays([ids, *(_arrow(cols[c]) for c in SCALARS), *lists, *texts],
                                      ["input_ids", *SCALARS, *LISTS, *TEXTS])


def write_table(path: Path, rows: list[dict[str, Any]], task: Any, builder: Builder, loss_cfg: Any, num_proc: int,
                dtype: Any, progress: Path | None = None, digest: Any = None) -> dict[str, int]:
    """Tokenize ``rows`` in chunks (``num_proc`` forked workers, batched encoding) and stream them to ``path``;
    after each chunk, ``progress`` (a JSON file) says how many rows are done (what waiting ranks log), and
    ``digest`` (a ``hashlib`` object) is updated with the chunk's :func:`scale.data.tokenize.fingerprint_bytes`.

    Returns:
        ``{"rows": written, "tokens": total}``.

    Raises:
        DataError: the first bad row in row order, as :func:`scale.data.tokenize.tokenize_rows` would raise it.
    """
    _WORK.update(rows=rows, task=task, builder=builder, loss=loss_cfg, dtype=dtype)
    spans = [(s, min(s + CHUNK_ROWS, len(rows))) for s in range(0, len(rows), CHUNK_ROWS)]
    schema = _record_batch({"values": np.zeros(0, dtype), "length": np.zeros(0, np.int32),
                            **{c: np.zeros(0, np.int64) for c in SCALARS if c != "length"},
                            **{c: np.zeros(0, np.uint8) for c in LISTS}, **{f"{c}_length": np.zeros(0, np.int32)
                                                                           for c in LISTS},
                            **{c: [] for c in TEXTS}}).schema
    written = tokens = done = 0
    pool = multiprocessing.get_context("fork").Pool(num_proc) if num_proc > 1 and len(spans) > 1 else None
    try:
        results: Iterator = pool.imap(_tokenize_span, spans) if pool is not None else map(_tokenize_span, spans)
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
            for cols, (dropped, drop_info), notes in results:
                builder.dropped.extend(dropped)
                builder.drop_info.extend(drop_info)
                for note, n in notes.items():
                    builder.notes[note] = builder.notes.get(note, 0) + n
                if digest is not None:
                    digest.update(cols["fingerprint"])
                if len(cols["length"]):
                    batch = _record_batch(cols)
                    writer.write_batch(batch.cast(schema) if batch.schema != schema else batch)
                written += len(cols["length"])
                tokens += int(cols["length"].sum())
                done += CHUNK_ROWS
                if progress is not None:
                    write_text_atomic(progress, json.dumps({"split": path.stem, "rows_done": min(done, len(rows)),
                                                            "rows_total": len(rows), "pid": os.getpid()}))
    finally:
        if pool is not None:
            pool.terminate()
        _WORK.clear()
    return {"rows": written, "tokens": tokens}


def _build(final: Path, cfg: Any, tokenizer: Any, path: str, key: str, inputs: dict[str, Any]) -> None:
    start = time.perf_counter()
    tmp = temp_dir_for(final)  # debris of an interrupted build goes
    num_proc = cfg.data.num_proc or len(os.sched_getaffinity(0))
    dtype = np.uint16 if len(tokenizer) <= np.iinfo(np.uint16).max + 1 else np.uint32
    counts: dict[str, dict[str, int]] = {}
    digest = hashlib.sha256()  # the token fingerprint, train then eval, as build_splits would compute it

    def tokenize(name: str, rows: list[dict[str, Any]], task: Any, builder: Builder) -> TokenTable:
        counts[name] = write_table(tmp / f"{name}.arrow", rows, task, builder, cfg.loss, num_proc, dtype,
                                   progress=_marker(final, "progress"), digest=digest)
        return TokenTable(tmp / f"{name}.arrow")

    try:
        splits = build_splits(cfg.data, cfg.loss, tokenizer, path, cfg.train.seed, tokenize=tokenize,
                              fingerprint_of=lambda train, held: digest.hexdigest(), check_objective=True)
        # The format and what its task found, and every Splits field but the examples, so a hit reads the token
        # fingerprint (rows_sha256 of the resume check) and the template hash from here, without reading a token.
        kept = [f.name for f in dataclasses.fields(Splits) if f.name not in ("train", "eval")]
        meta = {"format": splits.format, "found": splits.task.found, **{k: getattr(splits, k) for k in kept}}
        write_text_atomic(tmp / "meta.json", json.dumps(meta))
        del splits  # unmap before the rename
        files = {f.name: {"bytes": f.stat().st_size, "sha256": sha256_file(f)} for f in sorted(tmp.iterdir())}
        record = {"fingerprint": key, "host": socket.gethostname(), "pid": os.getpid(),
                  "rank": int(os.environ.get("RANK", "0")), "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
                  "built_at": time.time(), "seconds": round(time.perf_counter() - start, 3), "num_proc": num_proc,
                  "splits": counts, "files": files, "inputs": inputs}
        write_text_atomic(tmp / "build.json", json.dumps(record, indent=1, default=str))  # the completion marker
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        _marker(final, "progress").unlink(missing_ok=True)
    with open(final.parent / "builds.jsonl", "a", encoding="utf-8") as fh:
        fh.write(json.dumps({k: record[k] for k in ("fingerprint", "host", "pid", "rank", "local_rank", "built_at",
                                                     "seconds", "num_proc", "splits")}) + "\n")
    logger.info("data cache: built %s in %.1f s with %d process(es): train %d rows, eval %d rows, %d tokens",
                final, record["seconds"], num_proc, counts["train"]["rows"], counts["eval"]["rows"],
                counts["train"]["tokens"] + counts["eval"]["tokens"])


def check_entry(final: Path) -> str | None:
    """Why the entry ``final`` cannot be read (no build record, a file missing, of another size or sha256), or
    ``None`` when every file matches its build record."""
    try:
        record = json.loads((final / "build.json").read_text(encoding="utf-8"))
        files = record["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"no readable build record ({type(e).__name__})"
    for name in ("train.arrow", "eval.arrow", "meta.json"):
        if name not in files:
            return f"the build record lists no {name}"
    for name, want in files.items():
        f = final / name
        if not f.is_file() or f.stat().st_size != want["bytes"]:
            return f"{name} is missing or has another size than its build record says"
        if sha256_file(f) != want["sha256"]:
            return f"{name} differs from its build record (sha256)"
    return None


@contextmanager
def _locked(lock: Path) -> Iterator[None]:
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # blocks while another process builds this entry
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def open_entry(final: Path, cfg: Any, tokenizer: Any) -> Splits:
    """The splits of a complete entry, memory-mapped, with their format's task prepared for ``cfg`` and
    ``tokenizer`` and what it found in the rows restored from ``meta.json`` (no row is read).

    Raises:
        DataError: the format's task cannot be prepared (as the build that wrote the entry could).
    """
    meta = json.loads((final / "meta.json").read_text(encoding="utf-8"))
    os.utime(final / "meta.json")  # last use, for pruning
    task = get(meta.pop("format"))
    task.prepare(tokenizer, cfg.data, cfg.loss)
    task.restore(meta.pop("found"))
    return Splits(train=with_task(TokenTable(final / "train.arrow"), task),
                  eval=with_task(TokenTable(final / "eval.arrow"), task), **meta)


def _marker(final: Path, kind: str) -> Path:
    """``<entry>.progress`` (rows done by the builder) or ``<entry>.failed`` (its error, for the waiting ranks)."""
    return final.with_name(f"{final.name}.{kind}")


def load_splits(cfg: Any, tokenizer: Any, path: str, run_id: str | None = None) -> Splits:
    """The tokenized splits of ``cfg``: memory-mapped from the cache, built there first when missing or corrupt.
    With ``data.cache=false``, :func:`scale.data.tokenize.build_splits` in memory.

    Args:
        run_id: the job's id, on the process the node's other ranks wait for (:func:`wait_for_splits`): an error
            is then written to ``<entry>.failed`` with it, so that they raise it too instead of waiting.

    Raises:
        DataError, ConfigError: see :func:`scale.data.tokenize.build_splits`; nothing is left in the cache then.
    """
    if not cfg.data.cache:
        return build_splits(cfg.data, cfg.loss, tokenizer, path, cfg.train.seed, check_objective=True)
    key, inputs = fingerprint(cfg, tokenizer, path)
    final = default_cache_dir(cfg) / key[:32]
    try:
        splits = _load_or_build(cfg, tokenizer, path, key, inputs, final)
    except Exception as e:
        if run_id is not None:
            write_text_atomic(_marker(final, "failed"), json.dumps({"run_id": run_id, "type": type(e).__name__,
                                                                    "message": str(e)}))
        raise
    _marker(final, "failed").unlink(missing_ok=True)  # an earlier run's
    return splits


def _load_or_build(cfg: Any, tokenizer: Any, path: str, key: str, inputs: dict[str, Any], final: Path) -> Splits:
    root = final.parent
    with _locked(root / f"{key[:32]}.lock"):
        if final.exists():
            why = check_entry(final)
            if why is None:
                logger.info("data cache: hit %s", final)
                return open_entry(final, cfg, tokenizer)
            logger.warning("data cache %s is incomplete or corrupt (%s): rebuilding it", final, why)
            shutil.rmtree(final)
        _build(final, cfg, tokenizer, path, key, inputs)
        prune(root, cfg.data.cache_max_gib, keep=final)
        return open_entry(final, cfg, tokenizer)


def wait_for_splits(cfg: Any, tokenizer: Any, path: str, run_id: str, poll_s: float = 2.0,
                    log_every_s: float = 60.0, give_up_s: float | None = None) -> Splits:
    """The splits the node's building process (:func:`load_splits` with the same ``run_id``) finds or builds,
    memory-mapped once complete: polls for the entry's build record, not a collective, so a build of any length
    is waited for (a collective is bounded by ``train.collective_timeout_s``); every ``poll_s`` seconds, the first
    looks sooner (0.05 s, doubling). Logs what it waits for, then
    every ``log_every_s`` seconds the builder's progress (rows done of the split it tokenizes). ``give_up_s``:
    raise TimeoutError after that many seconds (``None``, the job's: never; a dead builder ends the launch).

    Raises:
        DataError, ConfigError: the builder's error (``<entry>.failed`` with this ``run_id``), with its message;
            another type of error as a RuntimeError naming it.
    """
    if not cfg.data.cache:
        return build_splits(cfg.data, cfg.loss, tokenizer, path, cfg.train.seed, check_objective=True)
    key, _ = fingerprint(cfg, tokenizer, path)
    final = default_cache_dir(cfg) / key[:32]
    start, last, polls = time.monotonic(), None, 0
    rank = os.environ.get("RANK", "?")
    while True:
        if (final / "build.json").is_file():
            with _locked(final.with_name(f"{key[:32]}.lock")):  # the builder holds it until the entry is whole
                if check_entry(final) is None:
                    if time.monotonic() - start > poll_s:
                        logger.info("data cache: rank %s waited %.0f s; mapping %s", rank, time.monotonic() - start,
                                    final)
                    return open_entry(final, cfg, tokenizer)
        failed = _failure(final, run_id)
        if failed is not None:
            raised = {"DataError": DataError, "ConfigError": ConfigError}.get(failed["type"])  # bad data or config
            if raised is not None:
                raise raised(failed["message"])
            raise RuntimeError(f"building the data cache failed on the node's main process: {failed['type']}: "
                               f"{failed['message']}")
        now = time.monotonic()
        if give_up_s is not None and now - start > give_up_s:
            raise TimeoutError(f"no complete data cache entry {final} after {give_up_s} s")
        if last is None or now - last >= log_every_s:
            last = now
            logger.info("data cache: rank %s waits for the node's main process to tokenize into %s (%.0f s so far%s;"
                        " polling the build record, no collective timeout applies)", rank, final, now - start,
                        _progress_text(final))
        time.sleep(min(poll_s, 0.05 * 2 ** polls))  # a quick first look: a small build or a hit is done in ~1 s
        polls += 1


def _failure(final: Path, run_id: str) -> dict[str, str] | None:
    try:
        failed = json.loads(_marker(final, "failed").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return failed if isinstance(failed, dict) and failed.get("run_id") == run_id else None


def _progress_text(final: Path) -> str:
    try:
        p = json.loads(_marker(final, "progress").read_text(encoding="utf-8"))
        return f"; {p['split']}: {p['rows_done']:,} of {p['rows_total']:,} rows tokenized"
    except (OSError, ValueError, KeyError, TypeError):
        return ""


def prune(root: Path, max_gib: float, keep: Path) -> list[Path]:
    """Delete the least recently used entries of ``root`` until it holds at most ``max_gib`` GiB (``keep``
    stays). A process that has an entry mapped keeps reading it (POSIX unlink semantics)."""
    entries = []
    for d in root.iterdir():
        if d.is_dir() and (d / "build.json").is_file() and d != keep:
            size = sum(f.stat().st_size for f in d.iterdir() if f.is_file())
            used = (d / "meta.json").stat().st_mtime if (d / "meta.json").exists() else 0.0
            entries.append((used, size, d))
    total = sum(size for _, size, _ in entries) + sum(f.stat().st_size for f in keep.iterdir())
    removed = []
    for _, size, d in sorted(entries):
        if total <= max_gib * 2**30:
            break
        shutil.rmtree(d, ignore_errors=True)
        total -= size
        removed.append(d)
    if removed:
        logger.info("data cache: removed %d least recently used entries (data.cache_max_gib=%s)", len(removed),
                    max_gib)
    return removed
