"""Published checkpoints' shapes on CPU: subquad's from_pretrained model against transformers' own (and
llama.cpp's, where it is installed), same weights - random, at the real shapes: nothing is downloaded.

Models: mamba-130m (d_model 768, 24 layers, vocab 50,280), mamba2-130m (24 heads of 64, state 128),
a 4-layer Jamba-like model (d_model 768, attention at layer 2, a top-2 mixture of 8 experts at layers 1
and 3), and 4-layer models at the layer shapes of the delta-rule hybrids (three recurrent layers, then
attention; fewer experts than the real ones, each of the real size and top-k): Qwen3-Next-like (d_model
2,048, Gated DeltaNet 16 key / 32 value heads of 128, gated attention 16 heads of 256 with 2 KV heads, 32
experts of 512, top 10, a shared expert) and Kimi-Linear-like (d_model 2,304, KDA 32 heads of 128, MLA 32
heads with latent 512, a dense MLP of 9,216 first, then 16 experts of 1,024, top 8, a shared expert), and
an 8-layer Zamba2-1.2B-like model (``--models zamba2``: d_model 2,048, Mamba-2 64 heads of 64, state 64; one
shared attention + MLP block, 32 heads over 4,096, MLP 8,192, used at layers 3 and 7 with rank-128 adapters
on q, k, v and the MLP, rotary), and issue 33's 2026 hybrids at 8 layers (``--models qwen3_5,granitemoehybrid,
nemotron_h,falcon_h1,lfm2``): Qwen3.5-0.8B-like (d_model 1,024, 3 Gated DeltaNet layers of 16 heads of 128 to one
gated attention of 8 heads of 256 with 2 KV heads, MLP 3,584), Granite-4.0-H-Tiny-like (d_model 1,536, Mamba-2 48
heads of 64 with state 128, one NoPE attention layer of 12 heads with 4 KV, 64 experts of 512, top 6, a shared
expert of 1,024), Nemotron-H-like (d_model 2,048, pattern M-M*-M-M: Mamba-2 64 heads of 64, state 128, 8 groups;
squared-ReLU MLPs of 8,192; attention 16 heads of 128 with 4 KV), Falcon-H1-0.5B-like (d_model 1,024, attention
8 heads of 64 with 2 KV beside Mamba-2 24 heads of 64, state 128, in every layer; MLP 2,048) and LFM2-350M-like
(its 16 layers: d_model 1,024, gated short convolutions, attention at layers 2, 5, 8, 10, 12, 14 with 16 heads,
8 KV; MLP 6,656 before LFM2's adjustment), and issue 52's at a few layers (``--models zamba,lfm3,bailing_hybrid``):
Zamba-7B-v1-like (d_model 3,712, 6 layers of two-head Mamba, state 16, the shared attention block - 16 heads over
7,424, MLP 14,848 - at layers 2 and 5), LFM3-1.7B-like (d_model 2,048, 8 layers: gated convolutions of 7 taps,
full attention at 2 and 6, sliding (256) at 4, 16 heads of 128 with 4 KV, MLP 7,680, sandwich norms, gated heads)
and Ling-3.0-Flash-like (d_model 2,560, 5 KDA layers of 32 heads of 128 and one MLA of latent 512, the first two
with a dense MLP of 6,144, then 32 experts of 768 - of its 512 - top 8 in 8 groups, top 4, a shared expert)
and Qwen4-Exp-like (``--models qwen4_exp``: d_model 2,048 in 4 hyper-connected streams, 3 Gated DeltaNet layers
of 16 key / 32 value heads of 128, one QSA attention of 16 heads of 256 with 2 KV heads, 32 experts of 512, top
10, a shared expert; PLE at layers 1 and 3 with tables shrunk 1,000x - ``_issue_52`` says how) and xLSTM-7B-like
(``--models xlstm``: 4 of its 32 mLSTM blocks, d_model 4,096, 8 heads, q/k at half width, FFN 2.667x). For each
dtype (float32, bfloat16) and batch (1: prefill 2,048 tokens, decode 256; 8: prefill 512 each, decode 64 -
transformers' reference path needs minutes for 8 x 2,048): prefill tokens/s (a forward computing every position's
logits, as ``model(ids)`` does in both), generate's prefill tokens/s (the prefill each library's ``generate``
runs before the first token: subquad's ``prefill(ids, logits="last")``, transformers' ``model(ids,
logits_to_keep=1)`` where the model's forward takes it - every position's logits where it does not, as its
generate computes them; llama.cpp's prefill is this one), decode ms per step (greedy; the
time of generating n tokens less that of generating 1, per step), and each process's peak resident memory. Every
measurement runs in its own process (peak memory is per
process), subquad and transformers interleaved, best of --repeats. Decode is shown beside the weight-read
bound (bytes of weights per token / this machine's measured read bandwidth).

subquad runs three ways: eager (the reference), ``compiled`` (``models.decode.compile_decode``: one inductor
graph per decoding step) and, in the "int8" rows, ``quantize="int8"`` with the compiled step
(``models.quant``: fbgemm's int8 products, per-channel weights). The int8 rows' bound counts one byte per
quantised weight and four per weight kept in float32.

llama.cpp: with --llama-python (a Python with llama-cpp-python) and --llama-src (its source package's
vendor/llama.cpp, whose convert_hf_to_gguf.py converts the folder), the GGUF of the same weights is
measured at batch 1 for each model its converter takes: float32 in the float32 rows, Q8_0 in the int8 rows.
The converter runs through ``llama_convert.py``, which gives it what these folders lack (a vocabulary; the
released configs' layer names); ``llama_parity.py`` checks that the GGUF computes transformers' logits.
``--who llama.cpp`` runs only llama.cpp's rows.

Read bandwidth: the faster of summing 256 MB and float32 matrix-vector products streaming 512 MB of
column-major matrices (what decoding does); each bound = bytes one token reads / that bandwidth.

    python benchmarks/bench_pretrained.py                       # ~25 minutes
    python benchmarks/bench_pretrained.py --models mamba --dtypes float32 --batches 1
    python benchmarks/bench_pretrained.py --quick               # tiny shapes, seconds
    python benchmarks/bench_pretrained.py --models rwkv7 --dtypes float32 --batches 1   # against the rwkv package
    python benchmarks/bench_pretrained.py --models recurrent_gemma,zamba2 --batches 1 --new 64   # ~1B+ shapes
    python benchmarks/bench_pretrained.py --models zamba,lfm3,bailing_hybrid --batches 1 --new 64 --name pretrained_52
    python benchmarks/bench_pretrained.py --models qwen4_exp --batches 1 --new 64 --name pretrained_qwen4
    python benchmarks/bench_pretrained.py --models qwen3_next,kimi_linear --batches 1 --name pretrained_delta
    python benchmarks/bench_pretrained.py --models mamba --dtypes float32,int8 --batches 1,8 \
        --llama-python /tmp/llvenv/bin/python --llama-src .../llama_cpp_python-0.3.36/vendor/llama.cpp
Writes results/NAME.{json,md} (default pretrained).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.common import OUT, machine_line  # noqa: E402


def hf_model(kind, quick):
    """A random transformers model at the kind's real shape (tiny with ``quick``)."""
    import transformers

    torch.manual_seed(0)
    V = 1000 if quick else 50280
    if kind == "mamba":
        c = dict(hidden_size=64, num_hidden_layers=2, state_size=8) if quick else \
            dict(hidden_size=768, num_hidden_layers=24, state_size=16)
        return transformers.MambaForCausalLM(transformers.MambaConfig(vocab_size=V, **c))
    if kind == "mamba2":
        c = dict(hidden_size=64, num_hidden_layers=2, num_heads=4, head_dim=32, state_size=16) if quick else \
            dict(hidden_size=768, num_hidden_layers=24, num_heads=24, head_dim=64, state_size=128)
        return transformers.Mamba2ForCausalLM(transformers.Mamba2Config(vocab_size=V, n_groups=1, expand=2,
                                                                        tie_word_embeddings=True, **c))
    if kind == "qwen3_next":
        c = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                 linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, intermediate_size=96,
                 num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32) \
            if quick else \
            dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                 linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, intermediate_size=5120,
                 num_experts=32, num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512)
        return transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(
            vocab_size=V, num_hidden_layers=4, full_attention_interval=4, decoder_sparse_step=1, **c))
    if kind == "kimi_linear":
        c = dict(hidden_size=64, num_attention_heads=4, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
                 v_head_dim=16, linear_num_heads=4, linear_head_dim=16, intermediate_size=96, num_local_experts=8,
                 num_experts_per_tok=2, moe_intermediate_size=32) if quick else \
            dict(hidden_size=2304, num_attention_heads=32, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                 v_head_dim=128, linear_num_heads=32, linear_head_dim=128, intermediate_size=9216, num_local_experts=16,
                 num_experts_per_tok=8, moe_intermediate_size=1024)
        return transformers.KimiLinearForCausalLM(transformers.KimiLinearConfig(
            vocab_size=V, num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
            mlp_layer_types=["dense", "sparse", "sparse", "sparse"], n_group=1, topk_group=1, pad_token_id=None,
            bos_token_id=None, eos_token_id=None, **c))
    if kind == "zamba2":                  # Zamba2-1.2B's layer shapes, 8 layers: one shared block used at 3 and 7
        c = dict(hidden_size=64, n_mamba_heads=4, mamba_d_state=16, num_attention_heads=4, intermediate_size=128,
                 adapter_rank=8) if quick else \
            dict(hidden_size=2048, n_mamba_heads=64, mamba_d_state=64, num_attention_heads=32, intermediate_size=8192,
                 adapter_rank=128)
        return transformers.Zamba2ForCausalLM(transformers.Zamba2Config(
            vocab_size=V, num_hidden_layers=8, layers_block_type=(["mamba"] * 3 + ["hybrid"]) * 2, num_mem_blocks=1,
            use_shared_attention_adapter=True, use_mem_rope=True, pad_token_id=None, bos_token_id=None,
            eos_token_id=None, **c))
    if kind in NEW_HYBRIDS:
        return _new_hybrid(transformers, kind, V, quick)
    if kind in ISSUE_52:
        return _issue_52(transformers, kind, V, quick)
    if kind == "recurrent_gemma":         # RecurrentGemma-2B's widths, 8 of its 26 layers (recurrent, recurrent, attention)
        c = dict(vocab_size=V, hidden_size=64, intermediate_size=192, num_attention_heads=4, attention_window_size=32) \
            if quick else dict(vocab_size=256000, hidden_size=2560, intermediate_size=15360, num_attention_heads=10,
                               attention_window_size=2048)
        return transformers.RecurrentGemmaForCausalLM(transformers.RecurrentGemmaConfig(
            num_hidden_layers=8, num_key_value_heads=1, **none_ids(), **c))
    H = 64 if quick else 768
    cfg = transformers.JambaConfig(vocab_size=V, hidden_size=H, intermediate_size=2 * H + H // 2 * 2,
                                   num_hidden_layers=4, num_attention_heads=4 if quick else 12,
                                   num_key_value_heads=2 if quick else 4, num_experts=8, num_experts_per_tok=2,
                                   expert_layer_period=2, expert_layer_offset=1, attn_layer_period=4,
                                   attn_layer_offset=2, mamba_d_state=16, tie_word_embeddings=True)
    return transformers.JambaForCausalLM(cfg)


NEW_HYBRIDS = ("qwen3_5", "granitemoehybrid", "nemotron_h", "falcon_h1", "lfm2")
ISSUE_52 = ("zamba", "lfm3", "bailing_hybrid", "qwen4_exp", "xlstm")


def lookup_only(hf) -> int:
    """Parameters of ``hf``'s embedding tables that a decoding step looks a row up in and never multiplies by
    (each ``nn.Embedding``'s but one that is also the head's weight): not part of the bytes a token reads."""
    head = hf.get_output_embeddings()
    tables = {id(m.weight): m.weight for m in hf.modules() if isinstance(m, torch.nn.Embedding)}
    return sum(w.numel() for w in tables.values() if head is None or w is not head.weight)


def none_ids():
    return dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)


def rwkv7_pth(folder, quick):
    """A random RWKV-7 checkpoint in BlinkDL's .pth layout at the 0.1B release's shape (vocab 65,536, d_model
    768, 12 layers, LoRA ranks w 64, a 64, v 32, g 128; tiny with ``quick``) as ``folder/model.pth``: its tensors."""
    from subquad.testing import random_rwkv7_pth

    folder.mkdir(parents=True, exist_ok=True)
    shape = (1000, 128, 2, {"w": 16, "a": 16, "v": 8, "g": 32}) if quick else \
        (65536, 768, 12, {"w": 64, "a": 64, "v": 32, "g": 128})
    return random_rwkv7_pth(folder / "model.pth", *shape)


def _new_hybrid(transformers, kind, V, quick):
    """The 2026 hybrids (issue 33's rows) at the layer shapes stated in the module doc; ``quick``: tiny ones.
    Depth is cut to 8 layers (LFM2-350M: its 16) with the released layer kinds' proportions."""
    none = none_ids()
    if kind == "qwen3_5":                 # Qwen3.5-0.8B-like: 3 Gated DeltaNet layers to 1 gated attention
        c = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                 linear_value_head_dim=16) if quick else \
            dict(hidden_size=1024, intermediate_size=3584, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
                 linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
                 linear_value_head_dim=128)
        cfg = transformers.Qwen3_5TextConfig(vocab_size=V, num_hidden_layers=8, full_attention_interval=4,
                                             tie_word_embeddings=True, **none, **c)
        return transformers.Qwen3_5ForCausalLM(cfg)
    if kind == "granitemoehybrid":        # Granite-4.0-H-Tiny-like: Mamba-2 and one NoPE attention, 64 experts
        c = dict(hidden_size=64, intermediate_size=32, shared_intermediate_size=48, num_attention_heads=4,
                 num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, mamba_n_heads=8,
                 mamba_d_state=16) if quick else \
            dict(hidden_size=1536, intermediate_size=512, shared_intermediate_size=1024, num_attention_heads=12,
                 num_key_value_heads=4, num_local_experts=64, num_experts_per_tok=6, mamba_n_heads=48,
                 mamba_d_state=128)
        cfg = transformers.GraniteMoeHybridConfig(
            vocab_size=V, num_hidden_layers=8, layer_types=["mamba"] * 3 + ["attention"] + ["mamba"] * 4,
            mamba_n_groups=1, mamba_d_head=c["hidden_size"] * 2 // c["mamba_n_heads"], position_embedding_type="nope",
            **none, **c)
        cfg._experts_implementation = "eager"
        return transformers.GraniteMoeHybridForCausalLM(cfg)
    if kind == "nemotron_h":              # Nemotron-H-like: Mamba-2, squared-ReLU MLP and attention layers
        c = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2) if quick else \
            dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=16, num_key_value_heads=4,
                 head_dim=128, mamba_num_heads=64, mamba_head_dim=64, ssm_state_size=128, n_groups=8)
        return transformers.NemotronHForCausalLM(transformers.NemotronHConfig(
            vocab_size=V, hybrid_override_pattern="M-M*-M-M", **none, **c))
    if kind == "falcon_h1":               # Falcon-H1-0.5B-like: attention and Mamba-2 side by side in every layer
        c = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 mamba_d_ssm=96, mamba_n_heads=6, mamba_d_state=16) if quick else \
            dict(hidden_size=1024, intermediate_size=2048, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                 mamba_d_ssm=1536, mamba_n_heads=24, mamba_d_state=128)
        return transformers.FalconH1ForCausalLM(transformers.FalconH1Config(
            vocab_size=V, num_hidden_layers=8, mamba_n_groups=1, **none, **c))
    # lfm2, LFM2-350M-like: gated short convolutions, attention at 6 of its 16 layers
    c = dict(hidden_size=64, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2) if quick else \
        dict(hidden_size=1024, intermediate_size=6656, num_attention_heads=16, num_key_value_heads=8)
    types = ["full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv" for i in range(16)]
    return transformers.Lfm2ForCausalLM(transformers.Lfm2Config(
        vocab_size=V, num_hidden_layers=16, layer_types=types, block_auto_adjust_ff_dim=True, block_multiple_of=256,
        block_ffn_dim_multiplier=1.0, **none, **c))


def _issue_52(transformers, kind, V, quick):
    """Issue 52's types at the layer shapes stated in the module doc, a few layers each (``quick``: tiny)."""
    none = none_ids()
    if kind == "zamba":                   # Zamba-7B-v1's widths, 6 of its 76 layers: the shared block at 2 and 5
        c = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4) if quick else \
            dict(hidden_size=3712, intermediate_size=14848, num_attention_heads=16, num_key_value_heads=16)
        return transformers.ZambaForCausalLM(transformers.ZambaConfig(
            vocab_size=V, num_hidden_layers=6, layers_block_type=["mamba", "mamba", "hybrid"] * 2, n_mamba_heads=2,
            mamba_d_state=16, **none, **c))
    if kind == "lfm3":                    # LFM3-1.7B-like: conv, conv, full, conv, sliding, conv, full, conv
        c = dict(hidden_size=64, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 sliding_window=16) if quick else \
            dict(hidden_size=2048, intermediate_size=7680, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
                 sliding_window=256)
        return transformers.Lfm3ForCausalLM(transformers.Lfm3Config(vocab_size=V, num_hidden_layers=8, **none, **c))
    if kind == "xlstm":                   # xLSTM-7B's widths (transformers' defaults), 4 of its 32 blocks
        c = dict(hidden_size=128, num_heads=2, chunk_size=16) if quick else dict(hidden_size=4096, num_heads=8)
        return transformers.xLSTMForCausalLM(transformers.xLSTMConfig(
            vocab_size=V, num_hidden_layers=4, num_blocks=4, **none, **c))
    if kind == "qwen4_exp":               # Qwen4-Exp's default widths, 4 layers: GDN, GDN, GDN, QSA; 4 streams
        # PLE at layers 1 and 3 with the n-gram tables shrunk: 16 prime-sized heads from 20,000 rows each (the
        # release's 20,000,000: ~90 GB of tables), 128 dims a head; the indexer's fields are not in the config's
        # defaults: 16 heads of 128, 2,048 tokens in blocks of 16 are our guess. 32 of its 512 experts, top 10.
        c = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                 linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, num_experts=8,
                 num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32, hc_lowrank=16,
                 ngram_vocab_size_base=200, heads_per_ngram=2, indexer_n_heads=2, indexer_head_dim=16,
                 indexer_budget=16, indexer_compress_ratio=4, split_ngram_parts=2) if quick else \
            dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                 linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, num_experts=32,
                 num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
                 hc_lowrank=320, ngram_vocab_size_base=20000, heads_per_ngram=8, indexer_n_heads=16,
                 indexer_head_dim=128, indexer_budget=2048, indexer_compress_ratio=16, split_ngram_parts=8)
        cfg = transformers.Qwen4ExpTextConfig(
            vocab_size=V, num_hidden_layers=4, hc_count=4, ple_layer_ids=[1, 3], ngram_size=3, indexer_kv_heads=1,
            rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
            **{**none, "eos_token_id": 0}, **c)
        cfg._experts_implementation = "eager"
        return transformers.Qwen4ExpForCausalLM(cfg)
    # bailing_hybrid, Ling-3.0-Flash-like: 5 KDA layers and one MLA, the first 2 dense; 32 of its 512 experts (of the
    # real size, top 8, in 8 groups, top 4 groups)
    c = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4, head_dim=16,
             kv_lora_rank=16, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, num_local_experts=8,
             num_experts_per_tok=2, n_group=4, topk_group=2) if quick else \
        dict(hidden_size=2560, intermediate_size=6144, moe_intermediate_size=768, num_attention_heads=32, head_dim=128,
             kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, num_local_experts=32,
             num_experts_per_tok=8, n_group=8, topk_group=4)
    cfg = transformers.BailingHybridConfig(vocab_size=V, num_hidden_layers=6, layer_group_size=6,
                                           first_k_dense_replace=2, num_mtp_layers=0, **none, **c)
    cfg._experts_implementation = "eager"
    return transformers.BailingHybridForCausalLM(cfg)


def read_gbps():
    """This machine's read bandwidth (GB/s): the faster of summing 256 MB of touched memory and float32
    matrix-vector products over 16 column-major 32 MB matrices (each read once per pass), best of 5."""
    a = torch.randn(64 << 20)                                 # 256 MB, written (so its pages are real)
    ms = [torch.randn(2048, 4096).T for _ in range(16)]       # (4096, 2048) column-major, 512 MB in all
    x = torch.randn(2048)
    best_sum = best_mv = 1e9
    for _ in range(5):
        t = time.perf_counter()
        a.sum()
        best_sum = min(best_sum, time.perf_counter() - t)
        t = time.perf_counter()
        for m in ms:
            torch.mv(m, x)
        best_mv = min(best_mv, time.perf_counter() - t)
    return max(a.numel() * 4 / best_sum, sum(m.numel() for m in ms) * 4 / best_mv) / 1e9


def worker(who, folder, dtype, batch, T, n_new):
    """One measurement in this process: prints a JSON line. Prefill: ``T`` tokens a row. Decode: generating
    ``n_new`` tokens after a prompt of ``DECODE_PROMPT`` (env; default T) tokens, less generating one, per step:
    a short prompt keeps the two generate calls' prefill - subtracted - from swamping the steps' time."""
    threads = int(os.environ.get("BENCH_THREADS", "2"))
    torch.set_num_threads(threads)
    P = min(T, int(os.environ.get("DECODE_PROMPT", T)))
    dt = getattr(torch, dtype) if dtype != "int8" else torch.float32
    pth = Path(folder) / "model.pth"                       # RWKV-7: BlinkDL's layout, no config.json
    V = torch.load(pth, mmap=True)["emb.weight"].shape[0] if pth.exists() else \
        json.loads((Path(folder) / "config.json").read_text())["vocab_size"]
    ids = torch.randint(0, V, (batch, T), generator=torch.Generator().manual_seed(1))
    if who == "rwkv":                                       # BlinkDL's package, strategy "cpu fp32", batch 1
        os.environ["RWKV_V7_ON"] = "1"
        from rwkv.model import RWKV

        model = RWKV(str(pth.with_suffix("")), "cpu fp32")
        prompt = ids[0].tolist()

        def prefill():
            return model.forward(prompt, None)

        first = prefill                                     # the package returns the last position's logits only

        def gen(n):
            out, state = model.forward(prompt[:P], None)
            new = [int(out.argmax())]
            while len(new) < n:
                out, state = model.forward(new[-1:], state)
                new.append(int(out.argmax()))
            return new
    elif who.startswith("subquad"):
        from subquad.models import from_pretrained
        from subquad.models.decode import compile_decode

        src = pth if pth.exists() else folder
        if dtype == "int8":
            model, _ = from_pretrained(src, quantize="int8")
        else:
            model, _ = from_pretrained(src, dtype=dt)
        if who != "subquad":                                   # subquad-compiled (int8: always compiled)
            compile_decode(model)
        model.config.eos_token_ids = []                        # n tokens each time, as min_new_tokens below

        def prefill():
            return model.prefill(ids)

        def first():                                           # what generate's prefill computes
            return model.prefill(ids, logits="last")

        def gen(n):
            return model.generate(ids[:, :P], n, temperature=0)
    else:
        import transformers

        extra = {"experts_implementation": "eager"} if "jamba" in Path(folder).name else {}
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dt, **extra).eval()

        def prefill():
            return model(ids)

        keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}

        def first():                                           # what its generate's prefill computes: the last
            return model(ids, **keep)                          # position's logits where the model takes
                                                               # logits_to_keep, else every position's
        def gen(n):
            return model.generate(ids[:, :P], max_new_tokens=n, min_new_tokens=n, do_sample=False)
    with torch.no_grad():
        t = time.perf_counter()
        prefill()
        pre = time.perf_counter() - t
        t = time.perf_counter()
        first()
        pre_first = time.perf_counter() - t
        if who.startswith("subquad-"):                         # compile outside the timing, every shape the
            t = time.perf_counter()                            # timed runs meet (a KV cache's: static, dynamic)
            gen(n_new)
            compile_s = time.perf_counter() - t
        t = time.perf_counter()
        gen(1)
        one = time.perf_counter() - t
        t = time.perf_counter()
        gen(n_new)
        many = time.perf_counter() - t
    peak = _peak_mb()
    out = {"prefill_tok_s": batch * T / pre, "first_tok_s": batch * T / pre_first, "decode_ms": 1e3 * (many - one) / (n_new - 1), "peak_mb": peak}
    if who.startswith("subquad-"):
        out["compile_s"] = compile_s
    print(json.dumps(out))


def _peak_mb():
    """This process's peak resident memory (VmHWM; ru_maxrss would count the launching process's too)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_worker(*args, python=sys.executable):
    out = subprocess.run([python, __file__, "--worker", *map(str, args)], capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": os.environ.get("BENCH_THREADS", "2")})
    if out.returncode:
        raise RuntimeError(f"worker {args} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def llama_cpp(folder, args, T, n_new, outtype="f32"):
    """The folder's GGUF (its converter; ``outtype`` f32 or q8_0), then prefill/decode at batch 1 in
    llama-cpp-python's Python; None (and why) where the converter or the runtime refuses the model."""
    gguf = Path(folder).with_suffix(f".{outtype}.gguf")
    P = args.decode_prompt or T
    conv = subprocess.run([sys.executable, str(Path(__file__).parent / "llama_convert.py"), args.llama_src,
                           str(folder), "--outfile", str(gguf), "--outtype", outtype], capture_output=True,
                          text=True)
    if conv.returncode:
        return {"error": "convert_hf_to_gguf.py: " + conv.stderr.strip().splitlines()[-1][:200]}
    code = f"""
import json, random, time
from llama_cpp import Llama
llm = Llama(model_path={str(gguf)!r}, n_ctx={T + n_new + 8}, n_threads={args.threads}, n_threads_batch={args.threads},
            n_batch=512, verbose=False)
random.seed(1)
ids = [random.randrange(100, 1000) for _ in range({T})]
t = time.perf_counter(); llm.eval(ids); pre = time.perf_counter() - t
llm.reset(); llm.eval(ids[:{P}])               # the decode's prompt, as subquad's and the reference's
t = time.perf_counter()
for _ in range({n_new}):
    llm.eval([llm.sample(temp=0.0)])
dec = time.perf_counter() - t
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM:")][0].split()[1]
print(json.dumps({{"prefill_tok_s": {T} / pre, "first_tok_s": {T} / pre, "decode_ms": 1e3 * dec / {n_new}, "peak_mb": int(hwm) / 1024}}))
"""
    out = subprocess.run([args.llama_python, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    gguf.unlink(missing_ok=True)
    if out.returncode:
        return {"error": "llama.cpp: " + (out.stderr.strip().splitlines() or ["failed"])[-1][:200]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--models", default="mamba,mamba2,jamba,qwen3_next,kimi_linear")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--name", default="pretrained", help="results/NAME.{json,md}")
    p.add_argument("--llama-python", help="a Python with llama-cpp-python installed")
    p.add_argument("--llama-src", help="llama.cpp's source tree (convert_hf_to_gguf.py, gguf-py)")
    p.add_argument("--who", default="subquad,subquad-compiled,reference",
                   help="which to run: subquad (eager), subquad-compiled, reference (transformers or rwkv); "
                        "llama.cpp alone (with --llama-python, --llama-src) runs only its rows")
    p.add_argument("--threads", type=int, default=2, help="threads of every run (the issue's rows: 2)")
    p.add_argument("--decode-prompt", type=int, default=None,
                   help="prompt tokens before the timed decode (default: the prefill's; 256 for models whose "
                        "2,048-token prefill takes many seconds - its noise would swamp a 64-step decode)")
    p.add_argument("--new", type=int, default=256, help="greedy tokens at batch 1 (the larger models: 64)")
    p.add_argument("--worker", nargs=6, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        who, folder, dtype, batch, T, n_new = args.worker
        return worker(who, folder, dtype, int(batch), int(T), int(n_new))
    os.environ["BENCH_THREADS"] = str(args.threads)
    if args.decode_prompt:
        os.environ["DECODE_PROMPT"] = str(args.decode_prompt)
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = "_quick" if args.quick else ""
    machine = machine_line()
    gbps = read_gbps()
    print(machine, f"read bandwidth {gbps:.1f} GB/s", flush=True)
    res = {"machine": machine, "read_gbps": gbps, "threads": args.threads, "decode_prompt": args.decode_prompt,
           "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.models.split(","):
            folder = Path(tmp) / kind
            if kind == "rwkv7":                                    # against BlinkDL's package, not transformers
                named, hf, reference = list(rwkv7_pth(folder, args.quick).items()), None, "rwkv"
            else:
                hf, reference = hf_model(kind, args.quick), "transformers"
                hf.save_pretrained(folder)
                named = list(hf.named_parameters())
            params = sum(p.numel() for n, p in named)
            active = params
            int8_bytes = 0                                         # quantize="int8": 1 byte a quantised weight
            from subquad.models.quant import MIN_WEIGHTS
            for n, p in named:
                matrix = p.shape[-2] * p.shape[-1] if p.dim() >= 2 else 0      # one expert's, for stacked ones
                int8_bytes += p.numel() * (1 if matrix >= MIN_WEIGHTS else 4)
            if hf is not None and getattr(hf.config, "num_experts_per_tok", None):   # top-k experts only
                moe = sum(p.numel() for n, p in hf.named_parameters() if ".experts." in n)
                E = getattr(hf.config, "num_experts", None) or hf.config.num_local_experts
                active = params - moe + moe * hf.config.num_experts_per_tok // E
                int8_bytes -= moe - moe * hf.config.num_experts_per_tok // E
            if hf is not None:                                     # tables looked up, not read: an untied
                looked = lookup_only(hf)                           # embedding, PLE's n-gram tables
                active -= looked
                int8_bytes -= 4 * looked                           # kept float32 by quantize="int8"
            del hf, named
            for dtype in args.dtypes.split(","):
                for batch in map(int, args.batches.split(",")):
                    T, n_new = ((64, 16) if args.quick else (2048, args.new)) if batch == 1 else \
                        ((32, 8) if args.quick else (512, 64))
                    nbytes = int8_bytes if dtype == "int8" else active * torch.finfo(getattr(torch, dtype)).bits // 8
                    row = {"model": kind, "dtype": dtype, "batch": batch, "T": T, "new": n_new,
                           "parameters": params, "active_parameters": active, "bytes_per_token": nbytes,
                           "bound_ms": 1e3 * nbytes / (gbps * 1e9)}
                    whos = ("subquad-int8",) if dtype == "int8" else ("subquad", "subquad-compiled", reference)
                    if reference == "rwkv" and batch != 1:         # the package decodes one sequence
                        whos = whos[:-1]
                    chosen = set(args.who.replace("reference", reference).split(","))
                    whos = tuple(w for w in whos if w in chosen or w == "subquad-int8")
                    for _ in range(args.repeats):
                        for who in whos:
                            r = run_worker(who, folder, dtype, batch, T, n_new)
                            best = row.setdefault(who, r)
                            best["prefill_tok_s"] = max(best["prefill_tok_s"], r["prefill_tok_s"])
                            best["first_tok_s"] = max(best["first_tok_s"], r["first_tok_s"])
                            best["decode_ms"] = min(best["decode_ms"], r["decode_ms"])
                            best["peak_mb"] = min(best["peak_mb"], r["peak_mb"])
                    if args.llama_python and args.llama_src and dtype in ("float32", "int8") and batch == 1:
                        row["llama.cpp"] = llama_cpp(folder, args, T, n_new, "f32" if dtype == "float32" else "q8_0")
                    res["rows"].append(row)
                    print(json.dumps(row), flush=True)
    md = [f"{machine}; read bandwidth {gbps:.1f} GB/s. {args.threads} threads. Random weights at the real shapes; batch 1: prefill "
          f"2,048 tokens; {args.new} greedy tokens after a prompt of {args.decode_prompt or 2048}, batch 8: 512 then 64; best of "
          f"{args.repeats} runs, each in its own process (peak = its resident memory). subquad: eager, compiled "
          "(compile_decode), int8 (quantize='int8', compiled); llama.cpp: the float32 GGUF in float32 rows, Q8_0 "
          "in int8 rows; bound = bytes a token reads / the read bandwidth.", "",
          "| model | dtype | batch | prefill tok/s: subquad | transformers | llama.cpp | generate's prefill: subquad "
          "| transformers | decode ms/step: subquad eager | compiled | transformers | llama.cpp | bound | fastest / "
          "bound | peak MB: subquad | transformers | llama.cpp |",
          "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def cell(r, key, fmt):
        return "" if r is None or key not in r else fmt.format(r[key])

    for r in res["rows"]:
        ll = r.get("llama.cpp")
        lp = (ll["error"] if ll and "error" in ll else cell(ll, "prefill_tok_s", "{:,.0f}"))
        sq = r.get("subquad") or r.get("subquad-int8") or r.get("subquad-compiled")
        fast = r.get("subquad-compiled") or r.get("subquad-int8") or r.get("subquad")
        h = r.get("transformers") or r.get("rwkv")
        name = r["model"] + (" (reference: rwkv package)" if "rwkv" in r else "")
        ratio = "" if fast is None else f"{fast['decode_ms'] / r['bound_ms']:.2f}x"   # None: --who llama.cpp
        md.append(f"| {name} | {r['dtype']} | {r['batch']} | {cell(sq, 'prefill_tok_s', '{:,.0f}')} | "
                  f"{cell(h, 'prefill_tok_s', '{:,.0f}')} | {lp} | {cell(sq, 'first_tok_s', '{:,.0f}')} | "
                  f"{cell(h, 'first_tok_s', '{:,.0f}')} | {cell(r.get('subquad'), 'decode_ms', '{:.1f}')} | "
                  f"{cell(r.get('subquad-compiled') or r.get('subquad-int8'), 'decode_ms', '{:.1f}')} | "
                  f"{cell(h, 'decode_ms', '{:.1f}')} | "
                  f"{cell(ll, 'decode_ms', '{:.1f}')} | {r['bound_ms']:.1f} | {ratio} | {cell(sq, 'peak_mb', '{:,.0f}')} | "
                  f"{cell(h, 'peak_mb', '{:,.0f}')} | {cell(ll, 'peak_mb', '{:,.0f}')} |")
    (args.out / f"{args.name}{suffix}.json").write_text(json.dumps(res, indent=2))
    (args.out / f"{args.name}{suffix}.md").write_text("\n".join(md) + "\n")
    print("\n" + "\n".join(md))


if __name__ == "__main__":
    main()
