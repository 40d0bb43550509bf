"""Every Hugging Face checkpoint type against transformers, one table row each (the harness:
``tests/models/hf_harness.py``): a tiny random model's logits, prefill then one-token decoding, packed rows,
greedy tokens and a ``save_pretrained`` round trip. What is a type's alone is in its ``test_hf_<type>.py``."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")   # the `hf` extra installs it (make test requires it); the library never does

from tests.models import (  # noqa: E402
    test_hf, test_hf_bailing_hybrid, test_hf_delta, test_hf_falcon_h1, test_hf_granite, test_hf_hybrid, test_hf_kimi,
    test_hf_lfm2, test_hf_lfm2_moe, test_hf_lfm3, test_hf_minimax, test_hf_nemotron_h, test_hf_qwen3_5,
    test_hf_qwen4_exp, test_hf_recurrent_gemma, test_hf_xlstm, test_hf_zamba, test_hf_zamba2)
from tests.models.hf_harness import (  # noqa: E402
    F32, Row, cases, check_decode, check_logits, check_round_trip, check_router_loss, variants)


def _mamba(kind, Model):
    return Row(kind, lambda tmp_path, dtype=torch.float32, **over: test_hf._hf_mamba(tmp_path, dtype, kind, **over),
               64, Model, loaded=test_hf._loaded(kind), hf_logits=test_hf._hf_logits, atol=1e-6,
               # transformers' Mamba-2 (float64) here picks token 30 where its own forward has 53 ahead by 2e-4
               min_agree=29 if kind == "mamba2" else 32)


def _kind(module, kind, Model, **kw):
    """A row of one of a module's ``KINDS``, built by its ``_hf(tmp_path, kind, dtype, **over)``."""
    return Row(kind, lambda tmp_path, dtype=torch.float32, **over: module._hf(tmp_path, kind, dtype, **over), module.V,
               Model, **kw)


def _module(module, type_, Model, **kw):
    """The row of a module of one type: its ``_hf(tmp_path, dtype, **over)``, and where it has them its logits
    variants (``LOGITS``, name: over), round-trip variants (``ROUND_TRIP``) and checks of the model loaded
    (``_loaded``) and the folder saved (``_saved``)."""
    got = {"logits": variants(**getattr(module, "LOGITS", {})), "loaded": getattr(module, "_loaded", None),
           "round_trip": tuple(getattr(module, "ROUND_TRIP", {"": {}}).items()),
           "saved": getattr(module, "_saved", None)}
    return Row(type_, module._hf, module.V, Model, **{**got, **kw})


ROWS = [
    # float64 cannot be tighter than ~1e-7: transformers' Mamba computes A = -exp(A_log.float()) in float32
    _mamba("mamba", transformers.MambaForCausalLM),
    _mamba("falcon_mamba", transformers.FalconMambaForCausalLM),
    _mamba("mamba2", transformers.Mamba2ForCausalLM),
    _kind(test_hf_hybrid, "bamba", transformers.BambaForCausalLM, min_agree=test_hf_hybrid.MIN_AGREE["bamba"]),
    _kind(test_hf_hybrid, "jamba", transformers.JambaForCausalLM, min_agree=test_hf_hybrid.MIN_AGREE["jamba"],
          router_loss=True),
    # float64 is bounded by transformers' delta rule, which computes in float32 inside
    _kind(test_hf_delta, "qwen3_next", transformers.Qwen3NextForCausalLM, router_loss=True),
    _kind(test_hf_delta, "olmo_hybrid", transformers.OlmoHybridForCausalLM),
    _module(test_hf_kimi, "kimi_linear", transformers.KimiLinearForCausalLM),
    # float64 bounded by transformers' KDA and router, which compute in float32 inside
    _module(test_hf_bailing_hybrid, "bailing_hybrid", transformers.BailingHybridForCausalLM),
    _module(test_hf_minimax, "minimax", transformers.MiniMaxForCausalLM, router_loss=True),
    _module(test_hf_lfm2, "lfm2", transformers.Lfm2ForCausalLM),
    _module(test_hf_lfm2_moe, "lfm2_moe", transformers.Lfm2MoeForCausalLM),
    _module(test_hf_lfm3, "lfm3", transformers.Lfm3ForCausalLM),
    _module(test_hf_falcon_h1, "falcon_h1", transformers.FalconH1ForCausalLM, ours_atol=1e-6),
    _module(test_hf_granite, "granitemoehybrid", transformers.GraniteMoeHybridForCausalLM, ours_atol=1e-6,
            router_loss=True),
    # float64 cannot be tighter than ~1e-7: transformers' RecurrentGemma runs its norms and its scan in float32;
    # greedy decoding from a float32 model cast to float64
    _module(test_hf_recurrent_gemma, "recurrent_gemma", transformers.RecurrentGemmaForCausalLM,
            decode_dtype=torch.float32),
    _module(test_hf_nemotron_h, "nemotron_h", transformers.NemotronHForCausalLM),
    Row("nemotron_h_moe", test_hf_nemotron_h._hf_moe, test_hf_nemotron_h.V, transformers.NemotronHForCausalLM,
        logits=variants(**test_hf_nemotron_h.MOE_LOGITS) + variants((F32,), **test_hf_nemotron_h.MOE_LATENT_LOGITS),
        round_trip=tuple(test_hf_nemotron_h.MOE_ROUND_TRIP.items()), model_type="nemotron_h",
        saved=test_hf_nemotron_h._saved_moe),
    _module(test_hf_zamba2, "zamba2", transformers.Zamba2ForCausalLM, T=40),
    # transformers' logits in the model's dtype (its forward casts them to float32); "fused": a folder of NX-AI's
    # fused layout checked against the single-mode model it was written from (transformers cannot build one)
    _module(test_hf_xlstm, "xlstm", transformers.xLSTMForCausalLM, hf_logits=test_hf_xlstm._hf_logits),
    # float64 cannot be tighter than ~1e-7: transformers' Mamba computes A = -exp(A_log.float()) in float32
    _module(test_hf_zamba, "zamba", transformers.ZambaForCausalLM, T=40),
    # multimodal folders, saved as their text-only types; float64 bounded by transformers' delta rule (float32)
    _kind(test_hf_qwen3_5, "qwen3_5", transformers.Qwen3_5ForCausalLM, save_as="qwen3_5_text",
          model_type="qwen3_5_text", saved=test_hf_qwen3_5._saved,
          marks=(pytest.mark.filterwarnings("ignore:qwen3_5"),)),
    _kind(test_hf_qwen3_5, "qwen3_5_moe", transformers.Qwen3_5MoeForCausalLM, save_as="qwen3_5_moe_text",
          model_type="qwen3_5_moe_text", saved=test_hf_qwen3_5._saved, router_loss=True,
          marks=(pytest.mark.filterwarnings("ignore:qwen3_5"),)),
    # float64 bounded by transformers' delta rule and QSA's pooled keys and scores (float32 inside)
    _module(test_hf_qwen4_exp, "qwen4_exp_text", transformers.Qwen4ExpForCausalLM, router_loss=True),
]


@pytest.mark.parametrize("row,case", cases(ROWS, "logits"))
def test_logits_equal_transformers(tmp_path, row, case):
    check_logits(row, case, tmp_path)


@pytest.mark.parametrize("row", [pytest.param(r, id=r.id, marks=r.marks) for r in ROWS if r.decode])
def test_prefill_decode_packed_and_greedy_equal_transformers(tmp_path, row):
    """Prefill then one token at a time, and packed rows, equal the full forward (1e-10); every greedy token is
    transformers' choice under its own forward, and at least ``min_agree`` equal its ``generate``."""
    check_decode(row, tmp_path)


@pytest.mark.parametrize("row,case", cases(ROWS, "round_trip"))
def test_save_pretrained_round_trip_loads_in_transformers(tmp_path, row, case):
    check_round_trip(row, case, tmp_path)


@pytest.mark.parametrize("row", [pytest.param(r, id=r.id, marks=r.marks) for r in ROWS if r.router_loss])
def test_router_loss_equals_transformers(tmp_path, row):
    check_router_loss(row, tmp_path)
