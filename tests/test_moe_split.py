"""Split expert LoRA (scale.modeling.split_experts, scale.modeling.moe_lora): ``x W_e + s (x A_e^T) B_e^T`` on the
routed pairs, never ``W + B A``, against a float64 expert-by-expert reference on Qwen3-MoE, Mixtral, DeepSeek-V3 and
gpt-oss experts modules; lora.expert_impl's choices and refusals."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from scale.config.validation import ConfigError
from scale.modeling.moe import moe_layout, parameter_adapters
from scale.modeling.moe_lora import is_split, use_split
from scale.modeling.split_experts import _grouped_mm_loop, grouped_mm, layout_problem, native_grouped_mm
from scale.utils.compat import peft_adapts_parameters
from tests.bounds import EPS32, fp32_paths_rel
from tests.test_moe import FAMILIES, E, K, lora, tiny_moe

pytestmark = pytest.mark.skipif(not peft_adapts_parameters(), reason="peft without target_parameters (< 0.17)")

EPS64 = torch.finfo(torch.float64).eps


def per_expert_reference(x, w, offs):
    """``[S, out]``: each row times its expert's matrix, in float64, row by row."""
    out, start = [], 0
    for e, end in enumerate(offs.tolist()):
        out += [x[t].double() @ w[e].double() for t in range(start, end)]
        start = end
    return torch.stack(out)


@pytest.mark.parametrize("kernel", ["native", "loop"])
def test_grouped_mm_is_the_per_expert_product_and_idle_experts_get_zero_gradient(kernel):
    gen = torch.Generator().manual_seed(0)
    S, E_, i, o = 12, 5, 16, 8
    offs = torch.tensor([3, 3, 9, 9, 12], dtype=torch.int32)  # experts 1 and 3 receive no row
    x = torch.randn(S, i, generator=gen, requires_grad=True)
    w = torch.randn(E_, o, i, generator=gen).transpose(-2, -1).requires_grad_()  # [E, in, out] view, as the experts
    g = torch.randn(S, o, generator=gen)
    assert native_grouped_mm(x, w)  # float32, aligned: torch's kernel is there (torch >= 2.9)
    y = grouped_mm(x, w, offs) if kernel == "native" else _grouped_mm_loop(x, w, offs)
    (y * g).sum().backward()
    ref_x, ref_w = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = per_expert_reference(ref_x, ref_w, offs)
    (ref * g.double()).sum().backward()
    # float32 dot products of width i (forward, weight gradient over <= 6 rows) and o (input gradient)
    bound = fp32_paths_rel(6, max(i, o))
    assert (y.double() - ref).abs().max() <= bound * ref.abs().max()
    assert (x.grad.double() - ref_x.grad).abs().max() <= bound * ref_x.grad.abs().max()
    assert (w.grad.double() - ref_w.grad).abs().max() <= bound * ref_w.grad.abs().max()
    assert torch.equal(w.grad[[1, 3]], torch.zeros_like(w.grad[[1, 3]]))


def test_the_loop_keeps_no_input_and_builds_no_gradient_for_a_frozen_weight():
    """A frozen base stack: backward needs the weight only (torch's kernel does the same: _saved_self is None), and
    no ``[E, in, out]`` gradient is computed (transformers' fallback builds one)."""
    x = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 8, 4, dtype=torch.float64)
    offs = torch.tensor([2, 2, 6], dtype=torch.int32)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = grouped_mm(x, w, offs)
    assert not native_grouped_mm(x, w)  # float64: the loop
    assert [tuple(t.shape) for t in saved if t.is_floating_point()] == [(3, 8, 4)]  # the weight, not x
    shapes = []

    class Shapes(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            shapes.extend(tuple(t.shape) for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
            return out

    with Shapes():
        y.sum().backward()
    assert (3, 8, 4) not in shapes and x.grad is not None


def experts_case(family: str, dtype: torch.dtype, seed: int = 0):
    """One MoE layer's experts module of a tiny LoRA model of ``family`` with non-zero adapters, in ``dtype``, and
    ``n`` tokens routed to experts 0-4 only (5-7 idle): ``(outer peft wrapper, hidden [n, H], index [n, k],
    weights [n, k])``."""
    gen = torch.Generator().manual_seed(seed)
    model = lora(tiny_moe(family, seed), dropout=0.0, expert_impl="peft")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    layout = moe_layout(model)
    outer = copy.deepcopy(model.get_submodule(f"base_model.model.{layout.experts[-1]}")).to(dtype)
    base = outer.get_base_layer()
    with torch.no_grad():  # random init where the config leaves zeros (gpt-oss biases)
        for name, p in base.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.2 if p.dim() == 3 else 0.1))
    n, H = 6, base.gate_up_proj.shape[2 if not base.is_transposed else 1]
    hidden = torch.randn(n, H, generator=gen, dtype=dtype, requires_grad=True)
    index = torch.stack([torch.randperm(5, generator=gen)[:K] for _ in range(n)])
    weights = torch.softmax(torch.randn(n, K, generator=gen, dtype=dtype), -1).requires_grad_()
    return outer, hidden, index, weights


def lora_weight(wrapper, param: torch.Tensor, e: int, transposed: bool) -> torch.Tensor:
    """Expert ``e``'s ``[out, in]`` matrix ``W_e + s B_e A_e`` from peft's flat layout by hand: ``lora_A [r E, in]``
    rows ``e r .. e r + r - 1``; ``lora_B [out, r E]`` column ``j E + e`` (peft ``ParamWrapper.get_delta_weight``)."""
    a, b = wrapper.lora_A["default"].weight, wrapper.lora_B["default"].weight
    r = a.shape[0] // E
    base = param[e].T if transposed else param[e]
    return base + wrapper.scaling["default"] * (b[:, [j * E + e for j in range(r)]] @ a[e * r:(e + 1) * r])


def reference_forward(family: str, outer, hidden, index, weights) -> torch.Tensor:
    """The experts token by token, slot by slot, in float64, with the family's gate written out: SwiGLU
    ``silu(g) * u`` over ``[gate; up]`` halves (Qwen3-MoE, Mixtral, DeepSeek-V3), or gpt-oss's clamped GLU over
    interleaved columns with biases."""
    inner = outer.base_layer
    base = outer.get_base_layer()
    tr = base.is_transposed
    out = torch.zeros_like(hidden)
    for t in range(hidden.shape[0]):
        for j in range(index.shape[1]):
            e = int(index[t, j])
            gu = lora_weight(inner, base.gate_up_proj, e, tr) @ hidden[t]
            if family == "gpt_oss":
                gu = gu + base.gate_up_proj_bias[e]
                gate, up = gu[::2].clamp(max=base.limit), gu[1::2].clamp(-base.limit, base.limit)
                h = (up + 1) * gate * torch.sigmoid(gate * base.alpha)
            else:
                assert base.config.hidden_act == "silu"
                gate, up = gu.chunk(2)
                h = torch.nn.functional.silu(gate) * up
            y = lora_weight(outer, base.down_proj, e, tr) @ h
            if family == "gpt_oss":
                y = y + base.down_proj_bias[e]
            out[t] = out[t] + weights[t, j] * y
    return out


def run(outer, hidden, index, weights, impl: str):
    """Forward + backward of ``sum(out * g)`` through the ``impl`` path: the output, and every gradient by name."""
    outer = copy.deepcopy(outer)
    hidden, weights = hidden.detach().requires_grad_(), weights.detach().requires_grad_()
    assert not is_split(outer)  # experts_case builds peft's path
    if impl == "split":
        outer = split(outer)
    elif hidden.dtype == torch.float64:
        outer.get_base_layer().config._experts_implementation = "eager"  # the grouped kernel takes no float64
    out = outer(hidden, index, weights)
    g = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)
    (out * g).sum().backward()
    grads = {n: p.grad for n, p in outer.named_parameters() if p.requires_grad}
    return out.detach(), grads | {"hidden": hidden.grad, "weights": weights.grad}


def split(outer: torch.nn.Module) -> torch.nn.Module:
    """``outer`` (peft's outermost wrapper of an experts module) switched to the split path by :func:`use_split`."""
    holder = torch.nn.Module()
    holder.experts = outer
    assert use_split(holder, ["experts"]) == {} and is_split(holder.experts)
    return holder.experts


@pytest.mark.parametrize("impl", ["split", "peft"])
@pytest.mark.parametrize("family", FAMILIES)
def test_experts_equal_the_float64_expert_by_expert_reference(family, impl):
    """Output, every LoRA factor's gradient and the gradients of the tokens and routing weights, in float64 (the
    loop kernel) and float32 (torch's grouped kernel for split, transformers' for peft), against the reference;
    experts 5-7 receive no token: their factors' gradients are exactly zero."""
    outer, hidden, index, weights = experts_case(family, torch.float64)
    ref_outer = copy.deepcopy(outer)
    ref_hidden, ref_weights = hidden.detach().requires_grad_(), weights.detach().requires_grad_()
    ref = reference_forward(family, ref_outer, ref_hidden, index, ref_weights)
    g = torch.linspace(-1, 1, ref.numel(), dtype=ref.dtype).reshape(ref.shape)
    (ref * g).sum().backward()
    want = {n: p.grad for n, p in ref_outer.named_parameters() if p.requires_grad}
    want |= {"hidden": ref_hidden.grad, "weights": ref_weights.grad}
    base = outer.get_base_layer()
    width = max(hidden.shape[1], 2 * base.down_proj.shape[1 if base.is_transposed else 2])  # H, 2I
    for dtype, eps in ((torch.float64, EPS64), (torch.float32, EPS32)):
        out, grads = run(copy.deepcopy(outer).to(dtype), hidden.to(dtype), index, weights.to(dtype), impl)
        # dot products of width H or 2I, sums over the n k = 12 pairs (tests/bounds.py), in the format's eps
        bound = fp32_paths_rel(hidden.shape[0] * K, width, eps=eps)
        assert (out.double() - ref).abs().max() <= bound * ref.abs().max(), (dtype, family)
        assert grads.keys() == want.keys()
        for name, w in want.items():
            got = grads[name].double()
            assert (got - w).abs().max() <= bound * w.abs().max(), (dtype, name)
        for name in [n for n in grads if "lora_" in n]:
            wrapper_dim = grads[name].shape
            flat = grads[name]
            idle = flat.reshape(E, -1, wrapper_dim[-1])[5:] if "lora_A" in name else \
                flat.reshape(wrapper_dim[0], -1, E)[..., 5:]
            assert torch.equal(idle, torch.zeros_like(idle)), (dtype, name)  # never routed: exactly zero
            assert flat.abs().max() > 0


def stack_shapes(outer) -> set[tuple[int, ...]]:
    """The shapes of the fused expert stacks (``W`` and so ``W + B A``) of an experts module."""
    base = outer.get_base_layer()
    return {tuple(p.shape) for p in (base.gate_up_proj, base.down_proj)}


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_split_never_forms_w_plus_ba_in_forward_or_backward(family):
    """Every tensor an op allocates during forward and backward (views of the weights aside), by shape: the split
    path allocates none the size of an expert stack; peft's path allocates several (``W + B A`` and its gradient),
    so the check can fail."""
    outer, hidden, index, weights = experts_case(family, torch.float32)

    def created(impl: str) -> list[tuple[int, ...]]:
        module = split(copy.deepcopy(outer)) if impl == "split" else copy.deepcopy(outer)
        weights_storage = {p.untyped_storage().data_ptr() for p in module.parameters()}
        shapes: list[tuple[int, ...]] = []

        class Shapes(torch.utils._python_dispatch.TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                shapes.extend(tuple(t.shape) for t in torch.utils._pytree.tree_leaves(out)
                              if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in weights_storage)
                return out

        h = hidden.detach().requires_grad_()
        with Shapes():
            out = module(h, index, weights.detach())
            out.square().sum().backward()
        return shapes

    stacks = stack_shapes(outer) | {(s[0], s[2], s[1]) for s in stack_shapes(outer)}
    numel = min(math.prod(s) for s in stacks)
    assert not [s for s in created("split") if math.prod(s) >= numel]
    assert len([s for s in created("peft") if s in stacks]) >= 4


def test_an_unknown_expert_layout_stays_on_peft_with_its_reason():
    class Odd(torch.nn.Module):  # fused 3-D weights without transformers' experts contract
        def __init__(self):
            super().__init__()
            self.w1 = torch.nn.Parameter(torch.zeros(E, 8, 4))

    assert layout_problem(Odd(), ["w1"]) == ("Odd lacks has_gate, has_bias, is_transposed, num_experts, down_proj "
                                             "(not a transformers 5 experts module)")
    model = lora(tiny_moe("mixtral"), dropout=0.0, expert_impl="peft")
    layout = moe_layout(model)
    experts = model.get_submodule(f"base_model.model.{layout.experts[0]}").get_base_layer()
    experts._is_expert_parallel = True
    left = use_split(model, layout.experts)
    assert left == {layout.experts[0]: "MixtralExperts is expert-parallel"}
    assert not is_split(model.get_submodule(f"base_model.model.{layout.experts[0]}"))
    assert is_split(model.get_submodule(f"base_model.model.{layout.experts[1]}"))


def test_split_keeps_peft_parameters_saves_the_same_adapter_and_disables_like_peft(tmp_path):
    """The same parameter names and shapes (the adapter file plain peft loads), the same logits in float32 within
    the bound of two summation orders, and the base model's exact logits with the adapter disabled."""
    from peft import PeftModel

    from scale.modeling.moe import explicit_targets

    torch.manual_seed(3)
    peft = lora(tiny_moe("qwen3_moe"), dropout=0.0, expert_impl="peft")
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    peft.eval()
    split = copy.deepcopy(peft)
    assert use_split(split, moe_layout(split).experts) == {}
    assert [(n, p.shape) for n, p in split.named_parameters()] == [(n, p.shape) for n, p in peft.named_parameters()]
    assert sorted(parameter_adapters(split)) == sorted(parameter_adapters(peft))
    ids = torch.tensor([[3, 14, 15, 9, 26, 5]])
    with torch.no_grad():
        want, got = peft(input_ids=ids).logits, split(input_ids=ids).logits
        with peft.disable_adapter():
            base = peft(input_ids=ids).logits
        with split.disable_adapter():
            assert torch.equal(split(input_ids=ids).logits, base)
    # two float32 paths: vocabulary-wide logits from hidden-width dot products (tests/bounds.py)
    assert (got - want).abs().max() <= fp32_paths_rel(64, 32) * want.abs().max()
    split.save_pretrained(tmp_path / "adapter")
    with explicit_targets():
        again = PeftModel.from_pretrained(tiny_moe("qwen3_moe"), tmp_path / "adapter").eval()
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids).logits, want)  # plain peft, the same float32 operations


def test_lora_expert_impl_null_falls_back_to_peft_with_a_line_and_split_is_refused_where_it_cannot():
    """One MoE layer the split path does not know (its experts module expert-parallel): null computes that layer
    on peft's path and says so at start-up; ``split`` is refused in one line naming the module, the reason and the
    fix; ``peft`` puts every layer on peft's path."""
    from scale.config.schema import LoraConfig as LoraCfg
    from scale.config.schema import ModelConfig
    from scale.modeling.build import add_lora
    from scale.modeling.moe_lora import path_lines

    def model_with_one_odd_layer():
        base = tiny_moe("mixtral")
        base.model.layers[0].mlp.experts._is_expert_parallel = True  # transformers' EP flag: sentinel routing
        return base

    def build(impl):
        return add_lora(model_with_one_odd_layer(), ModelConfig(gradient_checkpointing=False),
                        LoraCfg(r=4, alpha=8.0, dropout=0.0, expert_impl=impl))

    model = build(None)
    layout = moe_layout(model)
    assert [is_split(model.get_submodule(f"base_model.model.{n}")) for n in layout.experts] == [False, True]
    assert path_lines(model, layout, None, None) == [
        ("experts' LoRA split: x W_e + alpha/r (x A_e) B_e on the tokens routed to each expert, W + B A never formed "
         "(1 of 2 MoE layers)"),
        ("experts' LoRA on peft's path in 1 of 2 MoE layers (the split path does not know their layout: "
         "MixtralExperts is expert-parallel): W + B A for each layer's whole expert stack in each forward, kept for "
         "backward")]
    model(input_ids=torch.tensor([[3, 14, 15]])).logits.sum().backward()  # both paths in one model train
    assert all(w.lora_A["default"].weight.grad is not None for w in parameter_adapters(model).values())
    with pytest.raises(ConfigError, match=r"^lora.expert_impl=split cannot compute model.layers.0.mlp.experts: "
                                          r"MixtralExperts is expert-parallel; set lora.expert_impl=peft \(or null: "
                                          r"split where it can, peft's path elsewhere\)$"):
        build("split")
    model = build("peft")
    assert not any(is_split(model.get_submodule(f"base_model.model.{n}")) for n in layout.experts)
    assert path_lines(model, layout, "peft", "ZeRO-3")[1].startswith(
        "ZeRO-3: every rank gathers each MoE layer's whole expert stack (0.0469 MiB) for its forward and again for "
        "backward (only expert parallelism, which scale does not run, would gather a share); peft adds W + B A")


def test_lora_expert_impl_on_a_dense_model_or_an_unknown_name_is_one_line():
    from transformers import LlamaConfig, LlamaForCausalLM

    from scale.config.load import load_config
    from scale.config.schema import LoraConfig as LoraCfg
    from scale.config.schema import ModelConfig
    from scale.modeling.build import add_lora
    from tests.conftest import TINY_YAML

    dense = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(ConfigError, match=r"^lora.expert_impl=split applies to mixture-of-experts models; this model "
                                          r"is dense: drop the key \(null\)$"):
        add_lora(dense, ModelConfig(gradient_checkpointing=False), LoraCfg(expert_impl="split"))
    with pytest.raises(ConfigError, match=r"^lora.expert_impl='scatter' is not one of \[None, 'split', 'peft'\]$"):
        load_config(TINY_YAML, ["lora.expert_impl=scatter"])


@pytest.mark.slow
def test_lora_expert_impl_on_a_dense_model_is_exit_2_before_anything_is_written(tmp_path, capsys):
    from scale.cli import main
    from tests.conftest import TINY_DATA, TINY_YAML

    code = main(["--config", str(TINY_YAML), f"output_dir={tmp_path / 'out'}", f"data.path={TINY_DATA}",
                 "lora.expert_impl=split"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1] == ("scale-train: error: ConfigError: lora.expert_impl=split applies to "
                                     "mixture-of-experts models; this model is dense: drop the key (null)")
    assert not (tmp_path / "out").exists()


def test_grouped_mm_takes_the_loop_where_backward_could_not_run_natively():
    """A bf16 ``[S, 4]`` output (8-byte rows, LoRA r=4) passes torch's forward checks but not its backward's
    ("strides should be multiple of 16 bytes"): such operands take the loop, whose backward runs."""
    x = torch.randn(6, 32, dtype=torch.bfloat16, requires_grad=True)
    a = torch.randn(3, 4, 32, dtype=torch.bfloat16, requires_grad=True)  # A [E, r, in]
    assert not native_grouped_mm(x, a.transpose(-2, -1))
    grouped_mm(x, a.transpose(-2, -1), torch.tensor([2, 2, 6], dtype=torch.int32)).float().square().sum().backward()
    assert x.grad is not None and a.grad is not None
