"""Sequence parallelism in one process: the shard bookkeeping (labels shifted before the split, per-shard tails and
weights, exact zeros), the evaluation layout, the guards and the gradient scale per mode.

The ranks' attention is what Ulysses joins (tests/test_sequence_launch.py runs it on 2 processes). Here every shard's
forward is taken from ONE forward of the whole padded rows (the shards concatenated): exactly what the joined
attention computes, so the tail bookkeeping of each shard can be checked against one device's loss to round-off.
"""

from __future__ import annotations

import pytest
import torch

from scale.config.load import load_config
from scale.config.validation import ConfigError
from scale.data import Collator, Example
from scale.data.sequence import ShardCollator, padded_length, shard_padded, shard_rows
from scale.loss.chunked import chunked_tail_loss
from scale.loss.tail import batch_bad_rows, describe_batch_row, forward_tail, tail_loss, token_weights
from scale.modeling.attention import SEQUENCE_PARALLEL_ATTENTION, check_sequence_parallel, sequence_parallel_problem
from tests.conftest import TINY_YAML


def _model(seed: int = 0, vocab: int = 40):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).double().eval()


def _examples(seed: int = 1) -> list[Example]:
    g = torch.Generator().manual_seed(seed)
    specs = [(11, 3, None, 0), (7, 2, None, 1), (13, 5, [1, 1, 0, 0, 1], 0), (6, 1, None, 1), (16, 9, None, 1)]
    return [Example(torch.randint(1, 40, (n,), generator=g).tolist(), t, trained=fl, type_indicator=ty, row=i)
            for i, (n, t, fl, ty) in enumerate(specs)]


def _whole(shards: list[dict]) -> dict[str, torch.Tensor]:
    """The rows the shards were cut from (every rank's shard, concatenated along the sequence)."""
    return {k: torch.cat([s[k] for s in shards], 1) for k in ("input_ids", "position_ids")}


class _Joined(torch.nn.Module):
    """``model(shard)`` for rank ``r``: the whole rows' forward (what the group's joined attention computes), sliced
    to the shard's columns and to ``logits_to_keep``."""

    def __init__(self, model, shards: list[dict], r: int) -> None:
        super().__init__()
        self.model, self.whole, self.r, self.C = model, _whole(shards), r, shards[r]["input_ids"].shape[1]

    def get_output_embeddings(self):
        return self.model.get_output_embeddings()

    def forward(self, input_ids, position_ids, logits_to_keep, use_cache):
        out = self.model(input_ids=self.whole["input_ids"], position_ids=self.whole["position_ids"], use_cache=False)
        out.logits = out.logits[:, self.r * self.C:(self.r + 1) * self.C][:, logits_to_keep]
        return out


def _shard_logits(model, shards: list[dict], r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``r``'s ``forward_tail`` on its shard, with the attention the group's ranks compute together."""
    return forward_tail(_Joined(model, shards, r), shards[r])


@pytest.mark.parametrize("N", [1, 2, 3, 4])
@pytest.mark.parametrize("type_weights", [None, [0.5, 2.0]])
def test_shards_sum_to_one_device_loss(N, type_weights):
    """Each shard's tail loss (its own predictions, targets shifted before the split) sums to the padded batch's."""
    model, ex = _model(), _examples()
    batch = Collator(0, "left")(ex)
    logits, targets = forward_tail(model, batch)
    ref_num, ref_den = tail_loss(logits, targets, token_weights(batch["type_indicator"], batch["tail_mask"],
                                                                type_weights))
    shards = [shard_rows([[e] for e in ex], r, N, 0) for r in range(N)]
    num = den = 0.0
    for r, sh in enumerate(shards):
        assert sh["input_ids"].shape[1] == padded_length(16, N) // N
        lg, tg = _shard_logits(model, shards, r)
        n, d = tail_loss(lg, tg, token_weights(sh["type_indicator"], sh["tail_mask"], type_weights))
        num, den = num + n, den + d
    assert float(den) == float(ref_den) == (18.0 if type_weights is None else float(ref_den))  # 3+2+3+1+9
    assert abs(float(num) - float(ref_num)) <= 1e-12 * abs(float(ref_num))


def test_labels_shifted_before_the_split():
    """A tail token that opens the second shard is predicted by the first shard's last position, against that token."""
    e = Example(list(range(1, 9)), 4)  # 8 tokens, tail = tokens 4..7 (ids 5..8), predicted at positions 3..6
    r0, r1 = (shard_rows([[e]], r, 2, 0) for r in (0, 1))
    assert r0["input_ids"].tolist() == [[1, 2, 3, 4]] and r1["input_ids"].tolist() == [[5, 6, 7, 8]]
    assert r0["shard_index"].tolist() == [[3]] and r0["shard_targets"].tolist() == [[5]]       # position 3 -> id 5
    assert r1["shard_index"].tolist() == [[0, 1, 2]] and r1["shard_targets"].tolist() == [[6, 7, 8]]
    assert r0["position_ids"].tolist() == [[0, 1, 2, 3]] and r1["position_ids"].tolist() == [[4, 5, 6, 7]]


def test_shard_without_tail_is_an_exact_zero_never_nan():
    """The normal case for a tail: the first shard holds none. Its weights sum to 0 and its numerator is 0.0 (also
    under a criterion returning a mean, whose mean of nothing would be NaN), and backward still reaches the model."""
    model = _model().float().train()
    ex = [Example(list(range(1, 13)), 2), Example(list(range(3, 15)), 3)]
    shards = [shard_rows([[e] for e in ex], r, 2, 0) for r in range(2)]
    assert shards[0]["tail_mask"].sum() == 0 and shards[0]["tail_mask"].shape == (2, 1)
    lg, tg = _shard_logits(model, shards, 0)
    w = token_weights(shards[0]["type_indicator"], shards[0]["tail_mask"], None)
    num, den = tail_loss(lg, tg, w)
    assert float(num) == 0.0 and float(den) == 0.0
    mean_ce = lambda logits, labels: torch.nn.functional.cross_entropy(logits, labels)
    num_c, den_c = tail_loss(lg, tg, w, criterion=mean_ce)
    assert float(num_c) == 0.0 and float(den_c) == 0.0 and not torch.isnan(num_c)
    (num_c * 3.0).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(float(g.abs().max()) == 0.0 for g in grads)  # reached, exactly zero
    assert not batch_bad_rows(shards[0]).any()


def test_chunked_loss_per_shard_equals_unchunked():
    """The chunked tail loss (LM head one chunk at a time) on each shard's hidden states equals its unchunked loss."""
    from scale.loss.chunked import forward_tail_hidden

    model, ex = _model(), _examples()
    shards = [shard_rows([[e] for e in ex], r, 2, 0) for r in range(2)]
    for r, sh in enumerate(shards):
        lg, tg = _shard_logits(model, shards, r)
        w = token_weights(sh["type_indicator"], sh["tail_mask"], None)
        ref, _ = tail_loss(lg, tg, w)
        joined = _Joined(model, shards, r)
        hidden, targets = forward_tail_hidden(joined, sh)
        assert torch.equal(targets, tg)
        got, _ = chunked_tail_loss(joined, hidden, targets, w, chunk=2)
        assert abs(float(got) - float(ref)) <= 1e-12 * max(1.0, abs(float(ref)))


def test_packed_rows_share_one_row_with_restarting_positions():
    ex = _examples()[:3]
    full = shard_rows([ex], 0, 1, 0)
    assert full["input_ids"].shape == (1, 31)  # 11 + 7 + 13 tokens, one row
    assert full["position_ids"][0, :18].tolist() == list(range(11)) + list(range(7))
    halves = [ShardCollator(r, 2, 0, one_row=True)([[e] for e in ex]) for r in range(2)]
    assert [h["input_ids"].shape for h in halves] == [(1, 16), (1, 16)]
    assert sum(int(h["tail_mask"].sum()) for h in halves) == 3 + 2 + 3
    assert sum(int(h["shard_tokens"]) for h in halves) == 31 and [int(h["sp_first"]) for h in halves] == [1, 0]


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("N", [2, 3])
def test_padded_batch_as_shards_gives_one_device_logits(side, N):
    """Evaluation: the logits a padded batch's forward_tail asks for, computed on the shards and summed over the group
    (each on exactly one shard), equal the padded forward's (left or right padding)."""
    model, ex = _model(), _examples()
    batch = Collator(0, side)(ex)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    T = ids.shape[1]
    keep = torch.arange(T - 10, T - 1)
    ref = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                logits_to_keep=keep).logits
    parts = [shard_padded(ids, mask, keep, r, N) for r in range(N)]
    whole = model(input_ids=torch.cat([p[0] for p in parts], 1), position_ids=torch.cat([p[1] for p in parts], 1)).logits
    C = parts[0][0].shape[1]
    total = torch.zeros_like(ref)
    for r, (_, _, local, here) in enumerate(parts):
        assert (sum(p[3].long() for p in parts) == 1).all()  # every wanted logit on exactly one shard
        mine = whole[:, r * C:(r + 1) * C].gather(1, local[..., None].expand(-1, -1, ref.shape[-1]))
        total = total + mine.masked_fill(~here[..., None], 0.0)
    real = keep[None, :] >= mask.argmax(1)[:, None] if side == "left" else keep[None, :] < mask.sum(1)[:, None]
    assert torch.equal(total[real], ref[real].to(total.dtype)) or float((total - ref)[real].abs().max()) < 1e-12


def test_bad_row_is_named_from_the_whole_example():
    sh = shard_rows([[Example([1, 2, 3], 3, row=41)]], 0, 2, 0)
    assert batch_bad_rows(sh).tolist() == [True]
    assert "data-file row 41" in describe_batch_row(sh) and "needs at least 4" in describe_batch_row(sh)


def test_metrics_count_rows_once_per_group():
    from scale.training.metrics import StepMeter

    ex = _examples()
    meters = [StepMeter(torch.device("cpu"), lambda b, t, k=0: float(b * t), sequence_parallel_size=2) for _ in "ab"]
    for r, meter in enumerate(meters):
        sh = shard_rows([[e] for e in ex], r, 2, 0)
        meter.add_micro(torch.tensor(1.0), sh["tail_mask"].sum().float(), sh)
    total = sum(m.sums for m in meters)
    keys = dict(zip(meters[0].KEYS, total.tolist()))
    assert keys["samples"] == 5 and keys["tokens"] == sum(len(e.input_ids) for e in ex) and keys["tail_tokens"] == 18
    assert keys["positions"] == 5 * 16 and keys["flops"] == 5 * 16  # b x t over the group: the rows' count once


# --- guards ---------------------------------------------------------------------------------------------------------

def _config(name: str, **kw):
    import transformers

    return getattr(transformers, name)(**kw)


@pytest.mark.parametrize("name, kw, attn, n, packed, expect", [
    ("LlamaConfig", {"num_attention_heads": 4, "num_key_value_heads": 2}, "sdpa", 2, False, None),
    ("LlamaConfig", {"num_attention_heads": 4, "num_key_value_heads": 1}, "sdpa", 4, False, None),  # kv replicated
    ("LlamaConfig", {}, "eager", 2, False, "is not an attention the sequence-parallel attention can wrap"),
    ("LlamaConfig", {"hidden_size": 384, "num_attention_heads": 6, "num_key_value_heads": 6}, "sdpa", 4, False,
     "6 attention heads do not divide among train.sequence_parallel_size=4"),
    ("LlamaConfig", {"hidden_size": 384, "num_attention_heads": 12, "num_key_value_heads": 3}, "sdpa", 4, False,
     "3 key/value heads neither divide"),
    ("LlamaConfig", {}, "sdpa", 2, True, "several examples share a row"),
    ("LlamaConfig", {}, "flash_attention_2", 2, True, None),
    ("MistralConfig", {"sliding_window": 64}, "sdpa", 2, False, "sliding_window=64"),
    ("MistralConfig", {"sliding_window": 4096}, "sdpa", 2, False, None),  # the window covers every row
    ("Qwen2Config", {"sliding_window": 64, "use_sliding_window": False}, "sdpa", 2, False, None),
    ("Gemma2Config", {}, "sdpa", 2, False, "'sliding_attention' attention"),
    ("Qwen3NextConfig", {}, "sdpa", 2, False, "'linear_attention' layers"),
    ("DeepseekV3Config", {}, "sdpa", 2, False, "latent or unequal query/value heads"),
])
def test_sequence_parallel_refuses_what_ulysses_cannot_wrap(name, kw, attn, n, packed, expect):
    why = sequence_parallel_problem(_config(name, **kw), attn, n, packed, max_length=1024)
    assert (why is None) if expect is None else (expect in why), why


def test_check_names_the_key_and_passes_size_one():
    model = _model()
    check_sequence_parallel(model, load_config(TINY_YAML).model, 1, True, 64)  # off: nothing to check
    with pytest.raises(ConfigError, match=r"^train.sequence_parallel_size=2 cannot be exact here: .*eager"):
        check_sequence_parallel(model, load_config(TINY_YAML, ["model.attn_implementation=eager"]).model, 2,
                                False, 64)
    assert SEQUENCE_PARALLEL_ATTENTION[0] == "sdpa"


EAGER_UNDER_SP = ("train.sequence_parallel_size=2 cannot be exact here: model.attn_implementation=eager is not an "
                  "attention the sequence-parallel attention can wrap (Ulysses drops the [T, T] mask eager needs); "
                  "set model.attn_implementation=sdpa (or null), or flash_attention_2 on a GPU")


def test_attention_is_refused_from_the_config_before_the_accelerator(monkeypatch, tmp_path):
    """The config alone decides it: scale.training.job.setup raises before build_accelerator is called (accelerate's own
    check would fire inside Accelerator() with a ValueError on every rank)."""
    import scale.training.job as job
    import scale.training.parts.launch
    from scale.modeling.attention import check_sequence_parallel_config

    eager = load_config(TINY_YAML, ["model.attn_implementation=eager", "train.sequence_parallel_size=2"])
    with pytest.raises(ConfigError) as e:
        check_sequence_parallel_config(eager.model, 2)
    assert str(e.value) == EAGER_UNDER_SP
    check_sequence_parallel_config(eager.model, 1)  # no sequence parallelism: eager is fine
    check_sequence_parallel_config(load_config(TINY_YAML).model, 2)  # null: sdpa

    def built(*args, **kwargs):
        raise AssertionError("the Accelerator was built before the sequence-parallel attention was checked")

    monkeypatch.setattr(scale.training.parts.launch, "build_accelerator", built)  # where setup's launch part builds it
    eager.output_dir = str(tmp_path / "out")
    with pytest.raises(ConfigError) as e:
        job.setup(eager)
    assert str(e.value) == EAGER_UNDER_SP and not (tmp_path / "out").exists()


def test_accelerate_refusing_the_parallelism_config_is_one_line():
    """Whatever accelerate's own checks refuse when ParallelismConfig is built (the installed version decides:
    1.16 refuses eager and flex_attention) is a ConfigError naming the keys, raised before any Accelerator."""
    from scale.distributed.launch import sequence_parallelism_config

    cfg = load_config(TINY_YAML, ["model.attn_implementation=eager", "train.sequence_parallel_size=2"])
    with pytest.raises(ConfigError) as e:
        sequence_parallelism_config(cfg, 2)
    msg = str(e.value)
    assert msg.startswith("train.sequence_parallel_size=2 with model.attn_implementation=eager on 2 process(es): "
                          "accelerate ") and "eager" in msg.split("refuses it (", 1)[1]
    assert msg.endswith("; set model.attn_implementation=sdpa (or null), or train.sequence_parallel_size=1")
    assert "\n" not in msg
    pc = sequence_parallelism_config(load_config(TINY_YAML, ["train.sequence_parallel_size=2"]), 4)
    assert (pc.sp_size, pc.dp_shard_size, pc.sp_handler.sp_attn_implementation) == (2, 2, "sdpa")


def test_config_rejects_size_zero_and_global_batch_counts_data_parallel_ranks():
    with pytest.raises(ConfigError, match=r"train.sequence_parallel_size=0 must be >= 1"):
        load_config(TINY_YAML, ["train.sequence_parallel_size=0"])
    t = load_config(TINY_YAML, ["train.micro_batch_size=4", "train.gradient_accumulation_steps=2"]).train
    assert t.global_batch_size(8 // 2) == 4 * 2 * 4


def test_guard_launch_before_the_accelerator_is_built(monkeypatch, tmp_path):
    """N > 1 outside DeepSpeed, and N not dividing the process count: one line each, before any process group."""
    from scale.distributed import launch

    class NeverBuilt:
        def __init__(self, **kwargs):
            raise AssertionError("the Accelerator must not be built")

    monkeypatch.setattr(launch, "Accelerator", NeverBuilt)
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = load_config(TINY_YAML, [f"output_dir={tmp_path / 'run'}", "train.sequence_parallel_size=2"])
    with pytest.raises(launch.LaunchError, match=r"^train.sequence_parallel_size=2 needs a DeepSpeed launch"):
        launch.build_accelerator(cfg)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(launch.LaunchError, match=r"^train.sequence_parallel_size=2 does not divide the 3 launched"):
        launch.build_accelerator(cfg)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("zero, expect", [(1, 2), (2, 2), (3, 4)])
def test_gradient_scale_per_zero_stage(zero, expect):
    """ZeRO-1/2 divide the summed gradient by world / N (the group's ranks are summed); ZeRO-3's reduce-scatter by the
    world: the loop multiplies back by that (4 processes, N = 2 here)."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from scale.distributed.launch import LaunchError, plan_for_mode

    ds = {"zero_optimization": {"stage": zero}}
    acc = SimpleNamespace(distributed_type=DistributedType.DEEPSPEED, num_processes=4, local_process_index=0,
                          device=torch.device("cpu"),
                          state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=zero, deepspeed_config=ds)))
    plan = plan_for_mode(load_config(TINY_YAML, ["train.sequence_parallel_size=2"]), acc)
    assert (plan.data_parallel_size, plan.sequence_parallel_size, plan.gradient_average_size) == (2, 2, expect)
    plain = plan_for_mode(load_config(TINY_YAML), acc)
    assert (plain.data_parallel_size, plain.gradient_average_size) == (4, 4)
    if zero == 3:
        ds["zero_optimization"]["reduce_scatter"] = False
        with pytest.raises(LaunchError, match="reduce_scatter=false under ZeRO-3"):
            plan_for_mode(load_config(TINY_YAML, ["train.sequence_parallel_size=2"]), acc)
