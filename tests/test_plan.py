"""``scale-plan``: predicted bytes per rank against counts of what each rank really holds.

- Model states (weights, trainable weights, fp32 master, gradients, optimizer state) in single, DDP and
  ZeRO-1/2/3 with 2 processes: ``tests/plan_census.py`` runs under ``accelerate launch`` with
  ``configs/accelerate/cpu_*.yaml`` and counts every storage each rank holds before its second optimizer step;
  the prediction must equal it to the byte, on both ranks (FSDP2: ``python benchmarks/plan_fsdp2.py``).
- Saved activations: within 10% of the bytes ``saved_tensors_hooks`` count on a real CPU forward of the same
  job (checkpointing on and off, padded and full rows).
- The single-device total without overhead: within 10% of the peak of live tensor bytes over a real CPU optimizer
  step (a ``TorchDispatchMode`` that follows every storage; the CPU stand-in for ``max_memory_allocated``).
- 4-bit storage: equal to a real bitsandbytes model's packed weights and quant state.
- Bad input: one line on stderr, exit code 2.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scale import plan as P
from scale.config.load import load_config
from scale.planner import activations as A
from scale.planner import census as C
from scale.planner import layouts as LY
from scale.planner.autobatch import largest_micro_batch
from tests.conftest import ROOT, TINY_YAML
from tests.launching import free_port
from tests.live_bytes import LiveBytes

BASE = ["log.trackers=[]", "train.gradient_accumulation_steps=1"]
# SmolLM2-135M's shape (its config.json, written out explicitly so that no cache is needed), and a tiny Llama whose
# odd sizes make DeepSpeed pad: LoRA r=3 on a 127-wide MLP gives odd parameter sizes and an odd group size.
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True, max_position_embeddings=2048)
ODD = ["model.tiny_hidden_size=66", "model.tiny_num_heads=3", "model.tiny_intermediate_size=127", "lora.r=3"]
NO_ACTS = {False: A.Activations(0, 0, 0, 0), True: A.Activations(0, 0, 0, 0)}
STATES = ("weights", "trainable", "master", "gradients", "optimizer")


def smollm2_dir(tmp: Path) -> Path:
    """A directory holding only SmolLM2-135M's ``config.json`` (scale-train refuses a bare file as
    ``model.name_or_path``; the census builds random weights from such a directory)."""
    from transformers import LlamaConfig

    path = tmp / "smollm2-135m-shape"
    path.mkdir(exist_ok=True)
    LlamaConfig(**SMOLLM2, use_cache=False).to_json_file(path / "config.json")
    return path


@pytest.fixture(scope="module")
def smollm2_base():
    """A random-weight SmolLM2-135M-shaped Llama, built once per module (LoRA is added to a copy per test)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(**SMOLLM2, use_cache=False))


def planned(overrides: list[str]):
    cfg = load_config(TINY_YAML, [*BASE, *overrides])
    hf = C.load_model_config(cfg.model)
    return cfg, hf, C.census(cfg, C.build_meta_model(cfg, hf))


# ---------------------------------------------------------------------------------------------------------------
# model states, counted on 2 processes


def run_census(mode: str, cases: dict[str, list[str]], out: Path) -> dict[str, list[dict]]:
    """Count ``cases`` (name -> overrides) one after the other in one launch of ``mode``; name -> each rank's count."""
    script = [str(ROOT / "tests" / "plan_census.py"), str(out), "--config", str(TINY_YAML), *BASE]
    for name, overrides in cases.items():
        script += ["--case", name, *overrides]
    if mode == "single":
        cmd = [sys.executable, *script]
    else:  # FSDP2 on CPU needs the test-only shim (tests/fsdp_cpu.py), which plan_census.py enables under its YAML
        yaml = ROOT / ("tests/cpu_fsdp2.yaml" if mode == "fsdp2" else f"configs/accelerate/cpu_{mode}.yaml")
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(yaml),
               "--main_process_port", str(free_port()), *script]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return {name: [json.loads(p.read_text()) for p in sorted(out.parent.glob(f"{out.name}.{name}.*"))]
            for name in cases}


# QLoRA with fp32 storage (ZeRO-3 shards 4-bit weights only when the storage is the compute dtype), hidden 512: a
# packed [512, 512] weight stores 32,768 fp32 elements, under the persistence threshold (100,000) although its logical
# 262,144 are not, so ZeRO-3 keeps it whole on every rank (issue 21: the planner decided on logical elements).
QLORA32 = ["model.quantize_4bit=true", "model.bnb_4bit_compute_dtype=float32", "model.bnb_4bit_quant_storage=float32",
           "model.tiny_hidden_size=512", "model.tiny_intermediate_size=1024"]
SHAPES = {"tiny": [], "smollm2-135m": None, "odd": ODD, "tiny-qlora": QLORA32, "smollm2-qlora": QLORA32[:3]}
CASES = [(s, m) for s in ("tiny", "smollm2-135m") for m in ("single", "ddp", "zero1", "zero2", "zero3")]
CASES += [("odd", "zero1"), ("odd", "zero2"), ("odd", "zero3"), ("tiny-qlora", "zero3"), ("smollm2-qlora", "zero3")]


@pytest.fixture(scope="module")
def mode_census(tmp_path_factory):
    """``(mode) -> {shape: counts}`` for the tiny shapes: every tiny shape of a mode counted in one launch (the
    first test of the mode starts it), so that a launch's start-up is paid once per mode, not once per shape."""
    done: dict[str, dict[str, list[dict]]] = {}

    def counts(mode: str) -> dict[str, list[dict]]:
        if mode not in done:
            shapes = {s: SHAPES[s] for s, m in CASES if m == mode and not s.startswith("smollm2")}
            done[mode] = run_census(mode, shapes, tmp_path_factory.mktemp(f"census-{mode}") / "census.json")
        return done[mode]

    return counts


@pytest.mark.launch
@pytest.mark.parametrize("shape,mode", [
    pytest.param(s, m, marks=[pytest.mark.heavy] if s.startswith("smollm2") else [], id=f"{s}-{m}") for s, m in CASES])
def test_predicted_model_states_equal_what_each_rank_holds(shape, mode, tmp_path, mode_census):
    pytest.importorskip("deepspeed") if mode.startswith("zero") else None
    overrides = SHAPES[shape]
    if overrides is None:  # SmolLM2 shape: random weights from its config; one short row keeps the run short
        overrides = [f"model.name_or_path={smollm2_dir(tmp_path)}", "train.micro_batch_size=1", "data.max_length=16"]
    elif shape == "smollm2-qlora":  # the real SmolLM2-135M directory, quantized at load (NF4, fp32 storage)
        overrides = ["model.name_or_path=smollm2-135m", "train.micro_batch_size=1", "data.max_length=16", *overrides]
    if shape.startswith("smollm2"):
        counts = run_census(mode, {shape: overrides}, tmp_path / "census.json")[shape]
    else:
        counts = mode_census(mode)[shape]
    assert len(counts) == (1 if mode == "single" else 2)
    cfg, hf, params = planned(overrides)
    for c in counts:
        assert c["mode"] == mode
        r = LY.predict_mode(cfg, params, NO_ACTS, mode, c["world"], hf, rank=c["rank"])
        predicted = {k: getattr(r, k) for k in STATES}
        held = {k: c["totals"].get(k, 0) for k in STATES}
        if mode == "zero1":  # whole gradients until the end of backward; the partition after it
            held["gradients"] = c["grads_in_backward"]
            trainable = [p for p in params if p.trainable]
            n = sum(p.numel for p in trainable)
            aligned = -(-n // (2 * c["world"])) * 2 * c["world"]
            partition = LY.zero12_gradient_elems(trainable, aligned, aligned // c["world"], c["rank"]) * 4
            assert c["totals"]["gradients"] == partition
        assert predicted == held, (c["rank"], predicted, held)
        if mode in ("zero1", "zero2", "zero3"):  # DeepSpeed's reduce bucket, seen from inside backward
            assert c["bucket_in_backward"] == LY.deepspeed_settings(mode, hf)["reduce_bucket_size"] * 4
        # nothing big held that the accounting does not know: the batch, RoPE tables, a leftover gradient view
        assert c["totals"].get("other", 0) < 64 * 1024, c["others"]


# ---------------------------------------------------------------------------------------------------------------
# saved activations against saved-tensor hooks on a real forward


def real_saved_bytes(model: torch.nn.Module, cfg, padded: bool = True) -> int:
    """Bytes autograd saves in one real CPU forward of the tail loss (distinct storages, parameters excluded)."""
    from scale.loss import tail as scale_loss

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    B, T = cfg.train.micro_batch_size, cfg.data.max_length
    ids = torch.randint(3, 400, (B, T), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :5] = 0  # left padding, as the collator pads a batch of unequal rows
    amp = cfg.train.mixed_precision == "bf16"
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        tail, targets = scale_loss.forward_tail(model, {"input_ids": ids, "attention_mask": mask}, cfg.loss.threshold)
        scale_loss.tail_loss(tail, targets, torch.ones_like(targets, dtype=torch.float32))
    return sum(seen.values())


ACTIVATION_CASES = [(s, c, p) for s in ("tiny", "smollm2-135m") for c in (False, True) for p in (True, False)]
ACTIVATION_CASES += [("tiny-bf16", False, True), ("tiny-bf16", True, True)]


def live_step_peak(cfg, model: torch.nn.Module, B: int, T: int) -> int:
    """Peak live tensor bytes (:class:`tests.live_bytes.LiveBytes`) of the second of two real optimizer steps of
    ``model`` on ``[B, T]`` random rows (the first left-padded by 5), counting the weights, buffers, optimizer state
    and 4-bit quantization state as the plan does."""
    from scale.loss import tail as scale_loss
    from scale.training.parts.optimizer import make_optimizer

    model.train()
    optimizer, _ = make_optimizer(cfg, model)
    ids = torch.randint(3, 400, (B, T), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.train.mixed_precision == "bf16"):
            tail, targets = scale_loss.forward_tail(model, {"input_ids": ids, "attention_mask": mask}, cfg.loss.threshold)
        num, den = scale_loss.tail_loss(tail.float(), targets, torch.ones_like(targets, dtype=torch.float32))
        (num / den).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    states = [t for s in optimizer.state.values() for t in s.values() if t.dim()]
    quant = [t for p in model.parameters() if getattr(p, "quant_state", None) is not None
             for t in (p.quant_state.absmax, p.quant_state.code, p.quant_state.offset,
                       *((p.quant_state.state2.absmax, p.quant_state.state2.code) if p.quant_state.state2 else ()))
             if t is not None]
    live = LiveBytes(*model.parameters(), *model.buffers(), *states, *quant)
    with live:
        step()
    return live.peak


@pytest.mark.parametrize("shape,checkpointing,padded", [
    pytest.param(s, c, p, marks=[pytest.mark.slow, pytest.mark.heavy] if s == "smollm2-135m" else [],
                 id=f"{s}-checkpointing-{'on' if c else 'off'}-{'padded' if p else 'full-rows'}")
    for s, c, p in ACTIVATION_CASES])
def test_predicted_activations_within_10_percent_of_saved_tensor_hooks(shape, checkpointing, padded, tmp_path,
                                                                       request):
    import copy

    from scale.modeling.build import add_lora, build_model

    overrides = {"tiny": [], "tiny-bf16": ["model.dtype=bfloat16", "train.mixed_precision=bf16"],
                 "smollm2-135m": [f"model.name_or_path={smollm2_dir(tmp_path)}", "lora.r=16",
                                  "train.micro_batch_size=2", "data.max_length=32"]}[shape]
    cfg, hf, params = planned([*overrides, f"model.gradient_checkpointing={str(checkpointing).lower()}"])
    predicted = A.count_activations(cfg, C.build_meta_model(cfg, hf), params, padded=padded)
    if shape == "smollm2-135m":
        model = add_lora(copy.deepcopy(request.getfixturevalue("smollm2_base")), cfg.model, cfg.lora)
        model.train()
    else:
        model = build_model(cfg.model, cfg.lora, C.TINY_VOCAB, cfg.train.seed)
    real = real_saved_bytes(model, cfg, padded)
    assert abs(predicted.total / real - 1) < 0.10, (predicted, real)
    assert predicted.layers == hf.num_hidden_layers and predicted.head > 0


def loss_step_saved_bytes(model: torch.nn.Module, batch: dict, spec) -> int:
    """Bytes autograd saves in the product's ``loss_step`` on ``batch`` (distinct storages, parameters excluded)."""
    params_ptr = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params_ptr:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        spec.loss_step(model, batch, spec.weights(batch))
    return sum(seen.values())


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("chunk", ["0", "64"])
def test_predicted_packed_activations_within_10_percent_of_saved_tensor_hooks(checkpointing, chunk):
    """[issue 19] data.packing: the plan's count for one packed micro-batch (B full bins in one padding-free row,
    every token trained) against what autograd saves in the product's own path (PackedCollator -> loss_step)
    for 8 bins of 64 tokens, each two examples of 32 tokens whose tails are all but their first token."""
    from scale.data import Example
    from scale.data.collate import PackedCollator
    from scale.modeling.build import build_model
    from scale.objectives.tail import LossSpec

    cfg, hf, params = planned([f"model.gradient_checkpointing={str(checkpointing).lower()}", "data.packing=true",
                               f"loss.chunk_size={chunk}", "loss.threshold=64"])  # N = T, as make_plan sets it
    B, T = cfg.train.micro_batch_size, cfg.data.max_length
    predicted = A.count_activations(cfg, C.build_meta_model(cfg, hf), params, packed=True)
    model = build_model(cfg.model, cfg.lora, C.TINY_VOCAB, cfg.train.seed)
    model.train()
    g = torch.Generator().manual_seed(0)
    bins = [[Example(torch.randint(3, 400, (T // 2,), generator=g).tolist(), T // 2 - 1, 0, 7, row=2 * b + i)
             for i in range(2)] for b in range(B)]
    batch = PackedCollator()(bins)
    assert batch["input_ids"].shape == (1, B * T)
    spec = LossSpec(padding_side="left", type_weights=None, criterion=None, chunk_size=int(chunk))
    real = loss_step_saved_bytes(model, batch, spec)
    assert abs(predicted.total / real - 1) < 0.10, (predicted, real)
    assert predicted.loss_positions == (64 if chunk == "64" else B * T)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_predicted_padded_chunked_activations_within_10_percent_of_saved_tensor_hooks(checkpointing):
    """[issue 19] loss.chunk_size on a padded micro-batch (an SFT tail of 32 positions a row, chunks of 64 of the
    B x N = 256): the plan's count against what autograd saves in the product's own path (``loss_step`` ->
    ``forward_tail_hidden`` -> ``chunked_tail_loss``), one row left-padded as the collator pads it."""
    from scale.modeling.build import build_model
    from scale.objectives.tail import LossSpec

    cfg, hf, params = planned([f"model.gradient_checkpointing={str(checkpointing).lower()}", "loss.threshold=32",
                               "loss.chunk_size=64"])
    B, T, N = cfg.train.micro_batch_size, cfg.data.max_length, cfg.loss.threshold
    predicted = A.count_activations(cfg, C.build_meta_model(cfg, hf), params, padded=True)
    assert predicted.loss_positions == 64
    model = build_model(cfg.model, cfg.lora, C.TINY_VOCAB, cfg.train.seed)
    model.train()
    ids = torch.randint(3, 400, (B, T), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding, as the collator pads a batch of unequal rows
    batch = {"input_ids": ids, "attention_mask": mask, "tail_mask": torch.ones(B, N, dtype=torch.long),
             "type_indicator": torch.zeros(B, dtype=torch.long)}
    spec = LossSpec(padding_side="left", type_weights=None, criterion=None, chunk_size=64)
    real = loss_step_saved_bytes(model, batch, spec)
    assert abs(predicted.total / real - 1) < 0.10, (predicted, real)


PEAK_CASES = [(s, c) for s in ("tiny", "tiny-bf16", "tiny-qlora", "tiny-qlora-bf16") for c in (False, True)]
# "-rows": 8 rows of 256 tokens, so that the decoder's saved activations outweigh the weights and the head (at 4 x 64
# the tiny model's 49,152-word head and its logits are ~80% of the peak and hide the dtype of the residual stream)
PEAK_CASES += [("tiny-qlora-rows", False), ("tiny-qlora-bf16-rows", False), ("smollm2-135m", True)]


@pytest.mark.parametrize("shape,checkpointing", [
    pytest.param(s, c, marks=[pytest.mark.slow, pytest.mark.heavy] if s == "smollm2-135m" else [],
                 id=f"{s}-checkpointing-{'on' if c else 'off'}") for s, c in PEAK_CASES])
def test_predicted_single_device_peak_within_10_percent_of_live_tensor_bytes(shape, checkpointing, tmp_path,
                                                                             request):
    """The whole single-device prediction (model states + activations + logits + transient, no overhead) against
    the peak of live tensor bytes over a real CPU optimizer step (the optimizer state already exists)."""
    import copy

    from scale.modeling.build import add_lora, build_model

    if "qlora" in shape:
        pytest.importorskip("bitsandbytes")
    bf16 = ["model.dtype=bfloat16", "train.mixed_precision=bf16", "model.bnb_4bit_compute_dtype=bfloat16"]
    B, T = (2, 32) if shape == "smollm2-135m" else (8, 256) if shape.endswith("-rows") else (4, 64)
    overrides = [f"model.gradient_checkpointing={str(checkpointing).lower()}", f"train.micro_batch_size={B}",
                 f"data.max_length={T}", *(["model.quantize_4bit=true"] if "qlora" in shape else []),
                 *(bf16 if shape.removesuffix("-rows").endswith("bf16") else [])]
    if shape == "smollm2-135m":
        overrides += [f"model.name_or_path={smollm2_dir(tmp_path)}", "lora.r=16"]
    cfg, _hf, _ = planned(overrides)
    predicted = P.make_plan(cfg, 1).ranks[0]
    if shape == "smollm2-135m":
        model = add_lora(copy.deepcopy(request.getfixturevalue("smollm2_base")), cfg.model, cfg.lora)
    else:
        model = build_model(cfg.model, cfg.lora, C.TINY_VOCAB, 0)
    peak = live_step_peak(cfg, model, B, T)
    # QLoRA within 5%: the planner counts what a 4-bit layer keeps (nothing for backward; its output in its input's
    # dtype, fp32 after the fp32 norms) and the fp32 residual stream of prepare_model_for_kbit_training
    tolerance = 0.05 if "qlora" in shape else 0.10
    assert abs(predicted.allocated / peak - 1) < tolerance, (predicted.allocated / peak, predicted, peak)


# Sequence parallelism (train.sequence_parallel_size=2, DeepSpeed Ulysses): rows of 64 tokens, a short tail (on one
# shard whole) and a long one (over both shards). name -> (rows, length, tail).
SP_CASES = {"short-tail": (2, 64, 2), "long-tail": (2, 64, 48)}


@pytest.mark.launch
def test_predicted_sequence_parallel_activations_within_10_percent_of_each_rank(tmp_path):
    """The SP columns' saved activations (one rank's shard: C = T / 2 positions, Ulysses' attention on half the heads,
    the LM head over min(tail, C) positions) against what autograd saves in the product's path on the busiest of the
    2 ranks (tests/sp_census.py under accelerate launch: shard_rows -> loss_step under the sharded attention)."""
    pytest.importorskip("deepspeed")
    out = tmp_path / "sp.json"
    script = [str(ROOT / "tests" / "sp_census.py"), str(out), "--config", str(TINY_YAML), *BASE,
              "train.sequence_parallel_size=2", "data.max_length=64", "train.micro_batch_size=2"]
    for name, (rows, length, tail) in SP_CASES.items():
        script += ["--case", name, str(rows), str(length), str(tail)]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "configs" / "accelerate" / "cpu_zero2.yaml"), "--main_process_port", str(free_port()), *script]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    for name, (rows, length, tail) in SP_CASES.items():
        counts = [json.loads(p.read_text()) for p in sorted(tmp_path.glob(f"sp.json.{name}.*"))]
        assert len(counts) == 2 and sum(c["tail_here"] for c in counts) == rows * tail
        for gc in (True, False):
            cfg, hf, params = planned(["train.sequence_parallel_size=2", f"data.max_length={length}",
                                       f"train.micro_batch_size={rows}", f"loss.threshold={tail}",
                                       f"model.gradient_checkpointing={str(gc).lower()}"])
            predicted = A.count_activations(cfg, C.build_meta_model(cfg, hf, checkpointing=gc), params, sp=2)
            real = max(c[f"checkpointing_{'on' if gc else 'off'}"] for c in counts)
            assert abs(predicted.total / real - 1) < 0.10, (name, gc, predicted, real)
            whole = A.count_activations(cfg, C.build_meta_model(cfg, hf, checkpointing=gc), params, padded=False)
            assert predicted.decoder < 0.6 * whole.decoder  # the decoder's share halves on 2 ranks


def test_checkpointing_saves_less_and_logits_are_the_tail():
    cfg, hf, params = planned([])
    on = A.count_activations(cfg, C.build_meta_model(cfg, hf, checkpointing=True), params)
    off = A.count_activations(cfg, C.build_meta_model(cfg, hf, checkpointing=False), params)
    assert on.decoder < off.decoder / 5
    # The loss keeps the fp32 log-softmax of B x N tail predictions over V: the head's share is about that.
    B, N, V = cfg.train.micro_batch_size, cfg.loss.threshold, C.TINY_VOCAB
    assert B * N * V * 4 <= on.head < 1.01 * B * N * V * 4 + 4096
    assert on.head == off.head


# ---------------------------------------------------------------------------------------------------------------
# parameters and 4-bit storage


@pytest.mark.parametrize("name,base_params,tied", [("llama-3.2-1b", 1_235_814_400, True),
                                                   ("llama-3.1-8b", 8_030_261_248, False),
                                                   ("llama-3.1-70b", 70_553_706_496, False)])
def test_shipped_model_configs_count_their_published_parameters(name, base_params, tied):
    cfg = load_config(TINY_YAML, [f"model.name_or_path={ROOT / 'configs' / 'models' / f'{name}.json'}"])
    hf = C.load_model_config(cfg.model)
    params = C.census(cfg, C.build_meta_model(cfg, hf))
    assert sum(p.numel for p in params if not p.trainable) == base_params
    assert hf.tie_word_embeddings is tied
    # LoRA r on all 7 linears of every layer: r x (in + out) each
    d, ff, L, kv = hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers, hf.num_key_value_heads * hf.head_dim
    per_layer = (d + d) + 2 * (d + kv) + (d + d) + 3 * (d + ff)
    assert sum(p.numel for p in params if p.trainable) == cfg.lora.r * L * per_layer


@pytest.mark.parametrize("extra", [[], ["model.bnb_4bit_quant_storage=float32"], ["model.bnb_4bit_use_double_quant=false"],
                                   ["model.dtype=bfloat16", "model.bnb_4bit_compute_dtype=bfloat16",
                                    "model.bnb_4bit_quant_storage=bfloat16"]])
def test_4bit_base_equals_a_real_bitsandbytes_model(extra):
    pytest.importorskip("bitsandbytes")
    from scale.modeling.build import build_model

    cfg, hf, params = planned(["model.quantize_4bit=true", *extra])
    predicted = LY.predict_mode(cfg, params, NO_ACTS, "single", 1, hf).weights
    model = build_model(cfg.model, cfg.lora, C.TINY_VOCAB, 0)
    held: dict[int, int] = {}
    for p in model.parameters():
        if p.requires_grad:
            continue
        qs = getattr(p, "quant_state", None)
        tensors = [p.data] + ([qs.absmax, qs.code, qs.offset, *(
            [qs.state2.absmax, qs.state2.code] if qs.state2 is not None else [])] if qs is not None else [])
        for t in tensors:
            if t is not None:
                held[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    assert predicted == sum(held.values())
    assert sum(p.quantized for p in params) == 14  # 7 linears x 2 layers; embedding/LM head stay unquantized


@pytest.mark.parametrize("content", [
    {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
     "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000},
    {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 1000},   # sizes under aliases
])
def test_other_architectures_are_counted_from_their_config(content, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    path = tmp_path / "config.json"
    path.write_text(json.dumps(content))
    cfg = load_config(TINY_YAML, ["train.micro_batch_size=2", "data.max_length=32"])
    plan = P.make_plan(cfg, 2, model_config=str(path))
    real = AutoModelForCausalLM.from_config(AutoConfig.for_model(**content))
    assert plan.parameters - plan.trainable_parameters == sum(p.numel() for p in real.parameters())
    assert plan.activations["checkpointing_on"] < plan.activations["checkpointing_off"]


def test_nf4_layout():
    # 576 x 192 weight: 55,296 packed bytes; 1,728 uint8 absmax; 7 fp32 nested absmax; offset; 256 + 16 fp32 codes
    assert C.nf4_bytes(576 * 192) == (55_296, 64 + 1_728 + 7 * 4 + 4 + 1024)
    assert C.nf4_bytes(576 * 192, double_quant=False) == (55_296, 64 + 1_728 * 4)


# ---------------------------------------------------------------------------------------------------------------
# the command


def plan_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "scale.plan", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, check=False)


def test_json_plan_for_the_tiny_job():
    proc = plan_cli("--config", str(TINY_YAML), "--gpus", "2", "--gpu-mem", "24", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr == ""  # no library warning (peft's deprecated call), no bitsandbytes notice
    plan = json.loads(proc.stdout)
    assert [r["mode"] for r in plan["ranks"]] == list(LY.MODES)
    assert plan["recommended"] == "ddp" and all(plan["fits"].values())  # 2 GPUs: one process would idle one
    assert plan["trainable_parameters"] == 17_408 and plan["parameters"] == 3_245_376
    single, ddp = plan["ranks"][0], plan["ranks"][1]
    assert ddp["gradients"] == 2 * single["gradients"] == 2 * 17_408 * 4
    assert single["total"] == single["allocated"] + single["overhead"]


def test_text_plan_marks_what_does_not_fit(capsys):
    assert P.main(["--config", str(TINY_YAML), "--gpus", "8", "--gpu-mem", "1.5",
                   f"model.name_or_path={ROOT / 'configs' / 'models' / 'llama-3.2-1b.json'}"]) == 0
    out = capsys.readouterr().out
    fits = next(line for line in out.splitlines() if line.startswith("fits in 1.5 GiB")).split()[4:]
    assert fits == ["no", "no", "no", "no", "no", "no", "no"]
    assert "\nrecommended: none fits; lower train.micro_batch_size or data.max_length, use model.quantize_4bit, or " \
           "add GPUs\n" in out  # checkpointing is on already (tiny_cpu): not advised


def test_advice_names_the_4bit_storage_that_lets_zero3_fit(tmp_path):
    """QLoRA with uint8 storage on 2 x 2.7 GiB (Llama-3.2-1B's shape, 2 layers): only the modes that shard the 4-bit
    weights would fit, and they need them stored in the compute dtype. The advice names that key (not
    model.quantize_4bit, which is on) and the mode it unlocks, as that config's own plan finds it; on 2 x 2 GiB
    nothing fits even then, and the key leads the other changes."""
    shape = json.loads((ROOT / "configs" / "models" / "llama-3.2-1b.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**shape, "num_hidden_layers": 2}))
    qlora = ["model.quantize_4bit=true", "model.bnb_4bit_compute_dtype=bfloat16", "model.dtype=bfloat16",
             "train.mixed_precision=bf16", f"model.name_or_path={tmp_path / 'config.json'}"]
    cfg = load_config(TINY_YAML, qlora)
    plan = P.make_plan(cfg, 2, 2.7)
    fixed = P.make_plan(load_config(TINY_YAML, [*qlora, "model.bnb_4bit_quant_storage=bfloat16"]), 2, 2.7)
    assert plan.recommended is None and fixed.recommended == "zero3"
    assert [r.mode for r in plan.ranks if r.refused] == ["zero3", "fsdp2", "zero3_offload"]
    total = next(r.total for r in fixed.ranks if r.mode == "zero3")
    assert f"\nrecommended: none fits; set model.bnb_4bit_quant_storage=bfloat16: then ZeRO-3 fits " \
           f"({total / 2**30:.2f} GiB per rank; ZeRO-3 and FSDP2 shard 4-bit weights only stored in the compute " \
           f"dtype)\n" in P.format_plan(plan)
    assert P.make_plan(cfg, 2, 2.0).advice == (
        "set model.bnb_4bit_quant_storage=bfloat16 (ZeRO-3 and FSDP2 shard 4-bit weights only stored in the compute "
        "dtype), lower train.micro_batch_size or data.max_length, or add GPUs")


@pytest.mark.parametrize("args,message", [
    (["--gpus", "0"], "PlanError: --gpus 0: at least 1 GPU is needed"),
    (["--gpus", "6", "--nodes", "4"], ("PlanError: --gpus 6 is not divisible by --nodes 4: every node runs the same "
                                      "number of processes (num_processes = gpus per node x nodes)")),
    (["--gpus", "2", "--nodes", "0"], "PlanError: --nodes 0: at least 1 node is needed"),
    (["--gpus", "2", "--gpu-mem", "0"], "PlanError: --gpu-mem 0.0: GiB per GPU must be > 0"),
    (["--gpus", "2", "model.name_or_path=meta-llama/Llama-3.1-8B"],
     ("PlanError: model.name_or_path='meta-llama/Llama-3.1-8B' is not a local directory or config.json (there is no "
     "model hub here); pass --model-config PATH/config.json, e.g. configs/models/llama-3.1-8b.json")),
    (["--gpus", "2", "train.micro_batch_size=0"], "ConfigError: train.micro_batch_size=0 must be >= 1"),
])
def test_bad_input_is_one_line_and_exit_2(args, message, capsys):
    assert P.main(["--config", str(TINY_YAML), *args]) == 2
    assert capsys.readouterr().err == f"scale-plan: error: {message}\n"


@pytest.mark.parametrize("content,message", [
    ({"model_type": "llamaa", "hidden_size": 8}, ("has an unknown model type 'llamaa' (transformers knows e.g. llama, "
                                                 "mistral, qwen2, gemma2; remote-code models need their directory and "
                                                 "model.trust_remote_code=true)")),
    ({"model_type": "llama", "hidden_size": 64, "vocab_size": 100},
     ("lacks num_hidden_layers, num_attention_heads: the planner needs the model's sizes (transformers would fill "
     "LlamaConfig's defaults, a different model)")),
    ({"hidden_size": 64}, "has no model_type; it must be a transformers config.json"),
])
def test_bad_model_config_is_one_line_and_exit_2(content, message, tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(content))
    assert P.main(["--config", str(TINY_YAML), "--gpus", "2", "--model-config", str(path)]) == 2
    assert capsys.readouterr().err == f"scale-plan: error: PlanError: model config {str(path)!r} {message}\n"


@pytest.mark.parametrize("overrides", [[], ["train.mixed_precision=bf16", "model.gradient_checkpointing=every_n"],
                                       ["model.quantize_4bit=true", "train.mixed_precision=bf16",
                                        "model.bnb_4bit_compute_dtype=bfloat16"]],
                         ids=["fp32", "bf16-every-n", "qlora"])
def test_single_only_plan_is_the_full_plans_single_row(overrides):
    """The probe ``largest_micro_batch`` runs (``single_only``) gives the very Rank the full plan's single row has."""
    cfg, _hf, _ = planned(["data.max_length=64", *overrides])
    full, probe = P.make_plan(cfg, 1, 80.0), P.make_plan(cfg, 1, 80.0, single_only=True)
    assert [r.mode for r in probe.ranks] == ["single"] and full.ranks[0].mode == "single"
    assert probe.ranks[0] == full.ranks[0]


def test_largest_micro_batch_is_the_last_that_fits():
    """The micro-batch ``largest_micro_batch`` returns fits the memory fraction by the plan's own total and one more
    row does not; a device smaller than one row's plan gets 0."""
    cfg, _hf, _ = planned(["data.max_length=64"])
    one = P.make_plan(cfg, 1, 80.0).ranks[0].total
    gib = 1.5 * one / C.GIB / 0.9                        # room for ~1.5x one row's plan at fraction 0.9
    b, rank = largest_micro_batch(cfg, gib, 0.9)

    def total(n: int) -> int:
        from dataclasses import replace
        return P.make_plan(replace(cfg, train=replace(cfg.train, micro_batch_size=n)), 1, gib).ranks[0].total

    assert b >= 1 and rank.total == total(b) <= 0.9 * gib * C.GIB < total(b + 1)
    assert largest_micro_batch(cfg, 0.5 * one / C.GIB, 1.0) == (0, None)
