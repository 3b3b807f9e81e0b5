"""``scale-plan`` for full-parameter fine-tuning (``model.finetune=full``): per-rank model states in each launch mode,
every figure derived here by hand from the tiny model's sizes (not read off the planner), beside the ZeRO paper's
(Rajbhandari et al. 2020, arXiv:1910.02054, Figure 1), and which mode fits Llama-3.1-8B / 70B on 8 x 80 GB.

The planned bytes against what each rank really holds on 2 CPU processes: ``benchmarks/full_memory.py`` (and the
LoRA path's counts in ``tests/test_plan.py``, which share :mod:`scale.planner.layouts`).
"""

from __future__ import annotations

import math

import pytest

from scale.config.load import load_config
from scale.planner import census as C
from scale.planner import layouts as LY
from scale.planner.plan import make_plan
from tests.conftest import TINY_YAML
from tests.test_plan import NO_ACTS

BASE = ["log.trackers=[]", "train.gradient_accumulation_steps=1", "model.finetune=full"]
# tiny_cpu.yaml's Llama: vocab (SmolLM2's tokenizer), hidden, MLP width, layers; the head is tied to the embeddings,
# key/value heads = heads, so q, k, v, o are all [H, H]
V, H, I, L = 49152, 64, 128, 2
PSI = V * H + L * (4 * H * H + 3 * H * I + 2 * H) + H  # embeddings + per layer (attention, MLP, 2 norms) + final norm
THRESHOLD = 100_000  # DeepSpeed's stage3_param_persistence_threshold (configs/deepspeed/zero3.json leaves it out)
BUCKET = 500_000_000  # DeepSpeed's reduce_bucket_size default (the shipped JSONs leave it out)


def tiny(precision: str, *extra: str):
    cfg = load_config(TINY_YAML, [*BASE, f"train.mixed_precision={precision}", *extra])
    hf = C.load_model_config(cfg.model)
    return cfg, hf, C.census(cfg, C.build_meta_model(cfg, hf))


def states(mode: str, precision: str, world: int, rank: int = 0) -> dict[str, int]:
    cfg, hf, params = tiny(precision)
    r = LY.predict_mode(cfg, params, NO_ACTS, mode, world, hf, rank=rank)
    return {k: getattr(r, k) for k in ("weights", "trainable", "master", "gradients", "optimizer")}


def test_full_census_trains_every_weight_once():
    _, _, params = tiny("no")
    assert all(p.trainable for p in params)
    assert sum(p.numel for p in params) == PSI == 3_227_968  # the tied head counted once


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_single_and_ddp_keep_fp32_weights_gradients_and_moments(precision):
    # accelerate's autocast leaves the parameters fp32 (they are the masters): 4 weights + 4 gradients + 8 Adam
    assert states("single", precision, 1) == {"weights": 0, "trainable": 4 * PSI, "master": 0, "gradients": 4 * PSI,
                                                  "optimizer": 8 * PSI}
    # DDP also keeps its bucket copy of every gradient (gradient_as_bucket_view=False): 20 bytes per parameter
    assert states("ddp", precision, 2) == {"weights": 0, "trainable": 4 * PSI, "master": 0, "gradients": 8 * PSI,
                                               "optimizer": 8 * PSI}


def aligned(world: int) -> int:
    """ZeRO-1/2's flat buffer: Ψ padded to a multiple of 2 x world (nccl_start_alignment_factor 2)."""
    return math.ceil(PSI / (2 * world)) * 2 * world


@pytest.mark.parametrize("world", [1, 2])
def test_zero12_bf16_full_weights(world):
    part = aligned(world) // world
    # ZeRO-1 with fp32 accumulation is DeepSpeed's BF16_Optimizer: bf16 module and its bf16 gradients, a whole
    # fp32 gradient buffer, the fp32 master partition and the Adam moments' partitions
    assert states("zero1", "bf16", world) == {"weights": 0, "trainable": 2 * aligned(world), "master": 4 * part,
                                                  "gradients": 2 * PSI + 4 * aligned(world), "optimizer": 8 * part}
    # ZeRO-2: the gradients accumulate in an fp32 partition
    assert states("zero2", "bf16", world) == {"weights": 0, "trainable": 2 * aligned(world), "master": 4 * part,
                                                  "gradients": 4 * part, "optimizer": 8 * part}


def test_zero12_fp32_full_weights_two_ranks():
    part = aligned(2) // 2
    # fp32: no cast; DeepSpeed still keeps its own fp32 master partition. ZeRO-1 holds every gradient whole until
    # the end of backward; ZeRO-2's rank 0 keeps the whole gradient of each parameter that overlaps its partition:
    # the partition (Ψ/2 elements) lies inside the embedding (V x H > Ψ/2), whose gradient is kept whole
    assert part < V * H
    z1 = states("zero1", "no", 2)
    assert z1 == {"weights": 0, "trainable": 4 * aligned(2), "master": 4 * part, "gradients": 4 * PSI, "optimizer": 8 * part}
    z2 = states("zero2", "no", 2)
    assert z2 == {"weights": 0, "trainable": 4 * aligned(2), "master": 4 * part, "gradients": 4 * V * H, "optimizer": 8 * part}
    # and one more tensor of the largest parameter's size (the embedding), measured (benchmarks/full_memory.py)
    cfg, hf, params = tiny("no")
    assert LY.predict_mode(cfg, params, NO_ACTS, "zero2", 2, hf).transient == 4 * BUCKET + 4 * V * H
    # rank 1's partition begins inside the embedding too: it keeps the embedding's gradient and every later one
    assert states("zero2", "no", 2, rank=1)["gradients"] == 4 * PSI


@pytest.mark.parametrize("precision,wbytes", [("no", 4), ("bf16", 2)])
@pytest.mark.parametrize("world", [1, 2])
def test_zero3_full_weights(precision, wbytes, world):
    _, _, params = tiny(precision)
    shard = sum(math.ceil(p.numel / world) for p in params)  # every parameter padded to a multiple of N
    small = [p for p in params if p.numel <= THRESHOLD]  # every tensor but the embedding: kept whole as well
    assert [p.numel for p in params if p.numel > THRESHOLD] == [V * H]
    whole = sum(math.ceil(p.numel / world) * world for p in small) if world > 1 else 0
    assert states("zero3", precision, world) == {
        "weights": 0, "trainable": wbytes * (shard + whole), "master": 4 * shard,
        "gradients": 4 * shard + wbytes * BUCKET,  # fp32 partition + the reduce bucket in the module's dtype
        "optimizer": 8 * shard}


@pytest.mark.parametrize("precision", ["no", "bf16"])
@pytest.mark.parametrize("world", [1, 2])
def test_fsdp2_full_weights(precision, world):
    # accelerate's FSDP2 keeps the fp32 parameters (bf16 is autocast in the forward): each rank holds a dim-0 shard of
    # every weight, of its gradient and of Adam's two moments; every dim 0 of the tiny Llama is even, so no padding.
    # Measured on 2 ranks, fp32: 6.16 / 6.16 / 12.31 MiB (benchmarks/full_memory.py, docs/benchmarks.md)
    assert states("fsdp2", precision, world) == {"weights": 0, "trainable": 4 * PSI // world, "master": 0,
                                                 "gradients": 4 * PSI // world, "optimizer": 8 * PSI // world}


def test_zero3_offload_fp32_full_weights_two_ranks():
    """configs/deepspeed/zero3_offload.json (parameters and optimizer offloaded), fp32, 2 ranks, as measured by
    benchmarks/full_memory.py: the device keeps the small (persistent) weights whole and the reduce bucket; host memory
    keeps every parameter's partition (persistent ones too: DeepSpeed's flat CPU buffer), the fp32 master, the
    gradient partition, a second fp32 gradient buffer of the master's size, and Adam's moments: 24 bytes per element
    of the shard."""
    cfg, hf, params = tiny("no")
    r = LY.predict_mode(cfg, params, NO_ACTS, "zero3_offload", 2, hf)
    shard = sum(math.ceil(p.numel / 2) for p in params)
    whole = sum(math.ceil(p.numel / 2) * 2 for p in params if p.numel <= THRESHOLD)
    assert (r.weights, r.trainable, r.master, r.gradients, r.optimizer) == (0, 4 * whole, 0, 4 * BUCKET, 0)
    assert r.host == 24 * shard == 38_735_616  # 36.94 MiB per rank measured


def test_sharded_parts_fall_as_one_over_n():
    """Master and Adam moments (ZeRO-1/2/3) and the gradient partition (ZeRO-2/3) halve from 1 to 2 ranks (padding
    aside: at most 2 x world elements per flat group, 1 per parameter and rank under ZeRO-3)."""
    for mode in ("zero1", "zero2", "zero3"):
        one, two = states(mode, "bf16", 1), states(mode, "bf16", 2)
        for key in ("master", "optimizer") + (("gradients",) if mode == "zero2" else ()):
            assert abs(2 * two[key] - one[key]) <= 2 * 4 * 2 * 21 * 2, (mode, key, one[key], two[key])


def test_zero_paper_figures_and_what_the_harness_adds():
    psi, n = 1000, 8
    assert [LY.zero_paper_bytes(m, psi, n) for m in ("ddp", "zero1", "zero2", "zero3")] == [
        16 * psi, 4 * psi + 12 * psi // n, 2 * psi + 14 * psi // n, 16 * psi // n]
    assert LY.zero_paper_bytes("single", psi, n) is None
    # bf16 on 2 ranks: what differs from the paper, term by term (padding of the flat buffer aside)
    pad = aligned(2) - PSI
    z2 = sum(states("zero2", "bf16", 2).values())
    assert z2 == LY.zero_paper_bytes("zero2", PSI, 2) + 2 * PSI // 2 + 2 * pad + 16 * pad // 2  # fp32 grad partition
    z1 = sum(states("zero1", "bf16", 2).values())
    assert z1 == LY.zero_paper_bytes("zero1", PSI, 2) + 4 * PSI + 6 * pad + 12 * pad // 2  # + whole fp32 gradients
    ddp = sum(states("ddp", "bf16", 2).values())
    assert ddp == LY.zero_paper_bytes("ddp", PSI, 2) + 4 * PSI  # fp32 weights and grads (+4) and DDP's copy (+4)
    cfg, hf, params = tiny("bf16")
    r = LY.predict_mode(cfg, params, NO_ACTS, "zero2", 2, hf)
    assert any(n.startswith("ZeRO paper (Figure 1, 16-bit + Adam) 2Ψ + 14Ψ/N") for n in r.notes), r.notes


LLAMA = ["model.finetune=full", "model.quantize_4bit=false", "model.dtype=float32", "train.mixed_precision=bf16",
         "model.gradient_checkpointing=true", "train.micro_batch_size=1", "data.max_length=2048", "log.trackers=[]"]


@pytest.mark.parametrize("name", ["llama-3.1-8b", "llama-3.1-70b"])
def test_llama_model_states_on_8_ranks(name):
    """The model states alone (no activations: seconds, where the whole plan below takes a minute), by hand."""
    cfg = load_config(None, LLAMA)
    hf = C.load_model_config(cfg.model, name)
    params = C.census(cfg, C.build_meta_model(cfg, hf, checkpointing=True))
    psi, gib = sum(p.numel for p in params), 2**30
    assert all(p.trainable for p in params)
    by = {m: LY.predict_mode(cfg, params, NO_ACTS, m, 8, hf) for m in ("ddp", "zero2", "zero3")}
    assert by["ddp"].model_states == 20 * psi
    part = math.ceil(psi / 16) * 16 // 8
    assert by["zero2"].model_states == 2 * 8 * part + 16 * part
    assert by["zero3"].model_states >= 18 * psi // 8
    if name == "llama-3.1-70b":  # ZeRO-3's states alone (18 bytes / 8 per parameter) are over 80 GiB
        assert by["zero3"].model_states > 80 * gib
    else:
        assert by["zero2"].model_states < 40 * gib


@pytest.mark.heavy
@pytest.mark.parametrize("name", ["llama-3.1-8b", "llama-3.1-70b"])
def test_which_mode_fits_llama_on_8_x_80_gb(name):
    cfg = load_config(None, LLAMA)
    plan = make_plan(cfg, gpus=8, gpu_mem_gib=80, model_config=name)
    psi, gib = plan.parameters, 2**30
    assert plan.trainable_parameters == psi
    by = {r.mode: r for r in plan.ranks}
    # model states by hand (bf16: DeepSpeed's bf16 module; autocast keeps fp32 parameters under DDP/FSDP2)
    assert by["ddp"].model_states == 20 * psi  # fp32 weights 4 + gradients 4 + bucket copy 4 + Adam 8
    assert by["fsdp2"].optimizer >= 8 * psi // 8
    part = math.ceil(psi / 16) * 16 // 8
    assert by["zero2"].model_states == 2 * 8 * part + 16 * part  # bf16 module (8 partitions) + fp32 master, grads, Adam
    zero3_floor = (2 + 4 + 4 + 8) * psi // 8  # bf16 weights, fp32 master, fp32 gradients, Adam, each 1/8
    assert by["zero3"].model_states >= zero3_floor
    assert not plan.fits["ddp"] and 20 * psi > 80 * gib
    if name == "llama-3.1-8b":  # ZeRO-2's states are 4Ψ = 30 GiB: it fits; DDP's 20Ψ = 150 GiB does not
        assert 4 * psi < 40 * gib and plan.fits["zero2"]
        assert plan.recommended in ("zero1", "zero2")
    else:  # 70B: ZeRO-3's states alone, 18Ψ/8 = 147 GiB, are over 80 GiB; only offloading fits
        assert zero3_floor > 80 * gib and not plan.fits["zero3"] and not plan.fits["fsdp2"]
        assert plan.recommended == "zero3_offload"
        assert by["zero3_offload"].host >= (4 + 4 + 8) * psi // 8  # master, gradients, Adam in host memory


def reference_bytes(mode: str, precision: str, world: int, *extra: str) -> int:
    cfg, hf, params = tiny(precision, *extra)
    return LY.predict_mode(cfg, params, NO_ACTS, mode, world, hf).reference


DPO = ["loss.objective=dpo", "data.format=preference"]  # model.finetune=full: loss.reference resolves to model


@pytest.mark.parametrize("precision,wbytes", [("no", 4), ("bf16", 2)])
def test_the_frozen_reference_of_full_weights_per_rank(precision, wbytes):
    """DPO's loss.reference=model and GRPO's rl.beta > 0 on full weights keep a second copy of every weight, in the
    dtype the forward reads: whole and fp32 under one device and DDP (autocast reads the fp32 parameters), whole in
    DeepSpeed's dtype under ZeRO-1/2 (stage 0), 1/N under ZeRO-3 (each partition ceil(n/2), and the tensors at or
    below the persistence threshold whole as well: every one but the embedding) and FSDP2 (dim-0 halves: every
    tensor's rows are even). Hand counts from the tiny model's sizes."""
    assert reference_bytes("single", precision, 1, *DPO) == 4 * PSI
    assert reference_bytes("ddp", precision, 2, *DPO) == 4 * PSI
    for mode in ("zero1", "zero2"):
        assert reference_bytes(mode, precision, 2, *DPO) == wbytes * PSI
    small = PSI - V * H  # every tensor but the embedding, all of even size: partition n/2 plus the whole n
    assert reference_bytes("zero3", precision, 2, *DPO) == wbytes * (V * H // 2 + small // 2 + small)
    assert reference_bytes("fsdp2", precision, 2, *DPO) == 4 * PSI // 2
    grpo = ["loss.objective=grpo", "data.format=prompts", "rl.num_generations=2", "rl.max_completion_length=4",
            "rl.rewards=[{fn: exact_match, column: answer}]"]
    assert reference_bytes("zero3", precision, 2, *grpo, "rl.beta=0.1") == reference_bytes("zero3", precision, 2, *DPO)
    # none kept: a precomputed reference, GRPO without a KL term, SFT, and LoRA (its reference is the adapter off)
    for extra in ([*DPO, "loss.reference=precomputed"], [*grpo, "rl.beta=0"], []):
        assert reference_bytes("zero3", precision, 2, *extra) == 0
    cfg = load_config(TINY_YAML, ["log.trackers=[]", *DPO])
    hf = C.load_model_config(cfg.model)
    assert LY.predict_mode(cfg, C.census(cfg, C.build_meta_model(cfg, hf)), NO_ACTS, "ddp", 2, hf).reference == 0
