"""Mixture-of-experts models (scale.modeling.moe): what LoRA trains, proven on tiny models built from their configs.

Families: Qwen3-MoE, Mixtral, DeepSeek-V3 (shared experts, a dense first layer), gpt-oss (transposed fused weights,
biases). transformers 5 fuses each layer's experts into 3-D parameters; LoRA reaches them through peft's
``target_parameters`` (one LoRA pair per expert).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from scale.config.load import ConfigError
from scale.config.schema import LoraConfig, ModelConfig
from scale.loss.tail import forward_tail
from scale.modeling.build import add_lora
from scale.modeling.moe import expert_factors, is_parameter_adapter, moe_layout, parameter_adapters, targets_line
from scale.modeling.moe_lora import is_split
from scale.training.parts.experts import ExpertLoad, RouterAux
from scale.utils.compat import peft_adapts_parameters
from tests.bounds import fp32_paths_rel

# LoRA on fused experts needs peft's target_parameters (peft 0.17); the lowest-versions tier (peft 0.15) runs
# tests/test_compat.py's refusal test instead.
pytestmark = pytest.mark.skipif(not peft_adapts_parameters(), reason="peft without target_parameters (< 0.17)")


E, K, H, I, V = 8, 2, 32, 16, 64  # experts, experts per token, hidden, expert width, vocabulary


def tiny_moe(family: str, seed: int = 0, vocab: int = V) -> torch.nn.Module:
    """A 2-layer random model of ``family`` (8 experts, top-2) in float32; ``vocab=49152`` fits the SmolLM2
    tokenizer of the tiny job (its bos/eos/pad ids set)."""
    import transformers as tf

    common = dict(vocab_size=vocab, hidden_size=H, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, tie_word_embeddings=False)
    if vocab != V:
        common.update(bos_token_id=1, eos_token_id=2, pad_token_id=2, max_position_embeddings=256)
    torch.manual_seed(seed)
    if family == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(**common, intermediate_size=64, moe_intermediate_size=I, num_experts=E,
                                num_experts_per_tok=K, head_dim=8, decoder_sparse_step=1)
        return tf.Qwen3MoeForCausalLM(cfg)
    if family == "mixtral":
        return tf.MixtralForCausalLM(tf.MixtralConfig(**common, intermediate_size=I, num_local_experts=E,
                                                      num_experts_per_tok=K))
    if family == "deepseek_v3":  # multi-head latent attention: as many key/value heads as query heads
        cfg = tf.DeepseekV3Config(**(common | {"num_key_value_heads": 4}), intermediate_size=64, moe_intermediate_size=I, n_routed_experts=E,
                                  num_experts_per_tok=K, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
                                  topk_group=1, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
                                  qk_nope_head_dim=8, v_head_dim=16)
        return tf.DeepseekV3ForCausalLM(cfg)
    if family == "gpt_oss":
        cfg = tf.GptOssConfig(**common, intermediate_size=I, num_local_experts=E, num_experts_per_tok=K, head_dim=8,
                              layer_types=["full_attention"] * 2)
        return tf.GptOssForCausalLM(cfg)
    raise ValueError(family)


FAMILIES = ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"]


def lora(model: torch.nn.Module, **kw) -> torch.nn.Module:
    checkpointing = kw.pop("checkpointing", False)
    defaults = LoraConfig()  # the schema's defaults: r=16, alpha=32, dropout=0.05, all-linear, router frozen
    args = {"r": 4, "alpha": 8.0, "dropout": defaults.dropout, "target_modules": defaults.target_modules} | kw
    return add_lora(model, ModelConfig(gradient_checkpointing=checkpointing), LoraConfig(**args))


@pytest.mark.parametrize("family", FAMILIES)
def test_all_linear_adapts_attention_and_every_expert_not_the_router(family):
    base = tiny_moe(family)
    layout = moe_layout(base)
    assert layout is not None and layout.num_experts == E and layout.top_k == K
    linear = {n for n, m in base.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = lora(base)  # lora.dropout left at the schema's 0.05
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning) or "peft" in (w.filename or "")], \
        [str(w.message) for w in caught]
    adapted = parameter_adapters(model)
    assert sorted(adapted) == sorted(layout.expert_params)  # every fused expert weight, nothing else
    assert all(adapted[n].num_experts == E for n in adapted)
    lora_linear = {n.removeprefix("base_model.model.") for n, m in model.named_modules()
                   if hasattr(m, "lora_A") and not is_parameter_adapter(m)}
    assert lora_linear == linear - set(layout.router_linears)  # attention, shared experts, dense MLPs
    routers = set(layout.routers)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert not [n for n in trainable if any(f"{r}." in n for r in routers)]
    assert all("lora_" in n for n in trainable)
    # the linear adapters keep lora.dropout, the expert adapters run without (peft cannot drop their input)
    for name, module in model.named_modules():
        if hasattr(module, "lora_dropout") and "default" in module.lora_dropout:
            drop = module.lora_dropout["default"]
            if is_parameter_adapter(module):
                assert isinstance(drop, torch.nn.Identity), name
            else:
                assert isinstance(drop, torch.nn.Dropout) and drop.p == 0.05, name
    line = "; ".join(targets_line(model, layout, 0.05, False))
    assert f"experts {E} x {len(layout.experts)} layers" in line and "router frozen" in line
    assert f"attention {4 if family != 'deepseek_v3' else 4} x 2 layers" in line


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_train_router_adds_a_router_adapter(family):
    model = lora(tiny_moe(family), train_router=True)
    layout = moe_layout(model)
    adapted = parameter_adapters(model)
    assert sorted(adapted) == sorted(layout.expert_params + layout.router_params)
    assert "router trained (LoRA on 2 router weights)" in targets_line(model, layout, 0.0, False)[0]


def test_a_listed_name_that_matches_nothing_is_refused():
    with pytest.raises(ConfigError, match=r"lora.target_modules: \['w9'\]"):
        lora(tiny_moe("qwen3_moe"), target_modules=["q_proj", "w9"])
    with pytest.raises(ConfigError, match=r"^lora.target_modules: \['gate'\] match no linear layer or expert weight "
                                          r"of this qwen3_moe model \(routers train with lora.train_router=true\)"):
        lora(tiny_moe("qwen3_moe"), target_modules=["q_proj", "gate"])
    model = lora(tiny_moe("qwen3_moe"), target_modules=["q_proj", "down_proj"])
    assert sorted(n.rsplit(".", 1)[-1] for n in parameter_adapters(model)) == ["down_proj"] * 2


def routing(model: torch.nn.Module, layout) -> tuple[list, list]:
    """Hooks recording each router's ``(weights [n, k], indices [n, k])`` per forward."""
    seen: list = []
    modules = dict(model.named_modules())
    handles = []
    for name in layout.routers:
        mod = modules.get(f"base_model.model.{name}", modules.get(name))
        handles.append(mod.register_forward_hook(lambda _m, _a, out: seen.append((out[1].detach(), out[2]))))
    return seen, handles


def peft_layout_delta(wrapper: torch.nn.Module, e: int) -> torch.Tensor:
    """Expert ``e``'s LoRA update ``scaling * B_e @ A_e`` (``[out, in]``), read from peft's flat factors by hand:
    ``lora_A`` is ``[r * E, in]`` with expert ``e`` in rows ``e*r .. e*r+r-1``; ``lora_B`` is ``[out, r * E]`` with
    column ``j * E + e`` the ``j``-th of expert ``e`` (peft ``ParamWrapper.get_delta_weight``)."""
    a, b = wrapper.lora_A["default"].weight, wrapper.lora_B["default"].weight
    r = a.shape[0] // E
    a_e = a[e * r:(e + 1) * r]                               # [r, in]
    b_e = b[:, [j * E + e for j in range(r)]]                # [out, r]
    return wrapper.scaling["default"] * (b_e @ a_e)


class ReferenceExperts(torch.nn.Module):
    """The experts of one layer computed token by token, expert by expert: ``y_t = sum_j w_tj * down_e(gate(gate_up_e
    x_t))`` with each expert's weight ``W_e + scaling * B_e A_e`` assembled by hand (no peft code) and the family's
    gate written out: SwiGLU ``silu(g) * u`` over ``[gate; up]`` halves, or gpt-oss's clamped GLU over interleaved
    columns with biases (its weights stored transposed, ``[E, in, out]``)."""

    def __init__(self, experts: torch.nn.Module, w_gate_up, w_down) -> None:
        super().__init__()
        tr = experts.is_transposed

        def weight(p: torch.Tensor, wrapper, e: int) -> torch.Tensor:  # [out, in]
            return (p[e].T if tr else p[e]) + peft_layout_delta(wrapper, e)

        self.gate_up = torch.stack([weight(experts.gate_up_proj, w_gate_up, e) for e in range(E)]).detach()
        self.down = torch.stack([weight(experts.down_proj, w_down, e) for e in range(E)]).detach()
        self.gpt_oss = type(experts).__name__ == "GptOssExperts"
        if self.gpt_oss:
            self.biases = (experts.gate_up_proj_bias.detach(), experts.down_proj_bias.detach())
            self.limit, self.alpha = experts.limit, experts.alpha
        else:
            assert experts.config.hidden_act == "silu"

    def forward(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for j in range(idx.shape[1]):
                e = int(idx[t, j])
                gu = self.gate_up[e] @ x[t]
                if self.gpt_oss:
                    gu = gu + self.biases[0][e]
                    g, u = gu[::2].clamp(max=self.limit), gu[1::2].clamp(-self.limit, self.limit)
                    y = self.down[e] @ ((u + 1) * g * torch.sigmoid(g * self.alpha)) + self.biases[1][e]
                else:
                    g, u = gu.chunk(2)
                    y = self.down[e] @ (torch.nn.functional.silu(g) * u)
                out[t] += w[t, j].to(x.dtype) * y
        return out


def with_reference_experts(model: torch.nn.Module, layout) -> torch.nn.Module:
    """A float64 copy of ``model`` whose expert modules are :class:`ReferenceExperts` (attention keeps peft's LoRA:
    what is checked is the experts' update and routing)."""
    ref = copy.deepcopy(model).double()
    ref.get_base_model().set_experts_implementation("eager")  # the router call stays the model's own
    adapters = parameter_adapters(ref)
    for name in layout.experts:
        parent_name, _, leaf = name.rpartition(".")
        parent = ref.get_submodule(f"base_model.model.{parent_name}")
        experts = ref.get_submodule(f"base_model.model.{name}").get_base_layer()
        setattr(parent, leaf, ReferenceExperts(experts, adapters[f"{name}.gate_up_proj"],
                                               adapters[f"{name}.down_proj"]))
    return ref


def tail_ce(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    logits, targets = forward_tail(model, batch, threshold=2)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).to(torch.float64),
                                             targets.reshape(-1), reduction="mean")


@pytest.mark.parametrize("impl", [None, "peft"])  # null: the split path on these layouts
@pytest.mark.parametrize("family", FAMILIES)
def test_one_step_trains_exactly_the_experts_that_received_tokens(family, impl):
    torch.manual_seed(1)
    model = lora(tiny_moe(family), checkpointing=True, expert_impl=impl)  # checkpointing recomputes the routers
    paths = [is_split(model.get_submodule(f"base_model.model.{n}")) for n in moe_layout(model).experts]
    assert paths and all(p == (impl is None) for p in paths)
    model.train()
    layout = moe_layout(model)
    load = ExpertLoad(model, layout, torch.device("cpu"))
    adapters = parameter_adapters(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    # 3 tokens, top-2 of 8: at most 6 experts of a layer receive a token, at least 2 none
    batch = {"input_ids": torch.tensor([[5, 17, 42]]), "attention_mask": torch.ones(1, 3, dtype=torch.long)}
    seen, handles = routing(model, layout)
    loss = tail_ce(model, batch)
    for h in handles:
        h.remove()
    loss.backward()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0)
    opt.step()
    assert len(seen) == len(layout.routers)  # one forward counted: the recomputation inside backward was not
    # The tail loss reads the predictions at positions 0 and 1; position 2's output reaches no kept logit (causal
    # attention), so an expert that only position 2 was sent to gets an exact zero gradient, as an idle one.
    used = [set(idx[:2].reshape(-1).tolist()) for _, idx in seen]
    assert all(len(u) <= 2 * K for u in used) and all(len(u) < E for u in used)
    counts = torch.stack([torch.bincount(idx.reshape(-1), minlength=E).double() for _, idx in seen])
    assert torch.equal(load.counts, counts)  # the expert-load metric saw exactly the routed tokens
    metrics = load.flush()
    assert metrics["train/expert_load/idle_experts"] == float((counts == 0).sum())
    assert metrics["train/expert_load/max_share"] == float((counts / counts.sum(1, keepdim=True)).max())
    for layer, name in enumerate(layout.experts):
        for leaf in ("gate_up_proj", "down_proj"):
            wrapper = adapters[f"{name}.{leaf}"]
            a_now, b_now = expert_factors(wrapper)
            key = next(n for n in before if n.endswith(f"lora_B.default.weight") and
                       dict(model.named_parameters())[n] is wrapper.lora_B["default"].weight)
            a_key = key.replace("lora_B", "lora_A")
            a_old = before[a_key].reshape(E, -1, a_now.shape[-1])
            b_old = before[key].reshape(b_now.shape[1], -1, E).permute(2, 0, 1)
            grad_b = wrapper.lora_B["default"].weight.grad.reshape(b_now.shape[1], -1, E).permute(2, 0, 1)
            for e in range(E):
                if e in used[layer]:
                    assert grad_b[e].abs().max() > 0, (name, leaf, e)
                    assert not torch.equal(b_now[e], b_old[e]), (name, leaf, e)  # the adapter moved
                else:
                    assert torch.equal(grad_b[e], torch.zeros_like(grad_b[e])), (name, leaf, e)
                    assert torch.equal(b_now[e], b_old[e]) and torch.equal(a_now[e], a_old[e]), (name, leaf, e)
    for n, p in model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, before[n]), n  # routers, fused expert weights, everything frozen: bit-identical

    # The loss after the step (adapters non-zero), dropout off: the experts' forward (split, or peft's W + B A) against
    # the token-by-token reference on the same routing, both in float64, summing in other orders: tests/bounds.py's
    # fp32_paths_rel with float64's eps over the vocabulary (V) and the widest dot product (H = 2I = 32).
    model.eval()
    with torch.no_grad():
        # transformers' default experts kernel (grouped_mm) takes float32/bf16/fp16 only: eager in float64 (the split
        # path takes its per-expert loop there)
        f64 = copy.deepcopy(model).double()
        f64.get_base_model().set_experts_implementation("eager")
        seen_p, handles = routing(f64, layout)
        peft64 = float(tail_ce(f64, batch))
        with_ref = with_reference_experts(model, layout)
        seen_r, more = routing(with_ref, layout)
        ref64 = float(tail_ce(with_ref, batch))
        seen32, most = routing(model, layout)
        loss32 = float(tail_ce(model, batch))
        for h in handles + more + most:
            h.remove()
    eps64 = torch.finfo(torch.float64).eps
    assert abs(peft64 - ref64) <= fp32_paths_rel(V, H, eps=eps64) * abs(ref64), (peft64, ref64)
    routed = [[i.tolist() for _, i in s] for s in (seen_p, seen_r, seen32)]
    assert routed[0] == routed[1] == routed[2]  # the same routing in the three forwards
    # float32 harness forward (transformers' grouped kernel) against the float64 reference: the same bound in float32
    assert abs(loss32 - ref64) <= fp32_paths_rel(V, H) * abs(ref64), (loss32, ref64)
    with torch.no_grad(), f64.disable_adapter():  # the comparison can see the adapters: without them it differs
        assert abs(float(tail_ce(f64, batch)) - ref64) > 1e-6 * abs(ref64)


@pytest.mark.slow
def test_a_run_says_what_trains_logs_the_expert_load_and_exports(tmp_path, caplog):
    """The tiny job on a saved Qwen3-MoE with the schema's LoRA defaults (dropout 0.05, all-linear): the start-up line,
    ``train/expert_load/*`` in metrics.jsonl, an adapter with every expert and no router, and a merged export whose
    logits equal the adapter's."""
    import logging

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from scale.generation.export import merge_run
    from scale.generation.generator import load_model
    from scale.train import run
    from scale.training.metrics import read_jsonl
    from tests.conftest import log_file_lines, tiny_cfg

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=49152, hidden_size=H, intermediate_size=64, moe_intermediate_size=I,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=E,
                         num_experts_per_tok=K, head_dim=8, max_position_embeddings=256, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2)
    Qwen3MoeForCausalLM(cfg).save_pretrained(tmp_path / "moe")
    out = tmp_path / "run"
    caplog.set_level(logging.INFO)
    run(tiny_cfg(out, f"model.name_or_path={tmp_path / 'moe'}", "model.tokenizer=smollm2-135m", "lora.dropout=0.05",
                 "train.max_steps=2", "train.log_every=1", "train.eval_every=0", "data.eval_size=16",
                 "data.max_train_examples=32", "log.peak_flops=1e12"))
    lines = [r.getMessage() for r in caplog.records]
    lines = [m.removeprefix("[RANK 0] ") for m in lines]  # accelerate's logger names the rank
    at = [i for i, m in enumerate(lines) if m.startswith("LoRA on")][0]
    assert lines[at] == ("LoRA on qwen3_moe (top-2 of 8): attention 4 x 2 layers, experts 8 x 2 layers (gate_up_proj, "
                         "down_proj; a LoRA pair per expert), router frozen (lora.train_router=false)")
    assert lines[at + 1] == ("experts' LoRA split: x W_e + alpha/r (x A_e) B_e on the tokens routed to each expert, "
                             "W + B A never formed")  # lora.expert_impl null: the split path, which knows Qwen3-MoE
    assert lines[at + 2].startswith("lora.dropout=0.05 on the linear layers' adapters only")
    longest = max(log_file_lines([r for r in caplog.records if r.name.startswith("scale")]), key=len)
    assert len(longest) <= 300, longest  # docs/outputs.md: the harness's lines under 300 characters
    assert not [m for m in lines if "rank_pattern" in m or "alpha_pattern" in m]
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if "train/expert_load/max_share" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        tokens = [r[f"train/expert_load/tokens/e{e}"] for e in range(E)]
        # every real token of the step's 16 rows goes to K experts in each of the 2 layers
        assert sum(tokens) % (2 * K) == 0 and sum(tokens) > 0
        assert 0 <= r["train/expert_load/min_share"] <= 1 / E <= r["train/expert_load/max_share"] <= 1 / K
    adapter = load_file(out / "adapter" / "adapter_model.safetensors")
    assert not [k for k in adapter if ".mlp.gate." in k]
    experts_b = {k: v for k, v in adapter.items() if ".mlp.experts" in k and "lora_B" in k}
    assert len(experts_b) == 4 and all(v.abs().max() > 0 for v in experts_b.values())
    merged = AutoModelForCausalLM.from_pretrained(merge_run(out)).eval()
    peft_model = load_model(out)
    ids = torch.tensor([[1, 300, 4000, 17, 2]])
    with torch.no_grad():
        a, b = merged(input_ids=ids).logits, peft_model(input_ids=ids).logits
    # merged W + s B A against the adapter applied on the fly: two float32 paths summing in other orders over the
    # hidden width H (tests/bounds.py), relative to the largest logit
    assert (a - b).abs().max() <= fp32_paths_rel(H, H) * b.abs().max()


@pytest.mark.slow
def test_4bit_quantizes_the_linear_layers_and_keeps_the_experts_in_model_dtype(tmp_path):
    """bitsandbytes 4-bit replaces nn.Linear only: the fused experts stay in model.dtype (bf16 here, not the fp32
    prepare_model_for_kbit_training would make of them), the line says so, and their adapters get gradients."""
    pytest.importorskip("bitsandbytes")
    from scale.modeling.build import build_model

    tiny_moe("qwen3_moe").to(torch.bfloat16).save_pretrained(tmp_path / "moe")
    model = build_model(ModelConfig(name_or_path=str(tmp_path / "moe"), quantize_4bit=True, dtype="bfloat16",
                                    bnb_4bit_compute_dtype="bfloat16", gradient_checkpointing=False),
                        LoraConfig(r=4, alpha=8.0), V, 0)
    layout = moe_layout(model)
    params = {n.removeprefix("base_model.model.").replace(".base_layer", ""): p for n, p in model.named_parameters()}
    assert all(params[n].dtype == torch.bfloat16 and type(params[n]) is torch.nn.Parameter
               for n in layout.expert_params)
    assert type(params["model.layers.0.self_attn.q_proj.weight"]).__name__ == "Params4bit"
    assert "quantizes the linear layers only: the fused expert weights stay in model.dtype" in \
        targets_line(model, layout, 0.05, True)[-1]
    model(input_ids=torch.tensor([[5, 17, 42, 9]])).logits.float().sum().backward()
    grads = [w.lora_B["default"].weight.grad for w in parameter_adapters(model).values()]
    assert len(grads) == 4 and all(g is not None and g.abs().max() > 0 for g in grads)


def switch_aux_reference(logits: list[torch.Tensor], k: int) -> float:
    """Switch Transformer's load-balancing loss (https://arxiv.org/abs/2101.03961, eqs. 4-6, in transformers' top-k
    form) in float64 from the routers' logits: ``E x sum_e f_e P_e`` over the tokens of every layer, ``f_e`` the
    fraction of (token, slot) pairs routed to ``e`` per slot summed over the ``k`` slots, ``P_e`` the mean router
    probability of ``e``."""
    z = torch.cat([t.detach().double() for t in logits])          # [L x n, E]
    p = torch.softmax(z, dim=-1)
    idx = torch.topk(p, k, dim=-1).indices                        # [L x n, k]
    f = torch.nn.functional.one_hot(idx, E).double().mean(dim=0)  # [k, E]
    return float(E * (f * p.mean(dim=0)).sum())


def test_router_aux_loss_is_the_switch_loss_weighted_by_the_micro_batch():
    model = lora(tiny_moe("qwen3_moe"), train_router=True, dropout=0.0)
    model.train()
    layout = moe_layout(model)
    aux = RouterAux.for_run(model, layout, None, True)
    assert aux is not None and aux.coef == model.get_base_model().config.router_aux_loss_coef  # the model's own
    kept: list = []
    handles = [model.get_submodule(f"base_model.model.{r}").register_forward_hook(
        lambda _m, _a, out: kept.append(out[0])) for r in layout.routers]
    batch = {"input_ids": torch.tensor([[5, 17, 42, 9, 33, 2]]), "attention_mask": torch.ones(1, 6, dtype=torch.long)}
    loss = tail_ce(model, batch)
    for h in handles:
        h.remove()
    w = torch.tensor(2.0)
    term = aux.term(batch, w)
    # float32 softmax over E and means over the 12 (token, layer) rows, then a sum over E of products: within
    # tests/bounds.py's fp32 bound of the float64 value for the longest reduction (12 rows) and width E
    reference = switch_aux_reference(kept, K)
    assert abs(float(term.detach()) / (aux.coef * 2.0) - reference) <= fp32_paths_rel(12, E) * reference
    (loss + term).backward()  # the aux loss reaches the routers' adapters
    router_grads = [w.lora_B["default"].weight.grad for n, w in parameter_adapters(model).items()
                    if n in layout.router_params]
    assert len(router_grads) == 2 and all(g.abs().max() > 0 for g in router_grads)
    flushed = aux.flush()["train/router_aux_loss"]  # unweighted by coef
    assert abs(flushed - reference) <= fp32_paths_rel(12, E) * reference
    with torch.no_grad():
        tail_ce(model, batch)  # evaluation: nothing kept
    assert float(aux.term(batch, w)) == 0.0


def test_router_aux_coef_with_a_frozen_router_or_a_dense_model_is_one_line():
    model = lora(tiny_moe("mixtral"))
    with pytest.raises(ConfigError, match=r"^loss.router_aux_coef=0.01 balances the routers, which are frozen: set "
                                          r"lora.train_router=true"):
        RouterAux.for_run(model, moe_layout(model), 0.01, False)
    assert RouterAux.for_run(model, moe_layout(model), None, False) is None  # null: off while the router is frozen
    with pytest.raises(ConfigError, match="needs a mixture-of-experts model"):
        RouterAux.for_run(torch.nn.Linear(2, 2), None, 0.01, True)


@pytest.mark.slow
def test_a_run_with_a_trained_router_logs_its_aux_loss(tmp_path, caplog):
    import logging

    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from scale.train import run
    from scale.training.metrics import read_jsonl
    from tests.conftest import tiny_cfg

    torch.manual_seed(0)
    Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=49152, hidden_size=H, intermediate_size=64, moe_intermediate_size=I,
                                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                       num_experts=E, num_experts_per_tok=K, head_dim=8, tie_word_embeddings=True,
                                       bos_token_id=1, eos_token_id=2, pad_token_id=2)).save_pretrained(tmp_path / "m")
    out = tmp_path / "run"
    caplog.set_level(logging.INFO)
    run(tiny_cfg(out, f"model.name_or_path={tmp_path / 'm'}", "model.tokenizer=smollm2-135m", "lora.train_router=true",
                 "loss.router_aux_coef=0.01", "train.max_steps=2", "train.log_every=1", "train.eval_every=0",
                 "data.eval_size=16", "data.max_train_examples=32", "log.peak_flops=1e12"))
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "router trained (LoRA on 2 router weights)" in text
    assert "loss.router_aux_coef=0.01 (the model's load-balancing loss, added to the loss)" in text
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if "train/router_aux_loss" in r]
    assert [r["step"] for r in rows] == [1, 2] and all(r["train/router_aux_loss"] > 0 for r in rows)


@pytest.mark.slow
def test_resume_of_a_moe_run_is_bit_exact(tmp_path):
    """8 steps straight against 4 + a resume from the step-4 checkpoint: the same adapter (expert, attention) and the
    same losses and expert loads, bit for bit (dropout on the linear adapters, so the RNG state must come back too)."""
    from accelerate.state import AcceleratorState, GradientState
    from safetensors.torch import load_file
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from scale.train import run
    from scale.training.metrics import read_jsonl
    from tests.conftest import tiny_cfg

    torch.manual_seed(0)
    Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=49152, hidden_size=H, intermediate_size=64, moe_intermediate_size=I,
                                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                       num_experts=E, num_experts_per_tok=K, head_dim=8, tie_word_embeddings=True,
                                       bos_token_id=1, eos_token_id=2, pad_token_id=2)).save_pretrained(tmp_path / "m")
    job = [f"model.name_or_path={tmp_path / 'm'}", "model.tokenizer=smollm2-135m", "lora.dropout=0.1",
           "data.max_train_examples=20", "train.micro_batch_size=2", "train.gradient_accumulation_steps=2",
           "train.max_steps=8", "train.log_every=1", "train.eval_every=0", "train.save_every=4", "data.eval_size=8",
           "log.peak_flops=1e12"]
    runs = {}
    for name, extra in (("straight", []), ("resumed", [f"train.resume_from={tmp_path / 'straight'}/checkpoints/"
                                                      f"step_{4:06d}"])):
        run(tiny_cfg(tmp_path / name, *job, *extra))
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        rows = {r["step"]: r for r in read_jsonl(tmp_path / name / "metrics.jsonl") if "train/loss" in r}
        runs[name] = (load_file(tmp_path / name / "adapter" / "adapter_model.safetensors"), rows)
    (ref, ref_rows), (got, got_rows) = runs["straight"], runs["resumed"]
    assert ref.keys() == got.keys() and any(".experts" in k for k in ref)
    assert all(torch.equal(ref[k], got[k]) for k in ref)
    assert sorted(got_rows) == [5, 6, 7, 8]
    for s in got_rows:
        keys = ["train/loss", "train/grad_norm"] + [k for k in ref_rows[s] if k.startswith("train/expert_load/")]
        assert {k: got_rows[s][k] for k in keys} == {k: ref_rows[s][k] for k in keys}, s


def test_the_saved_adapters_need_no_rewrite_by_peft_and_a_v4_style_one_is_named():
    """peft's transformers-4 conversion leaves the adapter config of every family as saved (full names; peft 0.18-0.21
    rewrote DeepSeek's shared experts, huggingface/peft#3945); a transformers-4 style config (bare
    gate_proj/up_proj/down_proj) is rewritten by any peft with the conversion, and the warning names what moves."""
    from peft import LoraConfig, get_peft_model

    from scale.modeling.moe import load_rewrites

    pytest.importorskip("peft.utils.transformers_weight_conversion")
    from packaging.version import Version

    from scale.utils.compat import installed

    fixed = Version(installed("peft")) >= Version("0.22")
    for family in FAMILIES:
        for train_router in (False, True):
            line = load_rewrites(lora(tiny_moe(family), dropout=0.0, train_router=train_router))
            if family == "deepseek_v3" and not fixed:  # its dense layer's and shared expert's gate/up/down_proj
                assert line is not None and "6 linear targets (down_proj, gate_proj, up_proj) moved" in line
            else:
                assert line is None, (family, line)
    v4 = get_peft_model(tiny_moe("deepseek_v3"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    v4.peft_config["default"].target_modules = ["gate_proj", "up_proj", "down_proj"]
    line = load_rewrites(v4)
    assert line is not None and "gate_up_proj at rank 8" in line and line.endswith(
        "load it with peft >= 0.22 (huggingface/peft#3945), or scale-generate")


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_adapter_and_checkpoint_load_with_plain_peft_and_transformers(family, tmp_path, caplog):
    """A run on a saved model of each family: its adapter/ and its last checkpoint directory load with plain peft
    (PeftModel.from_pretrained) and with transformers' model.load_adapter, no scale code around them, and give the
    run's final eval/loss within two float32 paths' bound (a 49,152-token softmax, widths <= 128) and its accuracy."""
    import logging

    from scale.modeling.moe import explicit_targets
    from scale.train import run
    from tests.bounds import TINY_JOB_REL
    from tests.conftest import tiny_cfg
    from tests.reload import reload_eval

    tiny_moe(family, vocab=49152).save_pretrained(tmp_path / "m")
    caplog.set_level(logging.WARNING)
    out = tmp_path / "run"
    final = run(tiny_cfg(out, f"model.name_or_path={tmp_path / 'm'}", "model.tokenizer=smollm2-135m",
                         "train.max_steps=2", "train.eval_every=0", "train.save_every=2", "data.eval_size=16",
                         "data.max_train_examples=32", "log.peak_flops=1e12"))
    # peft 0.18-0.21 rewrite DeepSeek's shared-expert targets on load (the start-up says so, and a plain load then
    # fails); from peft 0.22 (huggingface/peft#3945) every family's adapter loads as saved
    rewritten = [r.getMessage() for r in caplog.records if "rewrites this adapter" in r.getMessage()]
    for adapter in (out / "adapter", out / "checkpoints" / "step_000002"):
        for how in ("peft", "transformers"):
            if rewritten:
                with pytest.raises(RuntimeError, match="size mismatch|ignore_mismatched_sizes"):
                    reload_eval(out, adapter, how)
                with explicit_targets():  # as scale-generate and scale-export load it
                    again = reload_eval(out, adapter, how)
            else:
                again = reload_eval(out, adapter, how)
            assert again["eval/examples"] == final["eval/examples"] == 16
            assert abs(again["eval/loss"] / final["eval/loss"] - 1) <= TINY_JOB_REL, (adapter.name, how, again, final)
            assert again["eval/accuracy"] == final["eval/accuracy"], (adapter.name, how)


def test_a_saved_adapter_with_shared_experts_reloads_to_the_same_model(tmp_path):
    """DeepSeek-V3's shared experts are linear layers named gate_proj/up_proj/down_proj: peft's transformers-4
    conversion would move their adapters onto the routed experts' fused weights on reload (peft 0.21.2: the load
    then fails, "Error(s) in loading state_dict for PeftModelForCausalLM"). Loaded under explicit_targets (as
    scale-export and scale-generate load), the adapter gives the trained model's logits."""
    from peft import PeftModel

    from scale.modeling.moe import explicit_targets

    model = lora(tiny_moe("deepseek_v3"), dropout=0.0, expert_impl="peft")  # the reload runs peft's path: bit-equal
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))  # a trained-looking adapter
    model.eval()
    model.save_pretrained(tmp_path / "adapter")
    ids = torch.tensor([[3, 14, 15, 9, 26]])
    with torch.no_grad():
        want = model(input_ids=ids).logits
        with explicit_targets():
            again = PeftModel.from_pretrained(tiny_moe("deepseek_v3"), tmp_path / "adapter").eval()
        got = again(input_ids=ids).logits
    shared = [n for n, m in again.named_modules() if "shared_experts" in n and hasattr(m, "lora_A")
              and not is_parameter_adapter(m)]
    assert len(shared) == 3  # gate_proj, up_proj, down_proj of the one MoE layer's shared expert
    # the same float32 operations in the same order on the same weights: equal
    assert torch.equal(got, want)


@pytest.mark.slow
def test_an_aux_coefficient_with_frozen_routers_is_exit_2_before_anything_is_written(tmp_path, capsys):
    from scale.cli import main
    from tests.conftest import TINY_DATA, TINY_YAML

    tiny_moe("qwen3_moe").save_pretrained(tmp_path / "m")
    code = main(["--config", str(TINY_YAML), f"output_dir={tmp_path / 'out'}", f"data.path={TINY_DATA}",
                 f"model.name_or_path={tmp_path / 'm'}", "model.tokenizer=smollm2-135m", "loss.router_aux_coef=0.01"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1] == ("scale-train: error: ConfigError: loss.router_aux_coef=0.01 balances the routers, "
                                     "which are frozen: set lora.train_router=true, or loss.router_aux_coef=null")
    assert not (tmp_path / "out").exists()
