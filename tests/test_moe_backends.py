"""``"expert_parallel": {"use_grouped_mm", "disable_triton_grouped_mm"}`` choose the backends of the experts' grouped
GEMMs (``llmpar.ops.grouped_gemm_backends``, ``impl``): every GEMM of the forward and the backward runs on the one the
keys allow. On CPU the fused ``torch._grouped_mm`` and Triton are made to look available (their ``select`` checks
patched) and each op records the backend it is handed, then runs the per-expert loop.
"""

from __future__ import annotations

import pytest
import torch

import llmpar.ops._dispatch as dispatch
import llmpar.ops.grouped_gemm_backends as backends
from llmpar.moe.experts import grouped_mlp
from llmpar.runtime.config import Blocks

KEYS = {
    "auto": {},
    "native": {"disable_triton_grouped_mm": True},
    "loop": {"use_grouped_mm": False},
}


@pytest.fixture
def recorded(monkeypatch):
    """The backends the three grouped GEMM ops are run with (each then runs the torch loop)."""
    monkeypatch.delenv("LLMPAR_BACKEND", raising=False)
    seen: list[str] = []
    for name, at in (("mm", 4), ("swiglu_backward", 4), ("wgrad", 3)):  # the backend's position in each op
        real = getattr(backends, name)

        def spy(*args, real=real, at=at, **kw):
            args = list(args)
            seen.append(args[at])
            args[at] = "torch"
            return real(*args, **kw)

        monkeypatch.setattr(backends, name, spy)
    monkeypatch.setattr(backends, "_dispatch", _TritonUp())  # only the grouped GEMM's choice sees Triton up
    return seen


class _TritonUp:
    """``llmpar.ops._dispatch`` as the grouped GEMM's ``select`` sees it, with Triton available."""

    def triton_unavailable_reason(self, device: torch.device) -> None:
        return None

    def __getattr__(self, name: str):
        return getattr(dispatch, name)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("impl", list(KEYS))
def test_impl_chooses_the_backend_that_runs(recorded, monkeypatch, impl, fused):
    """auto: torch._grouped_mm where fused, else Triton; native: never Triton; loop: always the loop. Forward and
    backward alike (SwiGLU GEMM + down GEMM forward; their dX, the SwiGLU backward and both dW)."""
    if fused:  # as on an sm_90 device with bf16, aligned operands
        monkeypatch.setattr(backends, "torch_gmm_unfit", lambda tensors: None)
    want = {("auto", False): "triton", ("native", False): "torch", ("loop", False): "torch"}.get((impl, fused))
    want = want or ("torch" if impl == "loop" else "cuda")
    g = torch.Generator().manual_seed(3)
    counts, hidden, inter = [3, 0, 5], 7, 5
    x = torch.randn(sum(counts), hidden, generator=g, requires_grad=True)
    gate_up = torch.randn(3, 2 * inter, hidden, generator=g, requires_grad=True)
    down = torch.randn(3, hidden, inter, generator=g, requires_grad=True)
    y = grouped_mlp(x, counts, gate_up, down, impl=impl)
    y.square().sum().backward()
    assert len(recorded) >= 5 and set(recorded) == {want}, recorded


def test_keys_parse_and_reach_the_swapped_experts(recorded):
    """The block's keys -> ``grouped_mm_impl``; ``llmpar.initialize`` sets it on the swapped transformers blocks'
    experts, and their training step runs on that backend (Triton by default, the loop with use_grouped_mm false)."""
    transformers = pytest.importorskip("transformers")
    import llmpar
    from llmpar.moe.experts import Experts

    for impl, keys in KEYS.items():
        assert Blocks.parse({"expert_parallel": keys}).expert_parallel.grouped_mm_impl == impl
    with pytest.raises(TypeError, match="use_grouped_mm. must be true or false"):
        Blocks.parse({"expert_parallel": {"use_grouped_mm": "yes"}})
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=50,
        hidden_size=16,
        intermediate_size=24,
        moe_intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
    )
    ids = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(0))
    for impl in ("auto", "loop"):
        torch.manual_seed(0)
        model = transformers.Qwen3MoeForCausalLM(cfg)
        config = {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
        config["expert_parallel"] = {"enabled": True, **KEYS[impl]}
        engine, *_ = llmpar.initialize(model=model, config=config)
        assert {m.grouped_mm_impl for m in model.modules() if isinstance(m, Experts)} == {impl}
        recorded.clear()
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        assert recorded and set(recorded) == {"triton" if impl == "auto" else "torch"}, recorded


def test_bad_impl_is_named(monkeypatch):
    x, w = torch.randn(4, 3), torch.randn(2, 3, 5)
    with pytest.raises(ValueError, match="impl='fast' is not one of auto, native, loop"):
        backends.select("grouped_mm", x, w, impl="fast")
    monkeypatch.setenv("LLMPAR_BACKEND", "triton")
    with pytest.raises(RuntimeError, match="LLMPAR_BACKEND=triton but grouped_mm was asked for no Triton kernel"):
        backends.select("grouped_mm", x, w, impl="native")
    assert backends.select("grouped_mm", x, w, impl="loop") == "torch"  # the loop wins over the variable
