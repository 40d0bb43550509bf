"""``from_pretrained("model.gguf")``: a GGUF file (``reader``) as a subquad ``LanguageModel``.

The file's tensors are renamed and reshaped to the Hugging Face checkpoint of its architecture (``arch``),
and its metadata to that checkpoint's config.json; ``models.hf``'s format for that type then builds the model
as for a folder (every tensor used once, every config field honoured or refused). Tensor types:

    F32, F16, BF16        read as float32 (or ``dtype``)
    Q8_0, Q4_0, Q4_K, Q6_K  a projection's matrix (an ``nn.Linear``) is kept quantised, exactly:
                          ``Int8Linear.from_blocks`` (int8 codes, a float32 scale - and for Q4_K an offset -
                          per block of 32, or 16 for Q6_K; 8 bits a weight against Q4_0's 4.5: torch's int4
                          kernel takes bfloat16 scales, which cannot hold GGUF's float16 ones exactly, and
                          rounds x to bfloat16). Anything else quantised (the embedding, which is looked up,
                          not multiplied; a tensor the converter reshaped) is dequantised, with a warning
                          naming the tensor and its type. A tied head (no ``output.weight``) gets its own
                          ``Int8Linear`` of the embedding's blocks. ``quantize="int8"`` / ``"int4"`` puts
                          them in subquad's fast kernels' forms instead (``_linear``: per-channel int8, or
                          Q4_0 / Q4_K's codes in torch's int4 layout with bfloat16 scales - approximate).

The tokenizer comes from the metadata when it is a byte-level BPE (``tokenizer.ggml.model`` "gpt2": its tokens
and merges as a ``tokenizers`` BPE); otherwise None.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from subquad.models.gguf.arch import ARCHS, hf_name
from subquad.models.gguf.reader import BLOCKED, GGUFFile


def load_gguf(path, dtype=None, device=None, quantize=None):
    """(LanguageModel in eval mode, tokenizer or None) from a GGUF file (module doc). ``quantize``: for a file of
    float tensors, ``models.quant``'s (as for a folder); for a file of quantised ones, None keeps them exactly
    (``Int8Linear.from_blocks``), "int8" / "int4" puts them in subquad's fast kernels' forms (``_linear``:
    approximate - per-channel int8, or int4 with bfloat16 scales and x rounded to bfloat16 - and fast)."""
    from subquad.models.hf.loader import build, resolve_dtype
    from subquad.models.hf.registry import MAPPINGS

    f = GGUFFile(path)
    name = f.metadata.get("general.architecture")
    if name not in ARCHS:
        raise ValueError(f"{path}: GGUF architecture {name!r} is not one subquad loads; it loads "
                         f"{', '.join(sorted(ARCHS))} (benchmarks/gguf_architectures.md lists the rest)")
    arch = ARCHS[name]
    c = arch.config(f.metadata, f.tensors)
    fmt = MAPPINGS[c["model_type"]]
    c["vocab_size"] = f.tensors["token_embd.weight"].shape[0] if "token_embd.weight" in f.tensors else None
    cfg = fmt.config(c)
    eos = f.metadata.get("tokenizer.ggml.eos_token_id")
    cfg.eos_token_ids = [eos] if isinstance(eos, int) and eos < cfg.vocab_size else []
    dtype = resolve_dtype(dtype) or torch.float32

    placeholders, blocks, weights = {}, {}, {}
    for g, info in f.tensors.items():
        h = hf_name(arch, g)
        m = _meta(info)
        if info.type in BLOCKED and len(info.shape) == 2 and arch.to_hf(h, m, c) is m:   # not reshaped: kept
            placeholders[h] = m
            blocks[h] = (g, info.type)
        else:
            weights[h] = (g, info.type)
    # a quantised matrix the format fuses or splits (unpack) cannot stay in blocks: found on the meta device;
    # ``regroup``: an architecture whose file holds other groupings than the checkpoint's (qwen.py), else none
    regroup = getattr(arch, "regroup", lambda t, c: t)
    probe = fmt.unpack(regroup(dict(placeholders), c), cfg, None)
    for h in [h for h in blocks if probe.get(h) is not placeholders[h]]:
        weights[h] = blocks.pop(h)
    if blocks and quantize not in (None, "int8", "int4"):
        raise ValueError(f"{path} holds quantised tensors ({', '.join(sorted({t for _, t in blocks.values()}))}): "
                         f"quantize must be None (exact), 'int8' or 'int4' (subquad's kernels), got {quantize!r}")
    if blocks and resolve_dtype(dtype) not in (None, torch.float32) and quantize is not None:
        raise ValueError(f"quantize={quantize!r} keeps the rest of the model in float32, got dtype={dtype}")
    tensors = {h: placeholders[h] for h in blocks}
    for h, (g, kind) in weights.items():
        t = f.dequantize(g) if kind in BLOCKED else f.plain(g)
        tensors[h] = arch.to_hf(h, t, c).to(dtype if t.is_floating_point() else t.dtype)
    tensors = regroup(tensors, c)

    # quantised tensors the format reshapes, fuses or regroups (a Gated DeltaNet's split projections, stacked
    # experts) were dequantised above: said in the same warning as the rest
    # (not those the architecture drops as unused: rwkv7's layer-0 v LoRA, the converter's copy of a's)
    unused = getattr(arch, "unused", lambda h: False)
    expanded = [f"{g} ({kind})" for h, (g, kind) in weights.items() if kind in BLOCKED and not unused(h)]

    def finish(model, names):
        _install_blocks(model, names, {h: f.blocks(g) + (g, kind) for h, (g, kind) in blocks.items()}, dtype,
                        quantize, expanded)

    model = build(path, c, fmt, cfg, tensors, dtype, device, None if blocks else quantize, finish=finish)
    if blocks:
        model.quantized = quantize or "int8"
        model.quant_group_size = GROUP if quantize == "int4" else None
        for p in model.parameters():
            p.requires_grad_(False)
    model.hf_source = {"config": dict(c), "files": {}}
    return model, tokenizer(f.metadata)


def _meta(info) -> torch.Tensor:
    return torch.empty(info.shape, device="meta")


GROUP = 32     # quantize="int4": Q4_0 and Q4_K's blocks are groups of 32 inputs


def _linear(q, scale, offset, kind: str, bias, quantize):
    """The module of one quantised matrix: exact blocks (``quantize`` None), or subquad's kernels' forms -
    "int8": requantised per output channel (fbgemm); "int4": Q4_0 / Q4_K's 4-bit codes as they are, their
    scales (and Q4_K's offsets, as zeros) rounded to bfloat16, in groups of 32 (torch's int4 kernel); another
    type requantised to int4 from its dequantised weights."""
    from subquad.models.gguf.reader import block_dequantize
    from subquad.models.quant import Int4Linear, Int8Linear, pair_k

    if quantize is None:
        return Int8Linear.from_blocks(q, scale, offset, bias)
    if quantize == "int8":
        return Int8Linear(block_dequantize(q, scale, offset), bias)
    N, K = q.shape
    if kind not in ("Q4_0", "Q4_K") or scale.shape[1] != K // GROUP:
        return Int4Linear(block_dequantize(q, scale, offset), bias, GROUP)
    # Q4_0: w = q d, q in [-8, 7]; Q4_K: w = q s - m, q in [0, 15] = (q - 8) s + (8 s - m)
    codes = (q + 8 if offset is None else q).to(torch.uint8)
    zero = torch.zeros_like(scale) if offset is None else 8 * scale - offset
    m = Int4Linear(None, bias, GROUP, shape=(N, K))
    m._set(pair_k(codes), scale.bfloat16(), zero.bfloat16(), None if bias is None else bias.detach().float().clone())
    return m


def _install_blocks(model, names: dict, blocks: dict, dtype, quantize=None, dequantised=()) -> None:
    """Put each quantised tensor (``blocks``: Hugging Face name -> (q, scale, offset, GGUF name, type)) where
    its placeholder is: an ``nn.Linear``'s weight -> ``_linear`` (exact blocks unless ``quantize``); anything
    else dequantised, said in one warning with ``dequantised`` (those the loader expanded already)."""
    from subquad.models.gguf.reader import block_dequantize

    expanded, dequantised = list(dequantised), []
    for ours, theirs in names.items():
        if not isinstance(theirs, str) or theirs not in blocks:
            continue
        q, scale, offset, g, kind = blocks[theirs]
        parent_name, _, leaf = ours.rpartition(".")
        parent = model.get_submodule(parent_name)
        if isinstance(parent, nn.Linear) and leaf == "weight":
            owner_name, _, child = parent_name.rpartition(".")
            setattr(model.get_submodule(owner_name) if owner_name else model, child,
                    _linear(q, scale, offset, kind, parent.bias, quantize))
            continue
        setattr(parent, leaf, nn.Parameter(block_dequantize(q, scale, offset).to(dtype), requires_grad=False))
        if ours == "embed.weight" and model.head is None:         # tied: the head multiplies, it keeps the blocks
            model.head = _linear(q, scale, offset, kind, None, quantize)
        else:
            dequantised.append(f"{g} ({kind})")
    dequantised += expanded
    if dequantised:
        warnings.warn(f"GGUF: {len(dequantised)} quantised tensors are not projections subquad keeps quantised "
                      f"and were dequantised to {dtype}: {', '.join(dequantised[:6])}"
                      f"{' ...' if len(dequantised) > 6 else ''}", stacklevel=3)


def tokenizer(meta: dict):
    """A ``tokenizers.Tokenizer`` from GGUF metadata: ``tokenizer.huggingface.json`` when the file holds one, else
    a byte-level BPE (``tokenizer.ggml.model`` "gpt2") from its tokens and merges (padding tokens of type 5,
    unused, left out); None for other models (SentencePiece "llama", RWKV's "rwkv") or none."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    if isinstance(meta.get("tokenizer.huggingface.json"), str):     # the whole tokenizer, as subquad writes it
        return Tokenizer.from_str(meta["tokenizer.huggingface.json"])
    if meta.get("tokenizer.ggml.model") != "gpt2" or "tokenizer.ggml.tokens" not in meta:
        return None

    types = meta.get("tokenizer.ggml.token_type", [])
    vocab = {t: i for i, t in enumerate(meta["tokenizer.ggml.tokens"]) if i >= len(types) or types[i] != 5}
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = [t for t, kind in zip(meta["tokenizer.ggml.tokens"], types) if kind == 3]   # 3: control tokens
    if special:
        tok.add_special_tokens(special)
    return tok
