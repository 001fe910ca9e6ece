"""Load a Hugging Face Qwen3 or Qwen3-MoE checkpoint (single or sharded safetensors) straight into the model.

The model is built on the meta device, materialised once at the target dtype/device, and each
checkpoint tensor is memory-mapped and copied into its (slice of a) parameter, one at a time, so
no second full copy of the weights ever exists. A block-FP8 checkpoint's weights are dequantized
one tensor at a time on the way (fp8.py). Per-expert tensors (`mlp.experts.{e}.gate_proj.weight`,
as the official checkpoints and transformers' save_pretrained write them) land in expert e's slice
of the stacked `experts.gate_up_proj` / `experts.down_proj`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from pdserve.model.fp8 import SCALE_SUFFIX, FP8BlockQuantization, dequantize
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
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate|up|down)_proj$")
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

logger = logging.getLogger(__name__)
View = Callable[[torch.Tensor], torch.Tensor]  # a parameter -> the part of it one checkpoint tensor fills


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    return files


def _checkpoint_tensors(model_dir: Path, quantization: FP8BlockQuantization | None, dtype: torch.dtype,
                        device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight of the checkpoint, FP8 ones dequantized to `dtype` with their `weight_scale_inv`
    on `device` (NOTE: a CPU converts float8 element by element, ~10 ns each; a GPU moves half the
    bytes and converts them in parallel)."""
    with ExitStack() as stack:
        handles = [stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
                   for path in safetensors_files(model_dir)]
        where = {name: handle for handle in handles for name in handle.keys()}  # noqa: SIM118 - not iterable
        for name, handle in where.items():
            if name.endswith(SCALE_SUFFIX) and name.removesuffix(SCALE_SUFFIX) in where:
                continue  # read with its weight
            tensor = handle.get_tensor(name)
            scale = name + SCALE_SUFFIX
            if scale in where:
                if quantization is None:
                    raise ValueError(f"tensor {name!r} has a scale {scale!r} beside it but config.json has no "
                                     "quantization_config")
                tensor = dequantize(tensor.to(device), where[scale].get_tensor(scale).to(device),
                                    quantization.block_size, dtype)
            elif tensor.dtype in _FP8_DTYPES:
                raise ValueError(f"tensor {name!r} is {tensor.dtype} without a {scale.rsplit('.', 1)[-1]} beside it")
            yield name, tensor


def _shard_rows(cfg: Qwen3ModelConfig, fused: str, shard: int) -> tuple[int, int]:
    if fused.endswith("qkv_proj"):
        q_size = cfg.num_attention_heads * cfg.head_dim
        kv_size = cfg.num_key_value_heads * cfg.head_dim
        starts = (0, q_size, q_size + kv_size)
        sizes = (q_size, kv_size, kv_size)
        return starts[shard], sizes[shard]
    return shard * cfg.intermediate_size, cfg.intermediate_size


def _target(cfg: Qwen3ModelConfig, name: str) -> tuple[str, View | None]:
    """Checkpoint tensor name -> (our parameter name, the view of it the tensor fills; None: whole)."""
    match = _LAYER_NAME.match(name)
    if not match:
        return name.removeprefix("model."), None
    layer, module, kind = match.groups()
    expert = _EXPERT.match(module)
    if expert and cfg.moe is not None:
        index, proj = int(expert.group(1)), expert.group(2)
        if proj == "down":
            return f"layers.{layer}.mlp.experts.down_proj", lambda param: param[index]
        size = cfg.moe.moe_intermediate_size
        start = 0 if proj == "gate" else size
        return f"layers.{layer}.mlp.experts.gate_up_proj", lambda param: param[index].narrow(0, start, size)
    if module in _FUSED:
        fused, shard = _FUSED[module]
        first, count = _shard_rows(cfg, fused, shard)
        return f"layers.{layer}.{fused}.{kind}", lambda param: param.narrow(0, first, count)
    return f"layers.{layer}.{module}.{kind}", None


_INITS = ("normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_",
          "trunc_normal_", "zeros_", "ones_", "constant_")


_no_init_lock = threading.Lock()
_no_init_depth = 0  # loaders inside `_no_init` now (engines of one process may load at once)
_saved_inits: dict[str, Callable[..., torch.Tensor]] = {}


@contextlib.contextmanager
def _no_init() -> Iterator[None]:
    """Modules built without initialising their parameters: the checkpoint's weights replace them.
    Reentrant across threads: the first in patches torch.nn.init, the last out restores it."""
    global _no_init_depth
    with _no_init_lock:
        if _no_init_depth == 0:
            _saved_inits.update({name: getattr(torch.nn.init, name) for name in _INITS})
            for name in _INITS:
                setattr(torch.nn.init, name, _keep)
        _no_init_depth += 1
    try:
        yield
    finally:
        with _no_init_lock:
            _no_init_depth -= 1
            if _no_init_depth == 0:
                for name, init in _saved_inits.items():
                    setattr(torch.nn.init, name, init)


def _keep(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return tensor


def load_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device, max_positions: int,
               batch_size_hint: int = 64, group: ParallelGroup | None = None) -> Qwen3ForCausalLM:
    """`batch_size_hint`: typical rows per matmul (decode batch), for CPU weight prepacking.
    With a `group` (tensor parallelism), loads only this rank's slice of every weight."""
    start = time.monotonic()
    model_dir = Path(model_dir)
    full_cfg = Qwen3ModelConfig.from_dir(model_dir)
    shard = TPShard(0, 1) if group is None else TPShard(group.rank, group.size)
    cfg = shard.local_config(full_cfg) if group is not None else full_cfg
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        # NOTE: built where it runs, uninitialised (the checkpoint fills it), not on "meta": every op
        # on meta tensors (init, the RoPE tables) runs torch's reference ops, which import triton
        with torch.device(device), _no_init():
            model = Qwen3ForCausalLM(cfg, 1, group, shard.vocab_start(full_cfg))
    finally:
        torch.set_default_dtype(previous)
    model.rope = RotaryEmbedding(cfg, max_positions).to(device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    _copy_weights(model, cfg, model_dir, lambda module, tensor: shard.checkpoint_slice(full_cfg, module, tensor),
                  dtype)
    _log_weights(model, model_dir, cfg, dtype, device, time.monotonic() - start)
    if can_pack(device, dtype):
        pack_linears(model, batch_size_hint)
    return model.eval()


def _log_weights(model: Qwen3ForCausalLM, model_dir: Path, cfg: Qwen3ModelConfig, dtype: torch.dtype,
                 device: torch.device, load_s: float) -> None:
    params = {id(p): p for p in model.parameters()}.values()
    num_bytes = sum(p.numel() * p.element_size() for p in params)
    source = (f"block-FP8 checkpoint {list(cfg.quantization.block_size)} dequantized at load"
              if cfg.quantization is not None else "float checkpoint")
    rank = "" if model.group is None else f" (rank {model.group.rank} of {model.group.size}: its share)"
    logger.info("weights of %s: %.1f M parameters, %.3f GiB in %s on %s%s; %s; loaded in %.2f s", model_dir.name,
                sum(p.numel() for p in params) / 1e6, num_bytes / 1024**3, str(dtype).removeprefix("torch."),
                device, rank, source, load_s)


def _copy_weights(model: Qwen3ForCausalLM, cfg: Qwen3ModelConfig, model_dir: Path,
                  slice_for_rank: Callable[[str, torch.Tensor], torch.Tensor], dtype: torch.dtype) -> None:
    """`cfg`: the shapes of `model` (this rank's share); `slice_for_rank(module, tensor)` cuts a
    checkpoint tensor down to that share."""
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: dict[str, int] = {}  # parameter -> elements filled
    for name, full in _checkpoint_tensors(model_dir, cfg.quantization, dtype, params["embed_tokens.weight"].device):
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue  # the tied head is the embedding; some tied checkpoints still store a copy
        if is_kv_scale_name(name):
            continue  # an FP8 KV cache's scale (config.py reads them), not a weight
        tensor = slice_for_rank(name.rsplit(".", 1)[0], full)
        target, view = _target(cfg, name)
        if target not in params:
            raise ValueError(f"unexpected tensor {name!r} in checkpoint {model_dir}")
        param = params[target].data
        dest = param if view is None else view(param)
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, config implies {tuple(dest.shape)}")
        with torch.no_grad():
            dest.copy_(tensor)
        loaded[target] = loaded.get(target, 0) + dest.numel()
    missing = [n for n, p in params.items() if loaded.get(n, 0) != p.numel()
               and not (cfg.tie_word_embeddings and n == "lm_head.weight")]
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks weights for: {', '.join(sorted(missing)[:8])}")
