"""Load a Hugging Face Qwen3 checkpoint (single or sharded safetensors) straight into the model.

The model is built on the meta device, materialised once at the target dtype/device, and each
checkpoint tensor is memory-mapped and copied into its (slice of a) parameter, one at a time, so
no second full copy of the weights ever exists.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from pdserve.model.kv_scales import is_kv_scale_name
from pdserve.model.packed_linear import can_pack, pack_linears
from pdserve.model.parallel import ParallelGroup, TPShard
from pdserve.model.qwen3 import Qwen3ForCausalLM, RotaryEmbedding
from pdserve.model.qwen3_config import Qwen3ModelConfig

# checkpoint name suffix -> (our parameter suffix, shard index in the fused parameter)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    return files


def _checkpoint_tensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                yield name, handle.get_tensor(name)


def _shard_rows(cfg: Qwen3ModelConfig, fused: str, shard: int) -> tuple[int, int]:
    if fused.endswith("qkv_proj"):
        q_size = cfg.num_attention_heads * cfg.head_dim
        kv_size = cfg.num_key_value_heads * cfg.head_dim
        starts = (0, q_size, q_size + kv_size)
        sizes = (q_size, kv_size, kv_size)
        return starts[shard], sizes[shard]
    return shard * cfg.intermediate_size, cfg.intermediate_size


def _target(cfg: Qwen3ModelConfig, name: str) -> tuple[str, tuple[int, int] | None]:
    """Checkpoint tensor name -> (our parameter name, (row start, row count) or None for whole)."""
    match = _LAYER_NAME.match(name)
    if match:
        layer, module, kind = match.groups()
        if module in _FUSED:
            fused, shard = _FUSED[module]
            return f"layers.{layer}.{fused}.{kind}", _shard_rows(cfg, fused, shard)
        return f"layers.{layer}.{module}.{kind}", None
    if name.startswith("model."):
        return name.removeprefix("model."), None
    return name, None


def load_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device, max_positions: int,
               batch_size_hint: int = 64, group: ParallelGroup | None = None) -> Qwen3ForCausalLM:
    """`batch_size_hint`: typical rows per matmul (decode batch), for CPU weight prepacking.
    With a `group` (tensor parallelism), loads only this rank's slice of every weight."""
    model_dir = Path(model_dir)
    full_cfg = Qwen3ModelConfig.from_dir(model_dir)
    shard = TPShard(0, 1) if group is None else TPShard(group.rank, group.size)
    cfg = shard.local_config(full_cfg) if group is not None else full_cfg
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = Qwen3ForCausalLM(cfg, 1, group, shard.vocab_start(full_cfg))
    finally:
        torch.set_default_dtype(previous)
    model.to_empty(device=device)
    model.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, max_positions).to(device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    _copy_weights(model, cfg, model_dir, lambda module, tensor: shard.checkpoint_slice(full_cfg, module, tensor))
    if can_pack(device, dtype):
        pack_linears(model, batch_size_hint)
    return model.eval()


def _copy_weights(model: Qwen3ForCausalLM, cfg: Qwen3ModelConfig, model_dir: Path,
                  slice_for_rank: Callable[[str, torch.Tensor], torch.Tensor]) -> None:
    """`cfg`: the shapes of `model` (this rank's share); `slice_for_rank(module, tensor)` cuts a
    checkpoint tensor down to that share."""
    params = dict(model.named_parameters(remove_duplicate=False))
    rows_loaded: dict[str, int] = {}
    for name, full in _checkpoint_tensors(model_dir):
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue  # the tied head is the embedding; some tied checkpoints still store a copy
        if is_kv_scale_name(name):
            continue  # an FP8 KV cache's scale (config.py reads them), not a weight
        tensor = slice_for_rank(name.rsplit(".", 1)[0], full)
        target, rows = _target(cfg, name)
        if target not in params:
            raise ValueError(f"unexpected tensor {name!r} in checkpoint {model_dir}")
        param = params[target].data
        dest = param if rows is None else param.narrow(0, rows[0], rows[1])
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, config implies {tuple(dest.shape)}")
        with torch.no_grad():
            dest.copy_(tensor)
        rows_loaded[target] = rows_loaded.get(target, 0) + dest.shape[0]
    missing = [n for n, p in params.items() if rows_loaded.get(n, 0) != p.shape[0]
               and not (cfg.tie_word_embeddings and n == "lm_head.weight")]
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks weights for: {', '.join(sorted(missing)[:8])}")
