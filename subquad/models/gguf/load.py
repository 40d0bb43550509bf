"""``from_pretrained("model.gguf")``: a GGUF file (``reader``) as a subquad ``LanguageModel``.

The file's tensors are renamed and reshaped to the Hugging Face checkpoint of its architecture (``arch``),
and its metadata to that checkpoint's config.json; ``models.hf``'s format for that type then builds the model
as for a folder (every tensor used once, every config field honoured or refused). Tensor types:

    F32, F16, BF16        read as float32 (or ``dtype``); without a ``dtype`` asked for, a projection's BF16 or
                          F16 matrix is kept as it is (``_keep_half``: exact, half the memory;
                          ``quant.Bf16Linear`` multiplied as llama.cpp's BF16 products are - x rounded to
                          bfloat16 - and ``quant.F16Linear``, x exact); ``dtype=torch.float32``: a float model
                          (to convert or train)
    Q8_0, Q4_0, Q4_K, Q6_K  a projection's matrix (an ``nn.Linear``) is kept quantised, exactly:
                          ``Int8Linear.from_blocks`` (int8 codes, a float32 scale - and for Q4_K an offset -
                          per block of 32, or 16 for Q6_K; Q4_0's nibbles as the file packs them, 4 bits a
                          weight, multiplied in C as llama.cpp does: torch's int4 kernel takes bfloat16
                          scales, which cannot hold GGUF's float16 ones exactly). A mixture's stacked
                          experts ((E, N, K), ``ffn_*_exps``) too, one such module per expert, where all
                          of a layer's are of block types
                          (``_install_experts``). Anything else quantised (the embedding, which is looked up,
                          not multiplied; a tensor the converter reshaped) is dequantised, with a warning
                          naming the tensor and its type. A tied head (no ``output.weight``) gets its own
                          ``Int8Linear`` of the embedding's blocks. ``quantize="int8"`` / ``"int4"`` puts
                          them in subquad's fast kernels' forms instead (``_linear``: per-channel int8, or
                          Q4_0 / Q4_K's codes in torch's int4 layout with bfloat16 scales - approximate).

The tokenizer comes from the metadata (``vocab``: a byte-level BPE, "gpt2", as a ``tokenizers`` BPE; RWKV's world
vocabulary, "rwkv", as ``data.rwkv_world.WorldTokenizer``); otherwise None. Generation stops at the metadata's
eos, eot and eom ids (llama.cpp's end-of-generation set). Its chat template and special tokens are kept as the
``tokenizer_config.json`` a folder would hold (``model.hf_source``: the server renders it, ``save_pretrained``
writes it, ``save_gguf`` writes it back).
"""

from __future__ import annotations

import json
import re
import warnings

import torch
from torch import nn

from subquad.heap import release_freed
from subquad.models.gguf.arch import hf_name
from subquad.models.gguf.registry import ARCHS
from subquad.models.gguf.reader import BLOCKED, GGUFFile
from subquad.models.gguf.vocab import end_of_generation_ids, tokenizer, tokenizer_config


def load_gguf(path, dtype=None, device=None, quantize=None, group_size=None):
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
    cfg.eos_token_ids = end_of_generation_ids(f.metadata, cfg.vocab_size)
    keep_half = dtype is None                          # BF16 / F16 matrices kept as they are (module doc)
    dtype = resolve_dtype(dtype) or torch.float32

    placeholders, blocks, weights, experts = {}, {}, {}, {}
    layers = (c.get("num_hidden_layers") or c.get("text_config", {}).get("num_hidden_layers")   # the checkpoint's
              or cfg.n_layers)                                                                # (MTP layers after)
    on_blocks = getattr(arch, "on_blocks", lambda h, c: None)
    name_of = getattr(arch, "hf_name_for", lambda g, c: hf_name(arch, g))    # names that depend on the config

    def to_hf(g, h, t):
        """``arch.to_hf``, a tensor its metadata does not describe (a row past a head count) named as such."""
        try:
            return arch.to_hf(h, t, c)
        except IndexError as e:                # a row past a count the metadata gives (not subquad's own errors)
            raise ValueError(f"{path}: GGUF tensor {g!r} {tuple(f.tensors[g].shape)} does not fit the file's own "
                             f"{name} metadata ({type(e).__name__}: {e}); the converter that wrote it misread its "
                             "model's config") from None

    for g, info in f.tensors.items():
        h = name_of(g, c)
        m = _meta(info)
        # kept quantised: not reshaped, or reshaped by whole rows (a row order, a factor: ``on_blocks``)
        if info.type in BLOCKED and len(info.shape) == 2 and (to_hf(g, h, m) is m or on_blocks(h, c)):
            placeholders[h] = m
            blocks[h] = (g, info.type)
        else:
            weights[h] = (g, info.type)
            # a mixture's stacked experts (E, N, K), as the model stacks them, at most scaled: kept in blocks too
            # (_install_experts), met on the meta device on their way through the format
            if info.type in BLOCKED and len(info.shape) == 3 and _expert_layer(g, layers) is not None and \
                    (to_hf(g, h, m) is m or (on_blocks(h, c) or (0,))[0] is None):
                experts[h] = (g, info.type)
    for i in {_expert_layer(g, layers) for g, _ in experts.values()}:    # a layer's experts all, or none
        if any(_expert_layer(g, layers) == i and g.endswith(EXPERTS) and f.tensors[g].type not in BLOCKED
               for g in f.tensors):
            experts = {h: v for h, v in experts.items() if _expert_layer(v[0], layers) != i}
    # a quantised matrix the format fuses or splits (unpack) cannot stay in blocks: found on the meta device;
    # ``regroup``: an architecture whose file holds other groupings than the checkpoint's (qwen.py), else none
    regroup = getattr(arch, "regroup", lambda t, c: t)
    probe = fmt.unpack(regroup(dict(placeholders), c), cfg, None)
    for h in [h for h in blocks if probe.get(h) is not placeholders[h]]:
        weights[h] = blocks.pop(h)
    if (blocks or experts) and quantize not in (None, "int8", "int4"):
        raise ValueError(f"{path} holds quantised tensors ({', '.join(sorted({t for _, t in blocks.values()}))}): "
                         f"quantize must be None (exact), 'int8' or 'int4' (subquad's kernels), got {quantize!r}")
    if blocks and resolve_dtype(dtype) not in (None, torch.float32) and quantize is not None:
        raise ValueError(f"quantize={quantize!r} keeps the rest of the model in float32, got dtype={dtype}")
    tensors = {h: placeholders[h] for h in blocks}
    for h, (g, kind) in weights.items():
        t = _meta(f.tensors[g]) if h in experts else f.dequantize(g) if kind in BLOCKED else f.plain(g)
        t = to_hf(g, h, t).to(dtype if t.is_floating_point() else t.dtype)
        if "{e}" in h:                          # stacked experts, one checkpoint tensor each (jamba)
            tensors.update({h.replace("{e}", str(e)): part for e, part in enumerate(t.unbind(0))})
        else:
            tensors[h] = t
    tensors = regroup(tensors, c)

    # quantised tensors the format reshapes, fuses or regroups (a Gated DeltaNet's split projections, stacked
    # experts) were dequantised above: said in the same warning as the rest
    # (not those the architecture drops as unused: rwkv7's layer-0 v LoRA, the converter's copy of a's; nor the
    # experts kept in blocks)
    unused = getattr(arch, "unused", lambda h: False)
    expanded = [f"{g} ({kind})" for h, (g, kind) in weights.items()
                if kind in BLOCKED and not unused(h) and h not in experts]

    def finish(model, names):
        kept = {h: _rows(arch, h, c, f.blocks(g)) + (g, kind) for h, (g, kind) in blocks.items()}
        _install_blocks(model, names, kept, dtype, quantize, expanded)
        if quantize is None and keep_half and not blocks and not experts:   # a file of float types only (a
            kept_half.append(_keep_half(model, names, weights))              # quantised one's folder holds one kind)
        _install_experts(model, names, {g: _rows(arch, h, c, f.blocks(g)) + (kind,)
                                        for h, (g, kind) in experts.items()}, quantize)

    kept_half = []
    if (blocks or experts) and group_size not in (None, GROUP):
        raise ValueError(f"{path} holds block-quantised matrices: quantize='int4' keeps their groups of {GROUP}, got "
                         f"group_size={group_size}")
    model = build(path, c, fmt, cfg, tensors, dtype, device, None if blocks or experts else quantize, finish=finish,
                  group_size=None if blocks or experts else group_size)
    if quantize is not None:                   # the float tensors it quantised are freed: their pages go back
        tensors = None
        release_freed()
    if blocks or experts or any(kept_half):
        model.quantized = quantize or ("int8" if blocks or experts else kept_half[0])
        model.quant_group_size = GROUP if quantize == "int4" else None
        # the file's quantised types as kept (Q4_0, Q8_0, Q6_K: subquad's int8 blocks), for what a user is told
        model.gguf_types = None if quantize else sorted({t for _, t in (*blocks.values(), *experts.values())})
        for p in model.parameters():
            p.requires_grad_(False)
    # the config save_pretrained keeps what its format does not write from; an architecture's private keys
    # ("_..."; granitehybrid's multipliers, folded into the weights here) are not the model's
    tok = tokenizer(f.metadata)
    side = tokenizer_config(f.metadata, tok)
    model.hf_source = {"config": {k: v for k, v in c.items() if not k.startswith("_")},
                       "files": {"tokenizer_config.json": json.dumps(side, indent=1).encode()} if side else {}}
    return model, tok


def _rows(arch, h: str, c: dict, blocks: tuple) -> tuple:
    """A quantised matrix's (q, scale, offset) with ``arch.on_blocks``' row order and factor applied (exact: each
    row's blocks move whole; a factor k scales w = q d - m as d k and m k)."""
    if not hasattr(arch, "on_blocks"):
        return blocks
    rows, k = arch.on_blocks(h, c)
    q, scale, offset = blocks if rows is None else (b if b is None else b[rows] for b in blocks)
    if k != 1.0:
        scale, offset = scale * k, None if offset is None else offset * k
    return q, scale, offset


# a mixture's stacked experts in a GGUF file (blk.{i}.<suffix>) -> the projection of subquad's MoE they are
EXPERTS = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")
PROJECTION = dict(zip(EXPERTS, ("w_gate", "w_up", "w_down")))


def _expert_layer(g: str, n_layers: int) -> int | None:
    """The decoder layer of a stacked-experts tensor ``g``; None for another tensor or an MTP layer's (loaded by
    ``models.mtp`` from float tensors)."""
    head, _, rest = g.partition(".")
    i, _, suffix = rest.partition(".")
    return int(i) if head == "blk" and i.isdigit() and int(i) < n_layers and suffix in EXPERTS else None


def _install_experts(model, names: dict, experts: dict, quantize=None) -> None:
    """Each mixture's experts (``experts``: GGUF name -> (q, scale, offset, type), stacked (E, N, K)) as one
    quantised module per expert and projection (``MoE.quantize_experts``, ``_linear``'s forms). The format gave
    those MoEs meta tensors of the experts' shapes; which file tensor each projection is comes from the checkpoint
    names it was given (``names``: subquad name -> the checkpoint's; their ``layers.{i}.`` is the file's
    ``blk.{i}.``: a subquad block can hold two of the checkpoint's layers, as Nemotron-H's mixer and MoE)."""
    from subquad.models.moe import MoE

    suffix = {v: k for k, v in PROJECTION.items()}
    used = set()
    for path, moe in model.named_modules():
        if not isinstance(moe, MoE) or not any(getattr(moe, n).is_meta for n in moe.projections):
            continue
        made = []
        for n in moe.projections:
            theirs = names[f"{path}.{n}"]
            layer = re.search(r"layers\.(\d+)\.", theirs[0] if isinstance(theirs, tuple) else theirs)
            g = f"blk.{layer.group(1)}.{suffix[n]}" if layer else None
            if g not in experts:
                raise ValueError(f"GGUF: the experts of {path}.{n} (checkpoint {theirs}) are not among the stacked "
                                 f"experts kept quantised ({', '.join(sorted(experts))})")
            q, scale, offset, kind = experts[g]
            if tuple(q.shape) != tuple(getattr(moe, n).shape):
                raise ValueError(f"GGUF tensor {g} has shape {tuple(q.shape)}, the model's {path}.{n} "
                                 f"{tuple(getattr(moe, n).shape)}")
            made += [_linear(q[e], scale[e], None if offset is None else offset[e], kind, None, quantize)
                     for e in range(q.shape[0])]
            used.add(g)
        modules = iter(made)
        moe.quantize_experts(lambda w: next(modules))
    if used != set(experts):
        raise ValueError(f"GGUF: stacked experts {', '.join(sorted(set(experts) - used))} have no mixture of experts "
                         "in the model")


def _meta(info) -> torch.Tensor:
    return torch.empty(info.shape, device="meta")


GROUP = 32     # quantize="int4": Q4_0 and Q4_K's blocks are groups of 32 inputs


def _linear(q, scale, offset, kind: str, bias, quantize):
    """The module of one quantised matrix: exact blocks (``quantize`` None), or subquad's kernels' forms -
    "int8": requantised per output channel (fbgemm); "int4": Q4_0 / Q4_K's 4-bit codes as they are, their
    scales (and Q4_K's offsets, as zeros) rounded to bfloat16, in groups of 32 (torch's int4 kernel); another
    type requantised to int4 from its dequantised weights."""
    from subquad.models.gguf.reader import block_dequantize
    from subquad.models.quant import Int4Linear, Int8Linear, pack_q4_0, pair_k

    if quantize is None:
        if kind == "Q4_0" and offset is None and scale.shape[1] * 32 == q.shape[1]:   # its 4-bit bytes, as stored
            return Int8Linear.from_blocks(pack_q4_0(q), scale, None, bias)
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


def _keep_half(model, names: dict, weights: dict) -> str | None:
    """A file of BF16 (else F16) matrices (``weights``: Hugging Face name -> (GGUF name, type)): each projection of
    that type as a ``quant.Bf16Linear`` (its products through ``kernels.qgemv.bf16_gemv``: x rounded to bfloat16,
    as llama.cpp's BF16 products round it) or ``quant.F16Linear`` (``f16_gemv``: x exact, the dequantised
    product) - half the memory of float32 - where the float32 weight the format built is that tensor exactly (not
    scaled, nor fused with another type) and its bias, if any, survives the module (a BF16 module's bias is
    bfloat16), and which ``quant.quantize(model, "bf16")`` would convert (``MIN_WEIGHTS`` and more, not in a
    layer's ``keep_float``: Mamba's small x_proj and dt_proj stay float32, so its blocks keep their one C call);
    the rest stays float32 (exactly the file's values); a tied head its own half copy of such an embedding.
    Returns "bf16" or "f16" where it kept any, else None."""
    from subquad.layers.linear import Linear
    from subquad.models.quant import MIN_WEIGHTS, Bf16Linear, F16Linear

    types = {kind for _, kind in weights.values()}
    kind = "BF16" if "BF16" in types else "F16" if "F16" in types else None
    if kind is None:
        return None
    half, module = (torch.bfloat16, Bf16Linear) if kind == "BF16" else (torch.float16, F16Linear)

    def exact(t, to=half):
        return t is None or torch.equal(t.detach().to(to).float(), t.detach())

    n = 0
    for ours, theirs in names.items():
        if not isinstance(theirs, str) or weights.get(theirs, (None, None))[1] != kind:
            continue
        parent_name, _, leaf = ours.rpartition(".")
        parent = model.get_submodule(parent_name)
        owner_name, _, child = parent_name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        if leaf != "weight" or type(parent) not in (nn.Linear, Linear) or parent.weight.dtype != torch.float32 \
                or parent.weight.is_meta or parent.weight.numel() < MIN_WEIGHTS \
                or child in getattr(owner, "keep_float", ()) or not exact(parent.weight) \
                or not exact(parent.bias, torch.bfloat16 if kind == "BF16" else torch.float32):
            continue
        setattr(owner, child, module(parent.weight, parent.bias))
        n += 1
    embed = names.get("embed.weight")
    if n and model.head is None and weights.get(embed, (None, None))[1] == kind and exact(model.embed.weight):
        model.head = module(model.embed.weight)          # tied: the head multiplies a half copy, as quantize's
    return kind.lower() if n else None


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
