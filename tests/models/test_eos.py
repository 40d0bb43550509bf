"""End-of-text ids: read from a folder's generation_config.json (first) or config.json, kept through
save_pretrained, and generation stops right after emitting one."""

import json

import pytest
import torch

from subquad.models import LanguageModel, ModelConfig, from_pretrained
from subquad.models.hf import eos_token_ids


def mamba():
    torch.manual_seed(0)
    return LanguageModel(ModelConfig(vocab_size=64, d_model=32, n_layers=2, pattern="mamba", mlp=False,
                                     tie_embeddings=False)).eval()


def test_folder_eos_ids_and_generate_stops_there(tmp_path):
    model = mamba()
    prompt = [3, 1, 4, 1, 5]
    free, _ = model.generate(prompt, 12, temperature=0)
    i = next(i for i in range(1, 12) if free[i] not in free[:i])
    model.config.eos_token_ids = [free[i]]
    model.save_pretrained(tmp_path / "m")
    assert json.loads((tmp_path / "m" / "config.json").read_text())["eos_token_id"] == free[i]
    loaded, _ = from_pretrained(tmp_path / "m")
    assert loaded.config.eos_token_ids == [free[i]]
    out, _ = loaded.generate(prompt, 12, temperature=0)
    assert out == free[:i + 1]                                  # emitted, then stopped
    outs, _ = loaded.generate([prompt, prompt[:2]], 12, temperature=0)
    assert outs[0] == free[:i + 1]

    (tmp_path / "m" / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2, 7]}))
    assert eos_token_ids(tmp_path / "m") == [2, 7]              # generation_config.json wins, as transformers
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(ValueError, match="eos_token_id"):
        from_pretrained(tmp_path / "m")
    with pytest.raises(ValueError, match="eos_token_ids"):
        ModelConfig(vocab_size=8, eos_token_ids=[8])
