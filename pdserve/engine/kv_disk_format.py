"""The disk tier's file format: one file per full KV block, named by the block's chained prefix hash
under a directory named by the pool's layout.

    DIR/<layout key>/<block hash>.kv        a complete block (written as .tmp-*, then renamed)

    offset  size  field
    0       8     MAGIC
    8       4     header length H (little endian), the bytes from offset 12 to the payload
    12      H     JSON: {"layout": {...}, "block_hash": hex, "payload_bytes": n, "crc32": c}
    12 + H  n     the block's KV: kv_cache[:, :, block] as [layer, k|v, slot, head, dim], pool dtype
                  (an FP8 pool's elements as they are: the layout names their dtype and scales)

A file is loaded only when every field matches what the reader expects (its layout, the hash it
looked up, the payload length, the checksum); anything else (torn by a crash, truncated, corrupt,
written by another model or layout) is a miss. The layout key in the directory name already keeps
other layouts apart; the header is what makes a misplaced or damaged file harmless.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.config import EngineConfig
from pdserve.engine.block_pool import POOL_LAYOUT

MAGIC = b"PDSKV\x00\x00\x01"
FORMAT_VERSION = 1
FILE_SUFFIX = ".kv"
TMP_PREFIX = ".tmp-"
_PREFIX = struct.Struct("<8sI")
_MAX_HEADER_BYTES = 64 << 10


class BadBlockFile(ValueError):
    """A block file that must not be loaded; the message says why (logged once, then removed)."""


@dataclass(frozen=True, slots=True)
class DiskLayout:
    """What a block on disk is: two pools may share files only when every field is equal. The
    engine's own descriptor (the transports' `disagg.kv_layout.KVLayout` is the wire's)."""

    model_id: str  # the checkpoint's real path and a digest of its config.json
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    # NOTE: 1: a block holds every KV head, also under tensor parallelism on CPU (the ranks share one
    # pool); a pool of one rank's heads (CUDA) has no disk tier (DiskOffload refuses it)
    tp_size: int = 1
    layout: str = POOL_LAYOUT
    format_version: int = FORMAT_VERSION
    # An FP8 pool's per-layer scales (model/kv_scales.py): its bytes mean element * scale, so a pool
    # with other scales must not read them; empty for a float pool
    k_scales: tuple[float, ...] = ()
    v_scales: tuple[float, ...] = ()

    @classmethod
    def of_engine(cls, config: EngineConfig) -> DiskLayout:
        m, scales = config.model, config.kv_scales
        return cls(_model_id(config.model_path), str(config.kv_dtype).removeprefix("torch."), config.cache.block_size,
                   m.num_hidden_layers, m.num_key_value_heads, m.head_dim, k_scales=scales.k if scales else (),
                   v_scales=scales.v if scales else ())

    def to_dict(self) -> dict[str, object]:
        """As JSON reads it back (lists); a float pool's empty scales left out, so its key (and its
        files) stay those of before FP8 pools had scales."""
        fields = {name: list(value) if isinstance(value, tuple) else value
                  for name, value in dataclasses.asdict(self).items()}
        return {name: value for name, value in fields.items() if value != []}

    @property
    def key(self) -> str:
        """The directory name of this layout's blocks."""
        text = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.blake2b(text, digest_size=8).hexdigest()

    def block_shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)


def _model_id(model_path: str) -> str:
    path = Path(model_path).resolve()
    config = path / "config.json"
    digest = hashlib.blake2b(config.read_bytes(), digest_size=8).hexdigest() if config.is_file() else "-"
    return f"{path}#{digest}"


def block_file_name(block_hash: bytes) -> str:
    return block_hash.hex() + FILE_SUFFIX


def encode_header(layout: DiskLayout, block_hash: bytes, payload: bytes | memoryview) -> bytes:
    header = json.dumps({"layout": layout.to_dict(), "block_hash": block_hash.hex(),
                         "payload_bytes": len(payload), "crc32": zlib.crc32(payload)}, sort_keys=True).encode()
    return _PREFIX.pack(MAGIC, len(header)) + header


def write_block_file(path: Path, layout: DiskLayout, block_hash: bytes, payload: memoryview) -> int:
    """Write one block crash-safely: a temporary name in the same directory, then an atomic
    rename, so a reader sees a whole file or none. Returns the file's size. Raises OSError.
    NOTE: the temporary name is random, not just the pid: writers in other containers sharing the
    directory may have the same pid, and two threads of one process the same pid."""
    tmp = path.with_name(f"{TMP_PREFIX}{os.getpid()}-{os.urandom(6).hex()}-{path.name}")
    header = encode_header(layout, block_hash, payload)
    try:
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(payload)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return len(header) + len(payload)


def read_block_file(path: Path, layout: DiskLayout, block_hash: bytes, dtype: torch.dtype) -> torch.Tensor:
    """The block's KV, shaped `layout.block_shape()`. Raises BadBlockFile for any file that does
    not carry exactly this block of this layout, FileNotFoundError when it is gone."""
    with open(path, "rb") as f:
        data = bytearray(os.fstat(f.fileno()).st_size)
        num_read = f.readinto(data)
    del data[num_read:]  # NOTE: a file shortened since the fstat reads as truncated, below
    if len(data) < _PREFIX.size:
        raise BadBlockFile("truncated before its header")
    magic, header_len = _PREFIX.unpack_from(data)
    if magic != MAGIC or header_len > _MAX_HEADER_BYTES:
        raise BadBlockFile("not a pdserve KV block file")
    try:
        header = json.loads(data[_PREFIX.size:_PREFIX.size + header_len])
    except ValueError as exc:
        raise BadBlockFile(f"unreadable header ({exc})") from exc
    if not isinstance(header, dict) or header.get("layout") != layout.to_dict():
        raise BadBlockFile("written for another model or KV layout")
    if header.get("block_hash") != block_hash.hex():
        raise BadBlockFile("holds another block")
    payload = memoryview(data)[_PREFIX.size + header_len:]
    if len(payload) != header.get("payload_bytes"):
        raise BadBlockFile(f"truncated: {len(payload)} payload bytes of {header.get('payload_bytes')}")
    if zlib.crc32(payload) != header.get("crc32"):
        raise BadBlockFile("checksum mismatch")
    if len(payload) != math.prod(layout.block_shape()) * torch.empty((), dtype=dtype).element_size():
        raise BadBlockFile("payload size does not match the layout")
    return torch.frombuffer(data, dtype=dtype, offset=_PREFIX.size + header_len).view(layout.block_shape())

