"""Hugging Face model folders <-> subquad ``LanguageModel``s, without importing transformers.

    model, tokenizer = from_pretrained("path/to/folder", dtype=None, device=None)
    save_pretrained(model, "path/to/out")

A folder holds ``config.json``, the weights (``model.safetensors``, or shards listed in
``model.safetensors.index.json``) and, when present, ``tokenizer.json`` (loaded with ``tokenizers``).
Each ``model_type`` has a format, one file here: its config to a ``ModelConfig`` - every field that
changes the math honoured or refused with a ``ValueError`` naming it - and a table of key patterns from
subquad's weight names to the checkpoint's (``common.Format``). A missing weight, an unexpected one or a
wrong shape is refused by name: never a silently different model. A format may also ``unpack`` the
checkpoint's tensors first (fused projections split, per-part convolutions joined, zero-centred norm
weights shifted) and ``pack`` them back on saving.

    mamba.py        mamba, falcon_mamba (its RMS norms on dt, B and C)
    mamba2.py       mamba2 (``n_groups``, the gated norm per group, ``time_step_limit``)
    bamba.py        bamba (Mamba-2 and softmax attention at ``attn_layer_indices``, partial rotary, SwiGLU MLPs)
    granitemoehybrid.py  granitemoehybrid (Granite 4: Mamba-2, attention without positions or rotary, MoE beside an
                    ungated shared expert; its multipliers folded into the weights)
    jamba.py        jamba (Mamba with normed dt, B and C, attention without positions every
                    ``attn_layer_period``, a mixture of experts every ``expert_layer_period``)
    qwen3_next.py   qwen3_next (Gated DeltaNet with fused projections, gated attention, MoE + shared expert)
    nemotron_h.py   nemotron_h (Mamba-2, attention without positions, squared-ReLU MLPs and MoE layers of
                    squared-ReLU experts as separate layers by a pattern: a mixer layer and the MLP or MoE layer
                    after it are one block; the multi-token-prediction layers as ``models.mtp``'s head)
    olmo_hybrid.py  olmo_hybrid (Gated DeltaNet, post-norm attention with q/k norms)
    kimi_linear.py  kimi_linear (Kimi Delta Attention, latent attention, DeepSeek-V3 experts)
    minimax.py      minimax (lightning attention, MiniMax-01's scaled residual)
    qwen3_5.py      qwen3_5, qwen3_5_moe (multimodal: the language model, the vision tower left out by name) and
                    their text-only types qwen3_5_text, qwen3_5_moe_text (Qwen3-Next's hybrid, projections fused
                    by part, dense MLPs or MoE in every layer)
    lfm2.py         lfm2, lfm2_moe (Liquid LFM2: gated short convolutions, attention with q/k norms, SwiGLU MLPs;
                    the MoE variant's sigmoid-routed experts with an expert bias after its dense layers)
    falcon_h1.py    falcon_h1 (Falcon-H1: Mamba-2 beside attention in every layer, summed - a ParallelBlock; its muP
                    multipliers folded into the weights)
    recurrent_gemma.py  recurrent_gemma (Griffin's RG-LRU blocks, local multi-query attention, GeGLU, soft cap)
    rwkv7.py        rwkv7 (fla-hub's layout: RWKV-7 time mix and channel mix, LayerNorms, layer 0's pre_norm)
    rwkv7_pth.py    BlinkDL's RWKV-7 ``.pth`` (no config.json: sizes read off the tensors; loading only)
    zamba2.py       zamba2 (Zyphra's Zamba2: Mamba-2 layers, shared attention + MLP blocks over [h, embeddings] at the
                    hybrid layers, each use with its own LoRA adapters and projection - ``models.shared``)
    xlstm.py        xlstm (xLSTM-7B: mLSTM layers and SwiGLUs, soft-capped gates and logits; fused weights split)
    zamba.py        zamba (Zamba v1: multi-head Mamba layers - each head its own dt, B and C - and one shared attention
                    + MLP block without adapters or positions, zamba2.py's format with other names)
    lfm3.py         lfm3 (Liquid LFM3: LFM2's convolutions, sliding and full attention with a sigmoid gate per head,
                    rotary per attention kind - proportional rotary as partial rotary on reordered dims - and
                    sandwich norms: ``ModelConfig.sandwich_norm``)
    bailing_hybrid.py  bailing_hybrid (inclusionAI's Ling 3: KDA with full-rank gates and a bounded decay, MLA with a
                    gate per head and DeepSeek's interleaved rotary, DeepSeek-V3 grouped experts; the multi-token-
                    prediction layer after the decoder layers as ``models.mtp``'s head: MLA and the MoE)
    qwen4_exp.py    qwen4_exp (multimodal: the language model, the vision tower left out by name) and qwen4_exp_text
                    (Qwen4-Exp: Gated DeltaNet and QSA's indexed attention - ``layers.qsa`` - in hyper-connected
                    streams with per-layer hashed n-gram embeddings - ``models.hyper`` -, MoE + shared expert)

``registry.MAPPINGS`` lists them by ``model_type``; ``loader`` reads a folder, ``saver`` writes one, and
``common`` holds what the formats share. Imports run one way: common <- formats <- registry <- loader,
saver.
"""

from pathlib import Path

from subquad.models.hf.common import eos_token_ids, read_weights
from subquad.models.hf.loader import from_pretrained as _from_folder
from subquad.models.hf.loader import read_config
from subquad.models.hf.registry import MAPPINGS
from subquad.models.hf.saver import save_pretrained

__all__ = ["from_pretrained", "save_pretrained", "MAPPINGS", "read_config", "read_weights", "eos_token_ids"]


def from_pretrained(path, dtype=None, device=None, quantize=None, group_size=None):
    """``loader.from_pretrained`` (a Hugging Face folder, a quantised folder, an RWKV-7 .pth), or a ``.gguf`` file
    (llama.cpp's format) through ``models.gguf``: (LanguageModel in eval mode, tokenizer or None).
    ``group_size``: int4's inputs per scale (``quant.quantize``; default 128), with ``quantize="int4"`` only."""
    check_group_size(quantize, group_size)
    if is_gguf(path):
        from subquad.models.gguf import load_gguf

        return load_gguf(path, dtype=dtype, device=device, quantize=quantize, group_size=group_size)
    return _from_folder(path, dtype=dtype, device=device, quantize=quantize, group_size=group_size)


def check_group_size(quantize, group_size) -> None:
    """ValueError for a ``group_size`` given without ``quantize="int4"`` (the others have no groups)."""
    if group_size is not None and quantize != "int4":
        raise ValueError(f"group_size is int4's (inputs per scale), got group_size={group_size!r} with "
                         f"quantize={quantize!r}")
    if group_size is not None:                       # quant's own check, before any weight is read
        from subquad.models.quant import int4_shape

        int4_shape((1, group_size), group_size)


from_pretrained.__doc__ = (from_pretrained.__doc__ or "") + "\n\n" + (_from_folder.__doc__ or "")


def is_gguf(path) -> bool:
    """A GGUF file: a ``.gguf`` name (read, and refused by name if it is no such file), or a file (not a folder)
    that starts with GGUF's magic bytes, whatever its name."""
    if str(path).lower().endswith(".gguf"):
        return True
    p = Path(path)
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(4) == b"GGUF"
