"""Launch helpers shared by the multi-process tests and the parity benchmarks: every launch mode of the tiny job.

Each mode starts real processes (``accelerate launch``, the ``deepspeed`` launcher, two "nodes" on one machine)
on 2 CPU processes (gloo) and returns the numbers the run logged, so tests and benchmarks compare modes on what
the job really wrote (``metrics.jsonl`` and the adapter), never on exit codes alone.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from tests.bounds import TINY_JOB_REL  # two fp32 paths of the tiny job (tests/bounds.py)

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "train" / "tiny_cpu.yaml"
JOB = ["data.max_train_examples=20", "train.max_steps=6", "train.log_every=1", "train.eval_every=0",
       "lora.dropout=0.0", "optim.warmup_steps=2", f"data.path={ROOT / 'configs' / 'data' / 'tiny_reviews.jsonl'}",
       "log.trackers=[]", "optim.name=sgd", "optim.lr=0.5",
       "log.peak_flops=1e12"]  # measuring it costs minutes on a CPU without bf16 GEMM kernels (no avx512_bf16)
# Parity runs checkpoint every layer (as tiny_cpu.yaml does) and check the invariants after the last step
# (scale.training.checks): they are also tests/test_modes.py's LoRA rows for their modes (:func:`assert_invariants`).
CHECKED = ["model.gradient_checkpointing=true", "train.check_invariants=true"]
# The same job on prompt/completion rows: tails of 2 to 12 tokens (a completion of 1-6 words + EOS), so the
# micro-batches of a window hold tails of different lengths; 20 rows make windows of 8, 8 and 4 per epoch.
COMPLETIONS = [f"data.path={ROOT / 'configs' / 'data' / 'tiny_completions.jsonl'}"]
# Multi-turn chats (1-3 exchanges each), every assistant turn trained (issue 17): tails of 2 to ~90 tokens whose
# user turns between the assistant turns weigh 0.
CHATS = [f"data.path={ROOT / 'configs' / 'data' / 'tiny_chats.jsonl'}", "data.max_length=128",
         f"data.chat_template={ROOT / 'configs' / 'chat' / 'chatml.jinja'}"]
# The reviews cut to their last 16 tokens (every row has 17 to 23): every row, train and eval, is exactly 16 tokens,
# so under sequence parallelism of 2 (shards of 8 positions) every tail prediction (positions 13 and 14) lies on
# the second rank's shard and the first rank's loss is an exact 0 in every micro-batch: a wrong gradient scale
# across the sequence-parallel ranks, or an evaluation that attends within one shard, shows at once.
LATE_TAILS = ["data.max_length=16"]
# Preference pairs (configs/data/tiny_pairs.jsonl: tiny_completions.jsonl's rows as pairs, chosen the row's completion,
# rejected the next row's other completion): 20 pairs at global batch 8 make windows of 8, 8 and 4 pairs per epoch;
# tails of 2 to 12 tokens, so the two sides of a pair differ in length. DPO; a SimPO job adds loss.objective=simpo.
PAIRS = [f"data.path={ROOT / 'configs' / 'data' / 'tiny_pairs.jsonl'}", "loss.objective=dpo", "loss.beta=0.5",
         "eval.generate_samples=0"]


# Online RL (loss.objective=grpo) on configs/data/tiny_prompts.jsonl (addition questions with their answers): 4
# completions of each prompt, every round trained twice (rl.num_iterations=2: the round's log-probs are stored and
# the second step's ratios move), the KL to the adapter-less reference, an exact-answer reward and one the random
# model's completions vary in. Global batch 8 completions = 2 prompts per step in every mode: one prompt per rank
# on 2 ranks. Completions are seeded per prompt, not per rank: every mode samples the same ones.
GRPO = [f"data.path={ROOT / 'configs' / 'data' / 'tiny_prompts.jsonl'}", "data.format=prompts", "loss.objective=grpo",
        "rl.num_generations=4", "rl.num_iterations=2", "rl.max_completion_length=4", "data.max_length=32",
        "rl.beta=0.1", "data.eval_size=4", "eval.generate_samples=0",
        "rl.rewards=[{fn: exact_match, column: answer, part: first_word}, {fn: 'tests.rl_rewards:first_token_parity'}]"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deepspeed_cmd() -> list[str]:
    """The ``deepspeed`` launcher beside this interpreter: CI runs the venv's python without the venv on PATH."""
    return [str(Path(sys.executable).parent / "deepspeed"), "--num_accelerators", "2", "--master_port",
            str(free_port()), "--module", "scale.train"]


def accelerate_cmd(config: str, extra: list[str] | None = None) -> list[str]:
    yaml_path = str(ROOT / "configs" / "accelerate" / config)
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", yaml_path,
            "--main_process_port", str(free_port()), *(extra or []), "-m", "scale.train"]


def fsdp2_cmd(extra: list[str] | None = None) -> list[str]:
    """FSDP2 on 2 CPU processes: ``tests/cpu_fsdp2.yaml`` (configs/accelerate/fsdp2.yaml with 2 processes) and the
    test-only shim :mod:`tests.fsdp_cpu` in front of ``scale.train`` (accelerate 1.15 never enters FSDP on CPU)."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / "tests" / "cpu_fsdp2.yaml"),
            "--main_process_port", str(free_port()), *(extra or []), "-m", "tests.fsdp_cpu"]


def save_tiny_directory(path: Path, *overrides: str) -> Path:
    """The job's ``tiny-llama`` (tiny_cpu.yaml + ``overrides``, weights from ``train.seed``) written with
    ``save_pretrained``: a real model directory holding the very weights the built-in name builds, so a run from it
    must give the built-in run's numbers (``model.name_or_path=<path> model.tokenizer=smollm2-135m``)."""
    from scale.config.load import load_config
    from scale.modeling.build import load_base, load_tokenizer

    cfg = load_config(str(TINY), list(overrides))
    load_base(cfg.model, len(load_tokenizer(cfg.model)), cfg.train.seed).save_pretrained(path)
    return path


def save_tiny_moe_directory(path: Path) -> Path:
    """A tiny Qwen3-MoE whose routers send every token to one of experts {0, 1} and one of {2, 3}, never to 4-7.

    Each MoE input is the post-attention RMSNorm's output; its weight is zeroed but for coordinates 0 and 1, so the
    router sees ``x = (x0, x1, 0, ...)``; router rows ``+-8 e_0`` (experts 0, 1) and ``+-8 e_1`` (experts 2, 3) give
    logits ``+-8 x0``, ``+-8 x1`` and 0 for experts 4-7: the top 2 are the two positive ones (x0, x1 != 0).
    """
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    E, K, H = 8, 2, 32  # experts, experts per token, hidden size
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=49152, hidden_size=H, intermediate_size=64, moe_intermediate_size=16,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=E,
                         num_experts_per_tok=K, head_dim=8, max_position_embeddings=256, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            gamma = torch.zeros(H)
            gamma[:2] = 1.0
            layer.post_attention_layernorm.weight.copy_(gamma)
            w = torch.zeros(E, H)
            w[0, 0], w[1, 0], w[2, 1], w[3, 1] = 8.0, -8.0, 8.0, -8.0
            layer.mlp.gate.weight.copy_(w)
    model.save_pretrained(path)
    return path


def from_directory(path: Path) -> list[str]:
    """Overrides that load the model from ``path`` (:func:`save_tiny_directory`) instead of building it."""
    return [f"model.name_or_path={path}", "model.tokenizer=smollm2-135m"]


def modes(directory: Path | None = None) -> dict[str, tuple[list[list[str]], list[str]]]:
    """name -> (commands to start together, overrides). Micro-batch x GA x processes = 8 in every mode.

    With ``directory`` (:func:`save_tiny_directory`) a ZeRO-3 row loads the model from it: ``from_pretrained``
    under ``zero.Init``, the path a real model takes (the built-in ``tiny-llama`` is built in memory)."""
    py = [sys.executable, "-m", "scale.train"]
    zero2 = str(ROOT / "configs" / "deepspeed" / "zero2.json")
    port = free_port()
    nodes = [[sys.executable, "-m", "accelerate.commands.launch", "--config_file",
              str(ROOT / "configs" / "accelerate" / "cpu_ddp.yaml"), "--num_machines", "2", "--num_processes", "2",
              "--machine_rank", str(r), "--main_process_ip", "127.0.0.1", "--main_process_port", str(port),
              "-m", "scale.train"] for r in (0, 1)]
    mb2 = ["train.micro_batch_size=2", "train.gradient_accumulation_steps=2"]
    table = {
        "single 1x(8,1)": ([py], ["train.micro_batch_size=8", "train.gradient_accumulation_steps=1"]),
        "single 1x(2,4)": ([py], ["train.micro_batch_size=2", "train.gradient_accumulation_steps=4"]),
        "ddp 2x(2,2)": ([accelerate_cmd("cpu_ddp.yaml")], mb2),
        "zero1 2x(2,2)": ([accelerate_cmd("cpu_zero1.yaml")], mb2),
        "zero2 2x(2,2)": ([accelerate_cmd("cpu_zero2.yaml")], mb2),
        "zero3 2x(2,2)": ([accelerate_cmd("cpu_zero3.yaml")], mb2),
        "fsdp2 2x(2,2)": ([fsdp2_cmd()], mb2),
        "2 nodes x 1 proc (2,2)": (nodes, mb2),
        "deepspeed launcher 2x(2,2)": (
            [deepspeed_cmd()],
            ["train.micro_batch_size=2", "train.gradient_accumulation_steps=2", f"train.deepspeed_config={zero2}"]),
    }
    if directory is not None:
        table["zero3 from a directory 2x(2,2)"] = ([accelerate_cmd("cpu_zero3.yaml")], mb2 + from_directory(directory))
    # Sequence parallelism (DeepSpeed Ulysses): both processes share every row, one data-parallel rank, so the
    # global batch of 8 is micro-batch 4 x GA 2 x 1.
    sp2 = ["train.sequence_parallel_size=2", "train.micro_batch_size=4", "train.gradient_accumulation_steps=2"]
    table["ulysses sp2 zero2 2x(4,2)"] = ([accelerate_cmd("cpu_zero2.yaml")], sp2)
    table["ulysses sp2 zero3 2x(4,2)"] = ([accelerate_cmd("cpu_zero3.yaml")], sp2)
    table["ulysses sp2 zero1 2x(4,2)"] = ([accelerate_cmd("cpu_zero1.yaml")], sp2)
    # 4 processes: 2 data-parallel groups of 2 ranks per row (micro-batch 2 x GA 2 x 2 groups = 8)
    sp2dp2 = ["train.sequence_parallel_size=2", "train.micro_batch_size=2", "train.gradient_accumulation_steps=2"]
    for zero in ("zero2", "zero3"):
        table[f"ulysses sp2 {zero} 4x(2,2) dp2"] = (
            [accelerate_cmd(f"cpu_{zero}.yaml", ["--num_processes", "4"])], sp2dp2)
    return table


def run_mode(cmds: list[list[str]], overrides: list[str], out: Path, timeout: float = 600) -> dict:
    """Start ``cmds`` together with the tiny job + ``overrides`` writing to ``out``; return its numbers (and under
    ``output`` what the processes printed).

    Raises:
        RuntimeError: a process exits non-zero (its output tail is in the message).
    """
    args = ["--config", str(TINY), f"output_dir={out}", *JOB, *overrides]
    env = {**os.environ, "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false"}
    procs = [subprocess.Popen(c + args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for c in cmds]
    outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    for p, text in zip(procs, outputs):
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(p.args[:6])} ... exited {p.returncode}:\n{text[-3000:]}")
    return {**read_run(out), "output": "\n".join(outputs)}


def run_in_process(overrides: list[str], out: Path) -> dict:
    """The tiny job + ``overrides`` on one device in this process, through ``scale.cli.main`` as ``python -m
    scale.train`` runs it: the one-device reference of a multi-process comparison without a launch's start-up
    (~8 s of imports on 2 cores). Returns what :func:`run_mode` returns.

    Raises:
        RuntimeError: the run's exit code is not 0.
    """
    from scale.cli import main

    code = main(["--config", str(TINY), f"output_dir={out}", *JOB, *overrides])
    if code != 0:
        raise RuntimeError(f"scale-train in process exited {code}")
    return read_run(out)


def read_run(out: Path) -> dict:
    """The numbers a run wrote to ``out`` (see :func:`run_mode`)."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "train/loss" in r]
    samples = out / "samples.jsonl"  # eval.generate_samples (issue 20): (step, row, completion) of each sample
    generated = [(r["step"], r["row"], r["completion"]) for r in map(json.loads, samples.read_text().splitlines())
                 ] if samples.exists() else []  # grpo: also the completions of each logged round (split: train)
    return {"loss": [r["train/loss"] for r in train], "grad_norm": [r["train/grad_norm"] for r in train],
            "lr": [r["train/lr"] for r in train], "steps": [r["step"] for r in train],
            "weights": trained_weights(out), "samples": generated,
            "checks": [r for r in rows if "check/base_unchanged" in r or "check/weights_moved" in r]}


def trained_weights(out: Path) -> dict:
    """What a run trained, by name: its adapter's tensors, or, for ``model.finetune=full``, every weight of its
    ``model/`` directory (all its safetensors shards)."""
    from safetensors.torch import load_file

    if (out / "model" / "config.json").is_file():
        weights = {}
        for shard in sorted((out / "model").glob("model*.safetensors")):
            weights.update(load_file(shard))
        return weights
    return load_file(out / "adapter" / "adapter_model.safetensors")


def assert_invariants(checks: list[dict], mode: str, step: int) -> None:
    """The ``train.check_invariants`` row of a run of ``mode`` (a :func:`modes` name) that ended at ``step``: the
    base bit-identical, the LoRA weights equal on every rank holding a full copy, all 14 ``lora_B`` moved; ZeRO-3
    really partitions the weights (4-bit ones included) over 2 ranks, every other mode keeps them whole."""
    checks = [dict(r) for r in checks]
    assert len(checks) == 1, checks
    fraction = checks[0].pop("check/param_elements_local_fraction")
    compared = 1 if mode.startswith(("single", "zero3")) else 2  # ZeRO-3 gathers one full copy (rank 0)
    assert checks == [{"step": step, "check/base_unchanged": True, "check/ranks_agree": True,
                       "check/ranks_compared": compared, "check/lora_B_nonzero": True, "check/lora_B_tensors": 14}]
    if mode.startswith("zero3"):
        assert 0.45 < fraction < 0.55, fraction
    else:
        assert fraction == 1.0


def assert_adapter_reproduces_eval(out: Path) -> None:
    """The adapter a run saved in ``out`` is whole (28 tensors, no empty ZeRO-3 partition) and, loaded with peft
    on the base model in this process, evaluates to the run's final logged evaluation (accuracy exactly, loss and
    target NLL to 1e-5)."""
    from accelerate import Accelerator
    from peft import PeftModel
    from safetensors.torch import load_file
    from torch.utils.data import DataLoader

    from scale.config.load import load_config
    from scale.data import Collator, build_splits
    from scale.modeling.build import load_base, load_tokenizer
    from scale.objectives.tail import LossSpec
    from scale.training.evaluate import evaluate
    from scale.training.metrics import read_jsonl

    final = [r for r in read_jsonl(out / "metrics.jsonl") if "eval/loss" in r][-1]
    adapter = load_file(out / "adapter" / "adapter_model.safetensors")
    assert len(adapter) == 28
    for name, t in adapter.items():  # ZeRO-3 partitions would show up as empty tensors
        assert t.numel() > 0 and t.shape[0] in (8, 64, 128) and t.abs().max() > 0, (name, t.shape)
    cfg = load_config(out / "config.yaml")
    tokenizer = load_tokenizer(cfg.model)
    model = PeftModel.from_pretrained(load_base(cfg.model, len(tokenizer), cfg.train.seed), out / "adapter")
    splits = build_splits(cfg.data, cfg.loss, tokenizer, cfg.data.path, cfg.train.seed)
    dl = DataLoader(splits.eval, batch_size=16, collate_fn=Collator(tokenizer.pad_token_id, "left"))
    again = evaluate(Accelerator(cpu=True), model, dl, LossSpec.from_config(cfg))
    assert again["eval/accuracy"] == final["eval/accuracy"]
    assert abs(again["eval/loss"] / final["eval/loss"] - 1) <= TINY_JOB_REL, (again, final)
    assert abs(again["eval/target_nll"] / final["eval/target_nll"] - 1) <= TINY_JOB_REL, (again, final)


def rel_dev(a: list[float], b: list[float]) -> float:
    """max_i |a_i - b_i| / |a_i| (lists of equal length; a length mismatch is infinite deviation)."""
    if len(a) != len(b):
        return float("inf")
    return max(abs(x - y) / max(abs(x), 1e-30) for x, y in zip(a, b))


def scaled_dev(a: list[float], b: list[float]) -> float:
    """max_i |a_i - b_i| / max_i |a_i|: the deviation of a series whose terms pass near 0 (GRPO's loss at the first
    step of a round is ~0 by construction: a group's advantages sum to 0), against its scale."""
    if len(a) != len(b):
        return float("inf")
    return max(abs(x - y) for x, y in zip(a, b)) / max(max(map(abs, a)), 1e-30)


def weight_dev(a: dict, b: dict) -> float:
    """max over tensors of max |a - b| / max |a| (trainable LoRA weights after the run)."""
    if a.keys() != b.keys():
        return float("inf")
    return max(((a[k] - b[k]).abs().max() / a[k].abs().max().clamp(min=1e-30)).item() for k in a)


def torchrun_cmd(max_restarts: int, nproc: int = 2) -> list[str]:
    """``torchrun`` with elastic restarts (c10d rendezvous on a free local port), as launch/elastic.sh runs it."""
    return [str(Path(sys.executable).parent / "torchrun"), "--nnodes", "1", "--nproc-per-node", str(nproc),
            "--max-restarts", str(max_restarts), "--rdzv-backend", "c10d", "--rdzv-endpoint",
            f"127.0.0.1:{free_port()}", "--rdzv-id", "scale-elastic", "--monitor-interval", "0.5",
            "-m", "scale.train"]


def _logged_steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    steps = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # a line being written
            continue
        if "train/loss" in row:
            steps.append(row["step"])
    return steps


def run_elastic(out: Path, overrides: list[str], kill_at: list[int], max_restarts: int, seed: int = 0,
                timeout: float = 900) -> dict:
    """Run the tiny job under ``torchrun --max-restarts`` (``train.resume_from=auto``, a checkpoint every step)
    and SIGKILL one worker, chosen at random, once the run has logged each step in ``kill_at``.

    Returns:
        ``returncode``, ``weights`` (the final adapter, when written), ``losses`` (step -> train/loss as finally
        logged), ``recovery_s`` (per kill: seconds from the kill until the restarted group logged a new step),
        ``log`` (the launcher's output).
    """
    import random
    import time

    import psutil
    from safetensors.torch import load_file

    rng = random.Random(seed)
    args = ["--config", str(TINY), f"output_dir={out}", *JOB, "train.save_every=1", "train.resume_from=auto",
            *overrides]
    env = {**os.environ, "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    log_path = out.with_name(out.name + ".log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(torchrun_cmd(max_restarts) + args, cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT)
        recovery, deadline = [], time.time() + timeout
        for step in kill_at:
            while proc.poll() is None and time.time() < deadline and max(_logged_steps(out), default=0) < step:
                time.sleep(0.05)
            workers = [c for c in psutil.Process(proc.pid).children() if "scale.train" in " ".join(c.cmdline())]
            if proc.poll() is not None or not workers:
                break
            at = max(_logged_steps(out), default=0)
            killed = time.time()
            rng.choice(workers).kill()  # SIGKILL: no handler, no checkpoint, no goodbye
            while proc.poll() is None and time.time() < deadline and max(_logged_steps(out), default=0) <= at:
                time.sleep(0.05)
            recovery.append(time.time() - killed)
        try:
            proc.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            for c in psutil.Process(proc.pid).children(recursive=True):
                c.kill()
            proc.kill()
            proc.wait()
    adapter = out / "adapter" / "adapter_model.safetensors"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()] \
        if (out / "metrics.jsonl").exists() else []
    return {"returncode": proc.returncode, "weights": load_file(adapter) if adapter.exists() else None,
            "losses": {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}, "recovery_s": recovery,
            "log": log_path.read_text(errors="replace")}


def run_node_range(out: Path, overrides: list[str], kill_at: int | None, timeout: float = 900) -> dict:
    """Two "nodes" of 1 process on loopback, each ``launch/elastic.sh`` with ``NNODES=1:2`` (torchrun, c10d
    rendezvous, ``train.resume_from=auto``, a checkpoint every step); once step ``kill_at`` is logged the second node
    (agent and worker) is SIGKILLed: the first one's group restarts alone and resumes on 1 process.

    Returns:
        ``returncode`` (the surviving node's), ``weights``, ``losses`` (step -> train/loss as finally logged),
        ``recovery_s`` (seconds from the kill until the restarted group logged a new step, or None), ``log``.
    """
    import time

    import psutil
    from safetensors.torch import load_file

    port = free_port()
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
           "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}", "NNODES": "1:2", "NPROC_PER_NODE": "1",
           "MAX_RESTARTS": "2", "RDZV_ENDPOINT": f"127.0.0.1:{port}", "RDZV_ID": f"scale-range-{port}",
           "RDZV_CONF": "last_call_timeout=3"}
    args = ["--config", str(TINY), f"output_dir={out}", *JOB, "train.save_every=1", *overrides]
    logs = [out.with_name(f"{out.name}.node{i}.log") for i in (0, 1)]
    nodes = []
    for i, log in enumerate(logs):
        with open(log, "w") as fh:  # the first node starts the rendezvous store, then the second joins
            nodes.append(subprocess.Popen(["bash", str(ROOT / "launch" / "elastic.sh"), *args], cwd=ROOT, env=env,
                                          stdout=fh, stderr=subprocess.STDOUT, start_new_session=True))
        time.sleep(2.0 if i == 0 else 0)
    deadline, recovery = time.time() + timeout, None
    if kill_at is not None:
        while nodes[0].poll() is None and time.time() < deadline and max(_logged_steps(out), default=0) < kill_at:
            time.sleep(0.05)
        at, killed = max(_logged_steps(out), default=0), time.time()
        agent = psutil.Process(nodes[1].pid)  # bash exec'd torchrun: the agent; its workers run in sessions of their own
        for proc in [*agent.children(recursive=True), agent]:  # the node's agent and its workers: a lost machine
            proc.kill()
        while nodes[0].poll() is None and time.time() < deadline and max(_logged_steps(out), default=0) <= at:
            time.sleep(0.05)
        recovery = time.time() - killed if max(_logged_steps(out), default=0) > at else None
    for node in nodes:
        try:
            node.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            for proc in [*psutil.Process(node.pid).children(recursive=True), psutil.Process(node.pid)]:
                proc.kill()
            node.wait()
    adapter = out / "adapter" / "adapter_model.safetensors"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()] \
        if (out / "metrics.jsonl").exists() else []
    return {"returncode": nodes[0].returncode, "weights": load_file(adapter) if adapter.exists() else None,
            "losses": {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}, "recovery_s": recovery,
            "log": "\n".join(log.read_text(errors="replace") for log in logs)}
