"""The model's generic initialisation leaves alone what a layer initialised on purpose."""

import torch
import torch.nn.functional as F

from subquad.models import LanguageModel, ModelConfig


def test_mamba_dt_initialisation_survives_the_model_init():
    torch.manual_seed(0)
    model = LanguageModel(ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, context_length=16,
                                      pattern="mamba"))
    dt_proj = model.blocks[0].mixer.dt_proj
    dt = F.softplus(dt_proj.bias)
    assert dt.min() >= 1e-3 * 0.999 and dt.max() <= 0.1 * 1.001      # dt ~ logU[1e-3, 0.1], not softplus(0)
    assert dt_proj.weight.abs().max() <= dt_proj.weight.shape[1] ** -0.5
    assert dt_proj.weight.std() > 0.1                                  # uniform(+-dt_rank^-0.5), not N(0, 0.02)
    out = model.blocks[0].mixer.out_proj.weight
    assert abs(out.std().item() - 0.02) < 0.005                        # everything else: the model's N(0, 0.02)
