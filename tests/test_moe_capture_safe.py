"""The MoE block on the CUDA graph path (issue 44, item 1): nothing in its grouped forward reads a
device value back to the host (bincount, .item(), .tolist()) or adds a token's experts with an
atomic scatter (index_add_); a token's k expert outputs are summed over a [T, k, H] buffer in top-k
slot order, bit for bit what transformers' grouped_mm experts compute. The per-expert loop (CUDA
float16/float32) syncs once a layer: the model says so, and the decode graphs then stay eager."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.utils._python_dispatch import TorchDispatchMode

from pdserve.model import moe
from pdserve.model.moe import GroupedExperts, SparseMoeBlock
from pdserve.model.qwen3 import Qwen3ForCausalLM
from pdserve.model.qwen3_config import Qwen3ModelConfig

# aten ops that read a device value back to the host, or accumulate floats with atomics on CUDA
FORBIDDEN = {"bincount", "_local_scalar_dense", "index_add", "index_add_", "nonzero", "unique", "_unique2",
             "masked_select", "index_put_", "scatter_reduce", "scatter_reduce_"}
E, H, WIDTH, K = 16, 64, 48, 8


class _OpNames(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _config() -> Qwen3ModelConfig:
    return Qwen3ModelConfig.from_dict({"model_type": "qwen3_moe", "vocab_size": 100, "hidden_size": H,
                                       "intermediate_size": 96, "moe_intermediate_size": WIDTH, "num_experts": E,
                                       "num_experts_per_tok": K, "norm_topk_prob": True, "num_hidden_layers": 1,
                                       "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32})


def _experts(seed: int = 0) -> tuple[GroupedExperts, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    experts = GroupedExperts(E, H, WIDTH)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(E, 2 * WIDTH, H, generator=gen))
        experts.down_proj.copy_(torch.randn(E, H, WIDTH, generator=gen))
    x = torch.randn(37, H, generator=gen)
    weights, ids = torch.topk(torch.softmax(torch.randn(37, E, generator=gen), -1), K, dim=-1)
    return experts, x, ids, weights


def test_experts_sum_each_token_in_top_k_order_as_transformers_grouped_mm() -> None:
    """Bit for bit (top 8 of 16: the order of the 8 additions shows in float32's last bits)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    # NOTE: one intra-op thread (conftest's), whatever an earlier test left: float32 GEMMs split
    # their sums by thread count, differently in the two grouped kernels
    torch.set_num_threads(1)
    experts, x, ids, weights = _experts()
    config = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=WIDTH, num_experts=E, num_experts_per_tok=K)
    config._experts_implementation = "grouped_mm"
    reference = Qwen3MoeExperts(config)
    reference.load_state_dict(experts.state_dict())
    with torch.inference_mode():
        assert torch.equal(experts(x, ids, weights), reference(x, ids, weights))


def test_the_grouped_forward_never_syncs_nor_adds_with_atomics() -> None:
    experts, x, ids, weights = _experts(1)
    with torch.inference_mode(), _OpNames() as ops:
        experts(x, ids, weights)
    assert "_grouped_mm" in ops.names  # the path under test
    assert not ops.names & FORBIDDEN, f"host syncs or atomic float adds on the MoE forward: {ops.names & FORBIDDEN}"


@pytest.mark.parametrize("grouped_mm", [True, False], ids=["grouped_mm", "expert-loop"])
def test_the_moe_block_traces_as_one_graph(monkeypatch: pytest.MonkeyPatch, grouped_mm: bool) -> None:
    """torch.compile(fullgraph=True) raises at any graph break: a host sync, a data-dependent branch,
    as the per-expert loop's (the check's control). bfloat16: the grouped GEMM's meta kernel, which
    tracing runs, takes bfloat16 only (as on CUDA)."""
    monkeypatch.setattr(moe, "_has_grouped_mm", lambda x: grouped_mm)
    block = SparseMoeBlock(_config()).to(torch.bfloat16)
    for param in block.parameters():
        torch.nn.init.normal_(param)
    x = torch.randn(5, H, dtype=torch.bfloat16)
    torch._dynamo.reset()
    with torch.inference_mode():
        if not grouped_mm:
            with pytest.raises((torch._dynamo.exc.Unsupported, GuardOnDataDependentSymNode)):
                torch.compile(block, fullgraph=True, backend="eager", dynamic=False)(x)
            return
        compiled = torch.compile(block, fullgraph=True, backend="eager", dynamic=False)(x)
        torch.testing.assert_close(compiled, block(x), rtol=0, atol=0)


def test_only_the_per_expert_loop_is_not_capture_safe(monkeypatch: pytest.MonkeyPatch) -> None:
    model = Qwen3ForCausalLM(_config(), max_positions=64)
    assert model.capture_safe()
    monkeypatch.setattr(moe, "_has_grouped_mm", lambda x: False)
    assert not model.capture_safe()
