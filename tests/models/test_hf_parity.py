"""Every Hugging Face checkpoint type against transformers, one table row each (the harness:
``tests/models/hf_harness.py``): a tiny random model's logits, prefill then one-token decoding, packed rows,
greedy tokens and a ``save_pretrained`` round trip. What is a type's alone is in its ``test_hf_<type>.py``."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")   # the `hf` extra installs it (make test requires it); the library never does

from tests.models import test_hf  # noqa: E402
from tests.models.hf_harness import F64, Row, cases, check_decode, check_logits, check_round_trip  # noqa: E402


def _mamba(kind, Model):
    return Row(kind, lambda tmp_path, dtype=torch.float32, **over: test_hf._hf_mamba(tmp_path, dtype, kind, **over),
               64, Model, loaded=test_hf._loaded(kind), hf_logits=test_hf._hf_logits, atol=1e-6,
               # transformers' Mamba-2 (float64) here picks token 30 where its own forward has 53 ahead by 2e-4
               min_agree=29 if kind == "mamba2" else 32)


ROWS = [
    # float64 cannot be tighter than ~1e-7: transformers' Mamba computes A = -exp(A_log.float()) in float32
    _mamba("mamba", transformers.MambaForCausalLM),
    _mamba("falcon_mamba", transformers.FalconMambaForCausalLM),
    _mamba("mamba2", transformers.Mamba2ForCausalLM),
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
