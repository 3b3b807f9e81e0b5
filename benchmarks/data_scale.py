"""Data at scale: today's in-memory tokenization against the memory-mapped token cache (issue 18).

    python benchmarks/data_scale.py --rows 100000          # develop (~1 min on 2 cores)
    python benchmarks/data_scale.py                        # 1M rows (~3 GB of scratch in --work; several minutes)

Generates (never commits) a prompt/completion ``.jsonl`` of ``--rows`` synthetic rows (~93 tokens each with the
SmolLM2 tokenizer) under ``--work``, then measures, each in a fresh process:

- **today**: ``scale.data.build_splits`` (what every rank ran at every start before the cache) on the first
  ``--today-rows`` rows, single process; wall time, tokens/s and the anonymous memory it keeps per token,
  scaled to ``--rows``;
- **cold**: ``scale-prepare``'s work (one process, ``data.num_proc`` tokenizer workers) into an empty cache;
- **warm**: a 2-rank start (``torchrun``, gloo, the job's own data start: the node's main process looks the entry
  up, the other rank polls its build record, then ``make_loaders``), as a resume or requeue starts: both ranks
  memory-map the cache, and ``builds.jsonl`` shows nobody tokenized.

Per rank: seconds until the splits are there, anonymous (private) memory added by the data and the loaders
after 200 batches, and file-backed pages mapped (shared by the ranks through the page cache). The cache's
``builds.jsonl`` shows how many processes tokenized. Then the line
``data_scale: rows=N cold_s=X warm_s=Y rss_mib_per_rank=Z tokens_per_s=T speedup=S`` (wall clock), and, since the
machine may be shared, ``data_scale_cpu: ...``: tokens per CPU second (user + system, the build's tokenizer workers
included) of both paths, which do not depend on the load, the wall time they imply on ``--num-proc`` idle cores
(today's path is one thread; the build's parent work counted as if it never overlapped the workers) and the
1-minute load average at the start and the end.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORDS = [w for w in ("the of and to in is was for on that with as by at from his her an were are which this be "
                     "has had one their its new after who they have not but two first also been all more year "
                     "time other when people into over city world some state than only school most where made "
                     "during later three years many such house music film team game season against work under "
                     "while part both called between government war album known until party before since "
                     "number river series early company through university back second each four national "
                     "around however released name life because high several group would well history church "
                     "station being played public found north local area family south same village line").split()]


def rss() -> dict[str, int]:
    """This process's resident memory in bytes: ``anon`` (private), ``file`` (mapped files), ``total``."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            fields[key] = int(value.split()[0]) * 1024
    return {"anon": fields["RssAnon"], "file": fields["RssFile"], "total": fields["VmRSS"]}


def cpu_seconds(who: int) -> float:
    """User + system CPU seconds of this process (``resource.RUSAGE_SELF``) or its reaped children (the build's
    tokenizer workers, ``RUSAGE_CHILDREN``)."""
    import resource

    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def generate(path: Path, rows: int, seed: int = 0) -> None:
    """``rows`` prompt/completion rows of random common words (~60 + ~25 words), written through a temp name."""
    rng = random.Random(seed)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        for i in range(rows):
            prompt = f"Question {i}: " + " ".join(rng.choices(WORDS, k=rng.randint(40, 80))) + "?"
            completion = " " + " ".join(rng.choices(WORDS, k=rng.randint(15, 35))) + "."
            fh.write(json.dumps({"prompt": prompt, "completion": completion}) + "\n")
    os.replace(tmp, path)


def config(data: Path, cache: Path, num_proc: int, extra: list[str] = ()) -> object:
    from scale.config.load import load_config

    return load_config(ROOT / "configs" / "train" / "tiny_cpu.yaml",
                       [f"data.path={data}", f"data.cache_dir={cache}", f"data.num_proc={num_proc}",
                        "data.eval_size=400", "data.max_length=256", "output_dir=/tmp/scale_data_scale_unused",
                        *extra])


def today(data: Path) -> dict[str, float]:
    """Worker: today's path (every rank, every start) on ``data``, single process."""
    from scale.data import build_splits
    from scale.modeling.build import load_tokenizer
    from scale.utils.assets import resolve_data

    cfg = config(data, Path("/nonexistent"), 1, ["data.cache=false"])
    tok = load_tokenizer(cfg.model)
    before = rss()
    start, cpu = time.perf_counter(), cpu_seconds(0)
    splits = build_splits(cfg.data, cfg.loss, tok, resolve_data(str(data)), cfg.train.seed)
    seconds, cpu = time.perf_counter() - start, cpu_seconds(0) - cpu
    tokens = sum(len(e.input_ids) for part in (splits.train, splits.eval) for e in part)
    after = rss()
    return {"seconds": seconds, "tokens": tokens, "rows": len(splits.train) + len(splits.eval),
            "anon_bytes": after["anon"] - before["anon"], "cpu_s": cpu}


def prepare(data: Path, cache: Path, num_proc: int) -> dict[str, float]:
    """Worker: what ``scale-prepare`` does (one process, ``num_proc`` tokenizer workers), timed."""
    import resource

    from scale.data.cache import load_splits
    from scale.data.token_table import column
    from scale.modeling.build import load_tokenizer

    cfg = config(data, cache, num_proc)
    tok = load_tokenizer(cfg.model)
    start, parent, workers = time.perf_counter(), cpu_seconds(resource.RUSAGE_SELF), \
        cpu_seconds(resource.RUSAGE_CHILDREN)
    splits = load_splits(cfg, tok, str(data))
    seconds = time.perf_counter() - start
    parent = cpu_seconds(resource.RUSAGE_SELF) - parent
    workers = cpu_seconds(resource.RUSAGE_CHILDREN) - workers
    tokens = int(column(splits.train, "length").sum() + column(splits.eval, "length").sum())
    return {"seconds": seconds, "tokens": tokens, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "parent_cpu_s": parent, "workers_cpu_s": workers}


def rank_probe(data: Path, cache: Path, num_proc: int) -> None:
    """Worker under torchrun: the job's data start on each rank; prints one JSON line per rank."""
    import torch
    from accelerate import Accelerator

    from scale.data.cache import load_splits, wait_for_splits
    from scale.data.token_table import column
    from scale.distributed.collective import on_every_rank, shared_run_id
    from scale.modeling.build import load_tokenizer
    from scale.training.parts.loaders import make_loaders

    t0 = time.perf_counter()
    torch.set_num_threads(1)
    acc = Accelerator(cpu=True)
    cfg = config(data, cache, num_proc)
    tok = load_tokenizer(cfg.model)
    before = rss()
    start = time.perf_counter()
    run_id = shared_run_id(acc)
    # as scale.training.job.setup: the node's main process finds (or builds) the entry, the other rank polls its build
    # record
    splits = on_every_rank(acc, lambda: load_splits(cfg, tok, str(data), run_id) if acc.is_local_main_process
                           else wait_for_splits(cfg, tok, str(data), run_id))
    data_s = time.perf_counter() - start
    train_dl, _ = make_loaders(cfg, splits, tok.pad_token_id, acc.num_processes)
    train_dl = acc.prepare(train_dl)
    it = iter(train_dl)
    first = next(it)
    first_s = time.perf_counter() - t0
    for _, _ in zip(range(199), it):
        pass
    after = rss()
    tokens = int(column(splits.train, "length").sum() + column(splits.eval, "length").sum())
    acc.wait_for_everyone()
    sys.stdout.write("RANK " + json.dumps({"rank": acc.process_index, "data_s": data_s, "start_to_first_batch_s": first_s,
                                "anon_bytes": after["anon"] - before["anon"], "file_bytes": after["file"],
                                "tokens": tokens, "batch": list(first["input_ids"].shape)}) + "\n")
    acc.end_training()
    sys.stdout.flush()
    os._exit(0)  # the gloo exit crash (../shared/STACK.md)


def launch(data: Path, cache: Path, num_proc: int) -> tuple[float, list[dict]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", str(29500 + os.getpid() % 1000), __file__, "--rank-probe", str(data),
                           "--cache", str(cache), "--num-proc", str(num_proc)], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    # the two ranks print at once: their lines may interleave, so every "RANK {...}" is decoded where it starts
    decoder = json.JSONDecoder()
    ranks = [decoder.raw_decode(proc.stdout, i + 5)[0] for i in range(len(proc.stdout))
             if proc.stdout.startswith("RANK {", i)]
    if proc.returncode != 0 or len(ranks) != 2:
        raise SystemExit(f"2-rank launch failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return wall, sorted(ranks, key=lambda r: r["rank"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--today-rows", type=int, default=100_000, help="today's path runs on this prefix, scaled")
    parser.add_argument("--num-proc", type=int, default=2, help="data.num_proc of the cache build")
    parser.add_argument("--work", type=Path, default=Path("/tmp/scale_data_scale"))
    parser.add_argument("--rank-probe", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--today", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--prepare", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--cache", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_probe:
        return rank_probe(args.rank_probe, args.cache, args.num_proc)
    if args.today:
        print("TODAY " + json.dumps(today(args.today)))
        return None
    if args.prepare:
        print("PREPARE " + json.dumps(prepare(args.prepare, args.cache, args.num_proc)))
        return None
    load_start = os.getloadavg()[0]  # the machine may be shared: the 1-minute load average, start and end
    args.work.mkdir(parents=True, exist_ok=True)
    data = args.work / f"pc_{args.rows}.jsonl"
    prefix_rows = min(args.today_rows, args.rows)
    prefix = args.work / f"pc_{args.rows}_prefix_{prefix_rows}.jsonl"
    if not data.exists():
        t = time.perf_counter()
        generate(data, args.rows)
        print(f"generated {data} ({data.stat().st_size / 2**20:.0f} MiB) in {time.perf_counter() - t:.0f} s")
    if not prefix.exists():
        with open(data, encoding="utf-8") as src, open(prefix, "w", encoding="utf-8") as dst:
            dst.writelines(line for _, line in zip(range(prefix_rows), src))
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, __file__, "--today", str(prefix)], env=env, capture_output=True, text=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith("TODAY ")]
    if not lines:
        raise SystemExit(f"today's path failed:\n{out.stderr[-3000:]}")
    now = json.loads(lines[0][6:])
    (args.work / "today.json").write_text(json.dumps(now))  # each phase's figures survive a later failure
    cache = args.work / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    # Cold: scale-prepare's work in one process (inside a job the node's main process does the same while the
    # other ranks poll the entry's build record: tests/test_data_scale.py's 2-process test).
    out = subprocess.run([sys.executable, __file__, "--prepare", str(data), "--cache", str(cache), "--num-proc",
                          str(args.num_proc)], env=env, capture_output=True, text=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith("PREPARE ")]
    if not lines:
        raise SystemExit(f"prepare failed:\n{out.stderr[-3000:]}")
    cold = json.loads(lines[0][8:])
    (args.work / "cold.json").write_text(json.dumps(cold))
    warm_wall, warm = launch(data, cache, args.num_proc)
    builds = [json.loads(line) for line in (cache / "builds.jsonl").read_text().splitlines()]
    tokens = cold["tokens"]
    scale = args.rows / prefix_rows
    today_tps = now["tokens"] / now["seconds"]
    cold_s = cold["seconds"]
    tps = tokens / cold_s
    per_rank = max(r["anon_bytes"] for r in warm) / 2**20
    # CPU time does not depend on what else runs on the machine (wall time does): tokens per CPU second, and the
    # wall time on idle cores it implies: today's path is one thread; the build is its parent's work (counted as
    # if none of it overlapped the workers) plus the workers' work shared by data.num_proc cores.
    today_cpu_tps = now["tokens"] / now["cpu_s"]
    cold_cpu = cold["parent_cpu_s"] + cold["workers_cpu_s"]
    idle_cold_s = cold["parent_cpu_s"] + cold["workers_cpu_s"] / args.num_proc
    idle_today_s = now["cpu_s"] * scale
    today_bpt = now["anon_bytes"] / now["tokens"]
    rows = [
        ("tokenize (cold prepare), s", f"{now['seconds'] * scale:.1f} (x{scale:g} of {now['seconds']:.1f})",
         f"{cold_s:.1f}"),
        ("tokens/s (2 cores)", f"{today_tps:,.0f}", f"{tps:,.0f}"),
        ("who tokenizes", "every rank, every start", f"{len(builds)} process in all (builds.jsonl: scale-prepare; "
                                                     f"the 2-rank start added none)"),
        ("CPU seconds (user+sys; build: parent + workers)", f"{now['cpu_s'] * scale:.1f} (x{scale:g})",
         f"{cold_cpu:.1f} ({cold['parent_cpu_s']:.1f} + {cold['workers_cpu_s']:.1f})"),
        ("tokens per CPU second", f"{today_cpu_tps:,.0f}", f"{tokens / cold_cpu:,.0f}"),
        (f"idle estimate from CPU time, {args.num_proc} cores, s (tokens/s)",
         f"{idle_today_s:.1f} ({today_cpu_tps:,.0f})", f"{idle_cold_s:.1f} ({tokens / idle_cold_s:,.0f})"),
        ("builder peak RSS, MiB", "-", f"{cold['peak_rss'] / 2**20:,.0f}"),
        ("warm start, data ready on both ranks, s", f"{now['seconds'] * scale:.1f} (every start)",
         f"{max(r['data_s'] for r in warm):.1f}"),
        ("warm start, launch to first batch, s", "-", f"{max(r['start_to_first_batch_s'] for r in warm):.1f} "
                                                      f"(whole launch {warm_wall:.1f})"),
        ("private memory per rank, MiB", f"{now['anon_bytes'] * scale / 2**20:,.0f}", f"{per_rank:.1f}"),
        ("private bytes per token per rank", f"{today_bpt:.1f}", f"{max(r['anon_bytes'] for r in warm) / tokens:.3f}"),
        ("file-backed resident per rank (libraries + cache pages, shared), MiB", "-", f"{max(r['file_bytes'] for r in warm) / 2**20:.0f}"),
    ]
    print(f"\n{args.rows:,} prompt/completion rows, {tokens:,} tokens; today's path measured on {prefix_rows:,} "
          f"rows; cache built with data.num_proc={args.num_proc}")
    width = max(len(r[0]) for r in rows)
    print(f"| {'':{width}} | today (main) | token cache |")
    print(f"|{'-' * (width + 2)}|---|---|")
    for name, a, b in rows:
        print(f"| {name:{width}} | {a} | {b} |")
    print(f"data_scale: rows={args.rows} cold_s={cold_s:.1f} warm_s={max(r['data_s'] for r in warm):.1f} "
          f"rss_mib_per_rank={per_rank:.1f} tokens_per_s={tps:.0f} speedup={tps / today_tps:.1f}")
    print(f"data_scale_cpu: today_tokens_per_cpu_s={today_cpu_tps:.0f} cache_tokens_per_cpu_s={tokens / cold_cpu:.0f} "
          f"idle_cold_s={idle_cold_s:.1f} idle_tokens_per_s={tokens / idle_cold_s:.0f} "
          f"idle_speedup={tokens / idle_cold_s / today_cpu_tps:.1f} bytes_per_token_per_rank="
          f"{max(r['anon_bytes'] for r in warm) / tokens:.3f} load_start={load_start:.1f} load_end={os.getloadavg()[0]:.1f}")
    return None


if __name__ == "__main__":
    main()
