"""Reading a GGUF file (ggml's format, version 3; llama.cpp's gguf-py ``GGUFReader`` is the reference the tests
hold this to): the metadata, the tensor table, and each tensor's data as a torch view of the mapped file.

    "GGUF" | version u32 | n_tensors u64 | n_kv u64
    n_kv x      (key: string, type: u32, value)               string = length u64 + UTF-8 bytes
    n_tensors x (name: string, n_dims: u32, ne: u64 x n_dims, type: u32, offset: u64)
    padding to ``general.alignment`` (default 32), then the tensors' data, each at its offset

``ne`` is ggml's order (ne[0] varies fastest): the tensor's torch shape is ``ne`` reversed, and a block type
runs its blocks along the last torch dimension (a row of a matrix). Block types, per block of ``bs`` values:

    Q8_0  bs 32:   d f16 | q int8 x 32                        w = q d
    Q4_0  bs 32:   d f16 | 16 bytes: values j (low nibble), 16 + j (high)   w = (nibble - 8) d
    Q4_K  bs 256:  d f16 | dmin f16 | 12 bytes of 6-bit (scale, min) x 8 | 128 bytes of nibbles
                   w = q (d sc_j) - dmin m_j  in 8 sub-blocks j of 32
    Q6_K  bs 256:  ql 128 bytes | qh 64 bytes | scales int8 x 16 | d f16
                   w = (q - 32) (d sc_j)  in 16 sub-blocks j of 16, q 6-bit

``blocks`` returns such a tensor as (q int8 (N, K), scale (N, G), offset (N, G) or None) with
w = q * scale - offset per sub-block: float32 products in the order ``gguf.quants`` computes them, so its
``dequantize`` and ours agree bit for bit.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

MAGIC = b"GGUF"
# value types of the metadata: struct format per scalar type; 8 string, 9 array
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
# tensor types: name, values per block, bytes per block
TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 30: ("BF16", 1, 2), 28: ("F64", 1, 8),
         24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8),
         2: ("Q4_0", 32, 18), 8: ("Q8_0", 32, 34), 12: ("Q4_K", 256, 144), 14: ("Q6_K", 256, 210)}
PLAIN = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
         "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64}
BLOCKED = ("Q4_0", "Q8_0", "Q4_K", "Q6_K")


@dataclass
class TensorInfo:
    name: str
    shape: tuple          # torch's order: ne reversed
    type: str             # a name of TYPES
    offset: int           # from the start of the file
    nbytes: int


class GGUFFile:
    """A GGUF file, mapped: ``metadata`` {key: value} (arrays as lists), ``tensors`` {name: TensorInfo},
    ``raw(name)`` (the bytes), ``blocks(name)`` and ``dequantize(name)``. ValueError for what is not GGUF v2/v3,
    a type it does not read, or a file cut short - naming the file and what it found."""

    def __init__(self, path):
        self.path = Path(path)
        if not self.path.is_file():
            raise ValueError(f"{self.path}: no such GGUF file" + (" (it is a folder)" if self.path.exists() else ""))
        if self.path.stat().st_size < 24:
            raise ValueError(f"{self.path}: not a GGUF file ({self.path.stat().st_size} bytes: shorter than its "
                             "header)")
        with open(self.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)   # writable for torch, never written
        self._pos = 0
        if self._read(4) != MAGIC:
            raise ValueError(f"{self.path}: not a GGUF file (it does not start with b'GGUF')")
        version, n_tensors, n_kv = self._unpack("<I"), self._unpack("<Q"), self._unpack("<Q")
        if version not in (2, 3):
            raise ValueError(f"{self.path}: GGUF version {version}; subquad reads versions 2 and 3")
        self.version = version
        self.metadata = {}
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(self._unpack("<I"))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            ne = [self._unpack("<Q") for _ in range(self._unpack("<I"))]
            code, offset = self._unpack("<I"), self._unpack("<Q")
            if code not in TYPES:
                raise ValueError(f"{self.path}: tensor {name} has ggml type {code}, which subquad does not read "
                                 f"(it reads {', '.join(t[0] for t in TYPES.values())})")
            kind, bs, nb = TYPES[code]
            n = 1
            for d in ne:
                n *= d
            if ne and ne[0] % bs:
                raise ValueError(f"{self.path}: tensor {name} of type {kind} has rows of {ne[0]} values, not a "
                                 f"multiple of its block of {bs}")
            infos.append((name, tuple(reversed(ne)), kind, offset, n // bs * nb))
        align = int(self.metadata.get("general.alignment", 32))
        start = -(-self._pos // align) * align
        self.tensors = {}
        for name, shape, kind, offset, nbytes in infos:
            if start + offset + nbytes > len(self._map):
                raise ValueError(f"{self.path}: tensor {name} ends past the end of the file (cut short?)")
            self.tensors[name] = TensorInfo(name, shape, kind, start + offset, nbytes)

    # ----------------------------------------------------------------------------------------- the header
    def _read(self, n: int) -> bytes:
        if self._pos + n > len(self._map):
            raise ValueError(f"{self.path}: the header ends past the end of the file (cut short?)")
        b = self._map[self._pos:self._pos + n]
        self._pos += n
        return b

    def _unpack(self, fmt: str):
        return struct.unpack(fmt, self._read(struct.calcsize(fmt)))[0]

    def _string(self) -> str:
        return self._read(self._unpack("<Q")).decode("utf-8", errors="replace")

    def _value(self, kind: int):
        if kind in SCALARS:
            return self._unpack(SCALARS[kind])
        if kind == STRING:
            return self._string()
        if kind == ARRAY:
            inner, n = self._unpack("<I"), self._unpack("<Q")
            if inner in SCALARS and inner != 7:                 # one read for a numeric array
                fmt = SCALARS[inner]
                return list(struct.unpack(f"<{n}{fmt[1]}", self._read(n * struct.calcsize(fmt))))
            return [self._value(inner) for _ in range(n)]
        raise ValueError(f"{self.path}: metadata value of unknown type {kind} at byte {self._pos}")

    # ----------------------------------------------------------------------------------------- the data
    def raw(self, name: str) -> torch.Tensor:
        """The tensor's bytes, a uint8 view of the mapped file (no copy)."""
        t = self.tensors[name]
        return torch.frombuffer(self._map, dtype=torch.uint8, count=t.nbytes, offset=t.offset)

    def plain(self, name: str) -> torch.Tensor:
        """A tensor of a plain type (F32, F16, BF16, F64, I8..I64) in its own dtype, a view of the file."""
        t = self.tensors[name]
        return self.raw(name).view(PLAIN[t.type]).view(t.shape)

    def blocks(self, name: str):
        """A block type's tensor (..., K) as (q int8 (..., K), scale (..., G), offset (..., G) or None): module doc."""
        t = self.tensors[name]
        lead, K = t.shape[:-1], t.shape[-1]
        q, scale, offset = UNPACK[t.type](self.raw(name).view(-1, TYPES_BY_NAME[t.type][1]))
        G = scale.shape[-1] * (K // TYPES_BY_NAME[t.type][0])
        return (q.reshape(*lead, K), scale.reshape(*lead, G),
                None if offset is None else offset.reshape(*lead, G))

    def dequantize(self, name: str) -> torch.Tensor:
        """Any tensor as float32 (block types per their formula; the naive form ``Int8Linear.from_blocks`` holds)."""
        t = self.tensors[name]
        if t.type in PLAIN:
            return self.plain(name).float()
        q, scale, offset = self.blocks(name)
        return block_dequantize(q, scale, offset)


def block_dequantize(q, scale, offset=None) -> torch.Tensor:
    """q (..., K) * scale - offset per sub-block ((..., G) each) in float32."""
    *lead, K = q.shape
    G = scale.shape[-1]
    w = q.reshape(*lead, G, K // G).float() * scale[..., None]
    if offset is not None:
        w = w - offset[..., None]
    return w.reshape(*lead, K)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """(n, 2) bytes -> (n, 1) float32 from float16."""
    return b.contiguous().view(torch.float16).float()


def _q8_0(b):
    return b[:, 2:].contiguous().view(torch.int8), _f16(b[:, :2]), None


def _q4_0(b):
    qs = b[:, 2:]
    q = torch.cat([qs & 15, qs >> 4], 1).to(torch.int8) - 8           # values 0..15 low nibbles, 16..31 high
    return q, _f16(b[:, :2]), None


def _q4_k(b):
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    s = b[:, 4:16].view(n, 3, 4)
    dd, m, md = s[:, 0], s[:, 1], s[:, 2]                              # 6-bit scales and mins of 8 sub-blocks
    sc = torch.cat([dd & 63, (md & 15) | ((dd >> 2) & 48)], 1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 48)], 1)
    qs = b[:, 16:].reshape(n, 4, 1, 32)
    q = torch.cat([qs & 15, qs >> 4], 2).reshape(n, 256).to(torch.int8)   # sub-block 2j: low nibbles of chunk j
    return q, d * sc.float(), dmin * mn.float()


def _q6_k(b):
    n = b.shape[0]
    ql, qh = b[:, :128].reshape(n, 2, 1, 64), b[:, 128:192].reshape(n, 2, 1, 32)
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    d = _f16(b[:, 208:210])
    lo = torch.cat([ql & 15, ql >> 4], 2).reshape(n, 2, 4, 32)
    hi = torch.cat([qh & 3, (qh >> 2) & 3, (qh >> 4) & 3, (qh >> 6) & 3], 2)
    q = (lo | hi << 4).to(torch.int8).reshape(n, 256) - 32
    return q, d * scales, None


UNPACK = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_K": _q4_k, "Q6_K": _q6_k}
TYPES_BY_NAME = {name: (bs, nb) for name, bs, nb in TYPES.values()}
