"""The KV layout descriptor two workers compare before any KV moves between them.

A prefill worker may only write into a decode worker's pool when both pools agree on what a block
*is*: same model, same block size, same per-layer shape and the same order of dimensions.
`KVLayout` captures exactly that (the number of blocks is each pool's own business). The element
type may differ between two float types (`CONVERTIBLE_DTYPES`, each side's `--kv-cache-dtype`): the
sender sends its own bytes and the receiver converts them on arrival into its pool's type.

An FP8 pool's bytes mean `element * scale`, one K and one V scale per layer (model/kv_scales.py):
its layout carries them (`k_scales`, `v_scales`), and every layer payload names the scales of its
own bytes (LayerHeader), so a receiver converts float payloads into FP8 with its own scales, FP8
payloads into float, and rescales an FP8 payload whose scales are not its own:

    payload (dtype, k_scale, v_scale)  ->  float32 values = element * scale  ->  pool (quantize)
    the same dtype and scales          ->  bytes copied as they are (in place over tcp and nixl)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from pdserve.disagg import wire
from pdserve.engine.block_pool import POOL_LAYOUT
from pdserve.model.kv_scales import KVScales

# The schema of the records the KV transports exchange (transport/messages.py). Bump it with any
# change to one of them: two workers that disagree refuse each other at the handshake, naming this
# field, instead of failing every hand-off later on an undecodable frame. 2: KVDone carries its
# generator state and prefill phases as fields (1 packed them into one `extra` byte string).
# 3: the connection opens with decode's CHALLENGE (cluster-secret proofs); KV headers carry the
# reservation token. 4: the KV layout names tp_size and kv_head_start; DONE carries
# prefill_cached_tokens (absent from an older peer's: 0, see wire.py). 5: DONE carries the prompt's
# logprobs (prompt_logprobs through the router); an older decode would refuse the unknown field.
# 6: nixl's WELCOME carries decode's connection info only, each GRANT the metadata of the
# registration it writes into (an older prefill would find no registration to write to).
# 7: a layer header names the KV heads its payload holds (one tensor-parallel rank's, see
# KVLayout.check_handoff); an older decode would take a rank's heads for the whole pool's.
# 8: FP8 pools: the layout carries per-layer K/V scales, a layer header the scales of its bytes (an
# older decode would take FP8 bytes with other scales for its own).
# 9: DONE carries the hand-off record (disagg/handoff.py, versioned on its own) as one opaque field
# instead of its fields (an older decode would refuse the unknown field).
WIRE_VERSION = 9

FP8_DTYPES = frozenset({"float8_e4m3fn", "float8_e5m2"})
# Element types a receiver converts between on arrival (any pair; FP8 with the scales in the headers;
# not a quantized format stored in another type, e.g. FP8 in uint8: its bytes name no scales).
CONVERTIBLE_DTYPES = frozenset({"float32", "bfloat16", "float16"}) | FP8_DTYPES

_ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "uint8": 1}


class KVLayoutMismatch(ValueError):
    """Two pools disagree on a layout field; the message names the field and both values."""

    def __init__(self, field: str, local: str, peer: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.local = local
        self.peer = peer


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What one block of one layer looks like in a pool; sent as JSON in the transport handshake.

    `dtype` is the pool tensor's element type, i.e. what the bytes on the wire mean.
    `kv_cache_dtype` is the logical KV format (vLLM's `--kv-cache-dtype`); it equals `dtype` unless
    the pool stores a quantized format in a storage type (e.g. fp8 in uint8).
    Tensor parallelism: the pool holds the model's KV heads [kv_head_start, kv_head_start +
    num_kv_heads). A worker with `tp_size` ranks on CPU presents one pool its ranks share, holding
    every head, so any two TP sizes map (the peer's `tp_size` is reported, not compared). A prefill
    worker whose ranks each have a pool of their own (CUDA) hands off from every rank: each rank's
    pool, holding its heads, may send into a decode pool holding them (`check_handoff`).
    `k_scales`, `v_scales`: an FP8 pool's, one per layer (element * scale = value); empty for a
    float pool (its scales are 1.0).
    """

    model_id: str
    dtype: str
    kv_cache_dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    layout: str = POOL_LAYOUT
    wire_version: int = WIRE_VERSION
    kv_head_start: int = 0
    tp_size: int = dataclasses.field(default=1, compare=False)
    k_scales: tuple[float, ...] = ()
    v_scales: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.dtype not in _ELEMENT_BYTES:
            raise ValueError(f"unsupported KV dtype {self.dtype!r}; known: {', '.join(_ELEMENT_BYTES)}")
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"KV layout {name} must be >= 1, got {getattr(self, name)}")
        if self.kv_cache_dtype in FP8_DTYPES:
            if not len(self.k_scales) == len(self.v_scales) == self.num_layers:
                raise ValueError(f"an FP8 KV layout needs {self.num_layers} K and V scales (one per layer), "
                                 f"got {len(self.k_scales)} and {len(self.v_scales)}")
            KVScales(self.k_scales, self.v_scales)  # raises unless finite, > 0
        elif self.k_scales or self.v_scales:
            raise ValueError(f"KV scales belong to FP8 pools only, not to a {self.kv_cache_dtype} pool")

    @classmethod
    def from_pool(cls, model_id: str, kv_cache: torch.Tensor, kv_cache_dtype: str | None = None,
                  tp_size: int = 1, *, strided: bool = False, scales: KVScales | None = None) -> KVLayout:
        """Describe an engine pool of shape [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim].
        `strided`: the pool may be a view of some heads of a larger one (a tcp sender gathers).
        `scales`: an FP8 pool's (`EngineConfig.kv_scales`)."""
        if kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
            raise ValueError(f"expected a pool shaped [layers, 2, blocks, block_size, kv_heads, head_dim], "
                             f"got {tuple(kv_cache.shape)}")
        if not strided and not kv_cache.is_contiguous():
            raise ValueError("the KV pool must be contiguous: transports address blocks by offset")
        dtype = str(kv_cache.dtype).removeprefix("torch.")
        num_layers, _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        return cls(model_id, dtype, kv_cache_dtype or dtype, block_size, num_layers, num_kv_heads, head_dim,
                   tp_size=tp_size, k_scales=scales.k if scales else (), v_scales=scales.v if scales else ())

    @property
    def element_bytes(self) -> int:
        return _ELEMENT_BYTES[self.dtype]

    @property
    def region_bytes(self) -> int:
        """One block of K (or of V) for one layer: kv_cache[l, kv, b] is this many contiguous bytes."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.element_bytes

    @property
    def block_bytes_per_layer(self) -> int:
        """K and V of one block for one layer: the unit every payload is a whole multiple of."""
        return 2 * self.region_bytes

    def payload_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of one layer's payload for `num_blocks` blocks: [k|v, block, slot, head, dim]."""
        return (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def kv_head_end(self) -> int:
        return self.kv_head_start + self.num_kv_heads

    def holds_heads(self, start: int, count: int) -> bool:
        """Whether this pool holds KV heads [start, start + count)."""
        return count >= 1 and self.kv_head_start <= start and start + count <= self.kv_head_end

    def with_heads(self, start: int, count: int) -> KVLayout:
        """This layout holding heads [start, start + count): what a payload of those heads looks like."""
        return dataclasses.replace(self, kv_head_start=start, num_kv_heads=count)

    def layer_scales(self, layer: int) -> tuple[float, float]:
        """(k_scale, v_scale) of `layer`: element * scale is the value (1.0 in a float pool). NOTE: a
        quantized format stored in another type (FP8 in uint8) names none: its bytes convert to nothing."""
        return (self.k_scales[layer], self.v_scales[layer]) if self.dtype in FP8_DTYPES else (1.0, 1.0)

    def stores_as(self, dtype: str, scales: tuple[float, float], layer: int) -> bool:
        """Whether a payload of `layer` in `dtype` elements with these scales holds exactly this
        pool's bytes (copied as they are; otherwise converted, `converts_payload`)."""
        return dtype == self.dtype and (dtype not in FP8_DTYPES or scales == self.layer_scales(layer))

    def converts_payload(self, dtype: str) -> bool:
        """Whether this pool converts payloads of `dtype` elements on arrival: both are types of
        `CONVERTIBLE_DTYPES`, and this pool stores its logical type as it is."""
        return {self.dtype, dtype} <= CONVERTIBLE_DTYPES and self.kv_cache_dtype == self.dtype

    def converts_from(self, peer: KVLayout) -> bool:
        """Whether a receiver with this layout converts `peer`'s payloads on arrival: both pools hold
        types of `CONVERTIBLE_DTYPES` as they are, and their element types or scales differ."""
        return (peer.kv_cache_dtype == peer.dtype and self.converts_payload(peer.dtype)
                and (self.dtype, self.k_scales, self.v_scales) != (peer.dtype, peer.k_scales, peer.v_scales))

    def as_dtype(self, dtype: str) -> KVLayout:
        """This layout holding `dtype` elements: what a payload a peer sends in `dtype` looks like
        (its byte counts and shapes). NOTE: an FP8 one keeps this layout's scales, else gets 1.0:
        a payload's own scales are in its header."""
        fp8 = dtype in FP8_DTYPES
        k = (self.k_scales or (1.0,) * self.num_layers) if fp8 else ()
        v = (self.v_scales or (1.0,) * self.num_layers) if fp8 else ()
        return dataclasses.replace(self, dtype=dtype, kv_cache_dtype=dtype, k_scales=k, v_scales=v)

    def check_handoff(self, decode: KVLayout) -> None:
        """This (prefill) pool may send its KV into `decode`'s: `check_compatible` with dtype
        conversion, except that the decode pool need only hold every head this one holds (one
        rank of a prefill worker whose ranks each send their own heads)."""
        self.check_compatible(decode, self_role="prefill", peer_role="decode", convert_dtype=True,
                              heads_within=True)

    def check_compatible(self, peer: KVLayout, *, self_role: str = "local", peer_role: str = "peer",
                         convert_dtype: bool = False, heads_within: bool = False) -> None:
        """Raise KVLayoutMismatch naming the first field (in declaration order) that differs.
        `convert_dtype` (the KV hand-off): element types that `converts_from` maps are no mismatch.
        `heads_within`: this pool's heads need only lie within the peer's."""
        converts = convert_dtype and self.converts_from(peer)
        skip = {"dtype", "kv_cache_dtype", "k_scales", "v_scales"} if converts else set()
        if heads_within:
            skip |= {"num_kv_heads", "kv_head_start"}
            if not peer.holds_heads(self.kv_head_start, self.num_kv_heads):
                mine = f"[{self.kv_head_start}, {self.kv_head_end})"
                theirs = f"[{peer.kv_head_start}, {peer.kv_head_end})"
                raise KVLayoutMismatch("kv_head_start", mine, theirs, f"KV layout mismatch on kv_head_start: "
                                       f"{self_role} holds KV heads {mine}, not within {peer_role}'s {theirs}")
        for field in dataclasses.fields(self):
            if not field.compare or field.name in skip:
                continue
            mine, theirs = getattr(self, field.name), getattr(peer, field.name)
            if mine != theirs:
                message = f"KV layout mismatch on {field.name}: {self_role} has {mine}, {peer_role} has {theirs}"
                raise KVLayoutMismatch(field.name, str(mine), str(theirs), message)

    def to_json(self) -> str:
        return wire.dumps(self).decode()

    @classmethod
    def from_json(cls, text: str | bytes) -> KVLayout:
        return wire.loads(cls, text)
