"""``save_gguf``: a subquad ``LanguageModel`` written as a GGUF file llama.cpp loads - the file its converter
(``convert_hf_to_gguf.py``) would write from the Hugging Face checkpoint ``save_pretrained`` writes.

Types, as the converter chooses them: 1-D tensors, norms, convolutions and every tensor whose name does not
end in ``.weight`` (Mamba's A and D, biases) in F32; the other matrices in ``outtype``, F16 where a row is
not a multiple of the block (32 values: mamba-130m's dt_proj, 48 wide). ``outtype``:

    f32, f16, bf16   plain (bf16: float32 rounded to nearest even, as torch's and ggml's conversions)
    q8_0       per block of 32: d = max|x| / 127 (stored f16), q = round(x / d) (halves away from zero)
    q4_0       per block of 32: m = the value of largest |x| (its sign kept), d = m / -8 (stored f16),
               q = min(15, trunc(x / d + 8.5)) - 8
               (ggml's reference quantisers, ``ggml-quants.c``; the same bytes as ``gguf.quants.quantize``)

The tokenizer, when given, is written as the converter writes its vocabulary (``vocab.py``): a byte-level BPE as
llama.cpp's "gpt2" vocabulary (tokens, types, merges; padded with unused ``[PAD{i}]`` tokens to the embedding's
rows, as the converter pads) and whole as ``tokenizer.huggingface.json``, which ``from_pretrained`` reads back
first; RWKV's world tokenizer as "rwkv". The model's chat template and special tokens (its folder's
``tokenizer_config.json``, kept in ``model.hf_source``) go with it, as the converter's ``SpecialVocab`` writes them.
The file is written whole or not at all (a temporary file, then a rename).
"""

from __future__ import annotations

import os
import struct
import warnings
from pathlib import Path

import torch

from subquad.models.gguf.arch import U64, gguf_name
from subquad.models.gguf.registry import HF_TYPES
from subquad.models.gguf.qwen import QWEN_SOURCE_TYPES
from subquad.models.gguf.vocab import tokenizer_metadata

ALIGN = 32
OUTTYPES = {"f32": 0, "f16": 1, "bf16": 30, "q8_0": 8, "q4_0": 2}            # -> ggml type
FILE_TYPES = {"f32": 0, "f16": 1, "bf16": 32, "q8_0": 7, "q4_0": 2}   # llama_ftype: ALL_F32, MOSTLY_F16, ...


def _roundf(x):
    """Round halves away from zero, as ggml's roundf (gguf's np_roundf, term for term)."""
    a = x.abs()
    f = torch.floor(a)
    return torch.sign(x) * (f + torch.floor(2 * (a - f)))


def quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    """x (..., K) float32, K a multiple of 32 -> the Q8_0 bytes (..., K / 32 * 34)."""
    b = x.float().reshape(-1, 32)
    d = b.abs().amax(1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = _roundf(b * inv).to(torch.int8)
    out = torch.cat([d.half().view(torch.uint8), q.view(torch.uint8)], 1)
    return out.reshape(*x.shape[:-1], -1)


def quantize_q4_0(x: torch.Tensor) -> torch.Tensor:
    """x (..., K) float32, K a multiple of 32 -> the Q4_0 bytes (..., K / 32 * 18)."""
    b = x.float().reshape(-1, 32)
    m = b.gather(1, b.abs().argmax(1, keepdim=True))
    d = m / -8
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.trunc(b * inv + 8.5).clamp(0, 15).to(torch.uint8)
    out = torch.cat([d.half().view(torch.uint8), q[:, :16] | q[:, 16:] << 4], 1)
    return out.reshape(*x.shape[:-1], -1)


def _kind(name: str, t: torch.Tensor, outtype: str) -> str:
    if t.dim() <= 1 or name.endswith("_norm.weight") or ".ssm_conv1d" in name or ".shortconv.conv." in name \
            or ".ffn_gate_inp" in name or not name.endswith(".weight") \
            or name.endswith((".time_mix_w1.weight", ".time_mix_w2.weight", ".time_mix_lerp_fused.weight")):
        # ffn_gate_inp*: routers; Kimi's ssm_conv1d_{q,k,v}; RWKV's decay LoRA and lerps: F32 (the converter's list)
        return "f32"
    if outtype in ("q8_0", "q4_0") and t.shape[-1] % 32:
        return "f16"                                         # the converter's fallback for a row off the block
    return outtype


def _encode(kind: str, t: torch.Tensor) -> bytes:
    t = t.detach().float().contiguous()
    if kind == "f32":
        data = t.view(torch.uint8)
    elif kind in ("f16", "bf16"):
        data = t.to(torch.float16 if kind == "f16" else torch.bfloat16).view(torch.uint8)
    else:
        data = (quantize_q8_0 if kind == "q8_0" else quantize_q4_0)(t)
    return data.contiguous().numpy().tobytes()


# ------------------------------------------------------------------------------------------------- metadata
def _string(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _value(v) -> bytes:
    """A metadata value with its type: bool, u32 (ints: llama.cpp reads its counts as u32), f32, string, arrays
    of strings, bools, i32, u64 (``arch.U64``) or f32."""
    if isinstance(v, bool):
        return struct.pack("<I?", 7, v)
    if isinstance(v, int):
        return struct.pack("<II", 4, v) if 0 <= v < 1 << 32 else struct.pack("<Iq", 11, v)
    if isinstance(v, float):
        return struct.pack("<If", 6, v)
    if isinstance(v, str):
        return struct.pack("<I", 8) + _string(v)
    if isinstance(v, list):
        if all(isinstance(x, str) for x in v):
            return struct.pack("<IIQ", 9, 8, len(v)) + b"".join(_string(x) for x in v)
        if v and all(isinstance(x, bool) for x in v):                  # e.g. attention.recurrent_layers
            return struct.pack(f"<IIQ{len(v)}?", 9, 7, len(v), *v)
        if isinstance(v, U64):
            return struct.pack(f"<IIQ{len(v)}Q", 9, 10, len(v), *v)
        if all(isinstance(x, int) for x in v):
            return struct.pack(f"<IIQ{len(v)}i", 9, 5, len(v), *v)
        return struct.pack(f"<IIQ{len(v)}f", 9, 6, len(v), *v)
    raise TypeError(f"GGUF metadata value {v!r} of type {type(v).__name__} has no GGUF type here")


# ------------------------------------------------------------------------------------------------- the file
def save_gguf(model, path, outtype: str = "f32", tokenizer=None, name: str | None = None,
              model_type: str | None = None) -> dict:
    """Write ``model`` (float, of a Hugging Face type ``registry.HF_TYPES`` holds) as the GGUF file
    ``path`` (module doc; its folder made if missing) and return {GGUF tensor name: type written}. ``model_type``
    the Hugging Face type to write it as (default: ``save_pretrained``'s choice). ValueError for an
    unknown ``outtype``, a quantised model, or a structure no GGUF architecture here holds."""
    from subquad.models.hf.registry import MAPPINGS
    from subquad.models.hf.saver import checkpoint_tensors

    outtype = outtype.lower() if isinstance(outtype, str) else outtype    # "Q8_0", as file names spell it
    if outtype not in OUTTYPES:
        raise ValueError(f"outtype must be one of {', '.join(OUTTYPES)}, got {outtype!r}")
    if getattr(model, "quantized", None):
        raise ValueError(f"save_gguf writes a float model; this one is quantised ({model.quantized}): load it "
                         f"without quantize (a GGUF file's BF16 / F16 matrices: with dtype=torch.float32; a file of "
                         f"Q8_0 / Q4_0 / Q4_K / Q6_K blocks holds no float weights), and choose the GGUF type with "
                         f"outtype")
    source = ((getattr(model, "hf_source", None) or {}).get("config") or {}).get("model_type")
    asked = model_type
    try:
        if asked is not None:
            model_type, opts, tensors = checkpoint_tensors(model, asked)
        else:
            try:                                   # the type it was read as, where another type comes first
                model_type, opts, tensors = checkpoint_tensors(model, QWEN_SOURCE_TYPES.get(source))
            except ValueError:
                model_type, opts, tensors = checkpoint_tensors(model)
    except ValueError as e:
        raise ValueError(f"no GGUF architecture subquad writes holds this model"
                         f"{f' as {asked!r}' if asked else ''}: {e}") from None
    if model_type not in HF_TYPES:
        raise ValueError(f"this model is a Hugging Face {model_type!r} model; subquad writes GGUF files of "
                         f"{', '.join(sorted(HF_TYPES))} only")
    arch = HF_TYPES[model_type]
    c = MAPPINGS[model_type].to_config(model.config, opts)
    src = ((getattr(model, "hf_source", None) or {}).get("config") or {})
    if model_type in (source, QWEN_SOURCE_TYPES.get(source)):  # what the format does not write, kept (save_pretrained's
        src = src.get("text_config", src)            # rule): the context length, Qwen3.5's M-RoPE sections
        c = {**{k: v for k, v in src.items() if k not in c}, **c,
             **{k: {**src[k], **v} for k, v in c.items() if isinstance(v, dict) and isinstance(src.get(k), dict)}}
    if getattr(model, "mtp", None) is not None:      # its multi-token-prediction head: the layers after the model's
        c["mtp_num_hidden_layers"] = 1
    arch = arch.for_config(c) if hasattr(arch, "for_config") else arch    # nemotron_h: with experts or without
    vocab = model.config.vocab_size
    meta = {"general.architecture": arch.arch, "general.name": name or Path(path).stem,
            "general.file_type": FILE_TYPES[outtype], "general.quantization_version": 2,
            "general.alignment": ALIGN, **{f"{arch.arch}.{k}": v for k, v in arch.meta(c).items()}}
    if tokenizer is not None:
        files = (getattr(model, "hf_source", None) or {}).get("files") or {}
        meta.update(tokenizer_metadata(tokenizer, vocab, files))
    else:
        warnings.warn(f"save_gguf({Path(path).name!r}) without tokenizer=: the file holds no vocabulary - llama.cpp "
                      "and Ollama cannot tokenise a prompt for it, and from_pretrained reads no tokenizer from it",
                      stacklevel=2)
    # the converter writes none for Jamba (its file always has a vocabulary) nor RWKV-7 (llama.cpp counts the RWKV
    # vocabulary it always writes); without a token list here, the count is what llama.cpp reads instead
    if getattr(arch, "writes_vocab_size", True) or "tokenizer.ggml.tokens" not in meta:
        meta[f"{arch.arch}.vocab_size"] = vocab
    eos = model.config.eos_token_ids or []
    if eos:                                                    # the world vocabulary's is the converter's (0)
        meta.setdefault("tokenizer.ggml.eos_token_id", int(eos[0]))
    meta.setdefault("tokenizer.ggml.model", "none")            # llama.cpp reads a file without a vocabulary so

    if hasattr(arch, "tensor_meta"):           # metadata the converter reads from the checkpoint's tensors (qwen4exp)
        meta.update({f"{arch.arch}.{k}": v for k, v in arch.tensor_meta(tensors, c).items()})
    if hasattr(arch, "split"):                 # the file groups some tensors otherwise than the checkpoint (qwen.py)
        tensors = arch.split(tensors, c)
    if hasattr(arch, "gguf_tensors"):                          # names or splits that depend on the config
        tensors = arch.gguf_tensors(tensors, c)
    else:
        tensors = {gguf_name(arch, hf): arch.to_gguf(hf, t.float(), c) for hf, t in tensors.items()}
    infos, blobs, offset, types = [], [], 0, {}
    for g, t in tensors.items():
        kind = _kind(g, t, outtype)
        data = _encode(kind, t)
        ne = list(reversed(t.shape))
        infos.append(_string(g) + struct.pack(f"<I{len(ne)}QIQ", len(ne), *ne, OUTTYPES[kind], offset))
        pad = -len(data) % ALIGN
        blobs.append(data + bytes(pad))
        offset += len(data) + pad
        types[g] = kind.upper()
    head = MAGIC_V3 + struct.pack("<QQ", len(infos), len(meta))
    head += b"".join(_string(k) + _value(v) for k, v in meta.items()) + b"".join(infos)
    head += bytes(-len(head) % ALIGN)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(head)
        f.writelines(blobs)
    os.replace(tmp, path)
    return types


MAGIC_V3 = b"GGUF" + struct.pack("<I", 3)
