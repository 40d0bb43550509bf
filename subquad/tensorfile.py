"""Reading a safetensors file (model folders and training checkpoints alike): plain reads into fresh tensors,
or, for the tensors asked for, views of a private memory map of the file; and writing one (``save_file``)."""

from __future__ import annotations

import json
import math
import mmap
import os
from pathlib import Path

import torch

_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def read_safetensors(file, mapped=(), check=None) -> dict:
    """Every tensor of one safetensors file, by name, each read with plain file reads into a fresh tensor -
    except the names in ``mapped``, which are views of a private (copy-on-write) memory map of the file.

    Not ``safetensors.torch.load_file``: it copies out of a memory map of the file, and a mapped file's pages
    count in the process's resident memory while the map is open, so loading peaked at twice the weights.
    ``mapped`` is for a tensor a model reads a few rows of (an untied embedding: a forward touches the rows of
    its tokens only): its pages stay on disk until a row is read, as llama.cpp and transformers keep all
    their weights. Writing to such a tensor copies the pages written, never the file. ``check(name, tensor)``
    runs on each tensor as it is read (to refuse one by raising); a mapped tensor's pages it touched are then
    dropped from the process's resident memory again (read back from the page cache when next touched).
    The format: 8 bytes (little-endian u64) N, N bytes of JSON {name: {dtype, shape, data_offsets: [begin,
    end]}, "__metadata__": ...}, then the data, offsets counted from its start. Anything that does not add up
    (a short file, offsets past its end, a size that disagrees with dtype x shape) raises ValueError."""
    file = Path(file)
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{size} bytes: shorter than the 8-byte header length")
        n = int.from_bytes(head, "little")
        if n > size - 8:
            raise ValueError(f"the header claims {n:,} bytes, the file has {size - 8:,} after its length")
        header = json.loads(f.read(n))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
        base, out, mm = 8 + n, {}, None
        entries = sorted(((k, v) for k, v in header.items() if k != "__metadata__"),
                         key=lambda kv: kv[1]["data_offsets"][0])       # in file order: sequential reads
        for name, info in entries:
            dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
            if dtype is None:
                raise ValueError(f"tensor {name}: dtype {info['dtype']!r} is not one this reader knows")
            shape, (begin, end) = [int(d) for d in info["shape"]], info["data_offsets"]
            nbytes = math.prod(shape) * dtype.itemsize
            if end - begin != nbytes or begin < 0:
                raise ValueError(f"tensor {name}: offsets [{begin}, {end}) do not hold {info['dtype']} {shape}")
            if base + end > size:
                raise ValueError(f"tensor {name} ends at byte {base + end:,}, past the file's end ({size:,})")
            at = base + begin
            on_map = name in mapped and nbytes and at % dtype.itemsize == 0    # (misaligned: read, as any other)
            if on_map:
                mm = mm or mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
                buf = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=at)
            else:
                buf = torch.empty(nbytes, dtype=torch.uint8)
                f.seek(at)
                if nbytes and f.readinto(buf.numpy()) != nbytes:
                    raise ValueError(f"tensor {name}: the file ended inside it")
            out[name] = buf.view(dtype).reshape(shape)
            if check is not None:
                check(name, out[name])
                if on_map:
                    _drop_pages(mm, at, nbytes)
    return out


def _drop_pages(mm, start, nbytes):
    """Drop the pages of ``mm``'s bytes [start, start + nbytes) from resident memory (those wholly inside: the
    neighbours' data may share the edge pages). Only for pages never written: a private map's written pages
    would revert to the file's bytes."""
    if not hasattr(mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
        return                                                  # (a platform without it: pages stay resident)
    lo = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    hi = (start + nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if hi > lo:
        mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


def save_file(tensors: dict, path, metadata: dict | None = None) -> None:
    """safetensors' ``save_file``, the file then given the mode any other file written here gets (0644 under
    the usual umask): safetensors creates it 0600, which a server running as another user cannot read."""
    from safetensors.torch import save_file as write

    write(tensors, str(path), metadata=metadata)
    os.chmod(path, 0o666 & ~_umask())


def _umask() -> int:
    """The process's umask, read where Linux states it (``/proc/self/status``) rather than set and restored:
    ``os.umask`` alone changes it for every thread for that moment."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask

