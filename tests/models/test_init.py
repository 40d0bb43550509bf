"""The model's initialisation: what a layer initialised on purpose is left alone; residual branches scale
with depth; output gates start open; normalised outputs start comparable to attention's."""

import math

import pytest

import torch
import torch.nn.functional as F

from subquad.layers.registry import causal_mixers
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
    x_proj = model.blocks[0].mixer.x_proj.weight
    assert abs(x_proj.std().item() - 0.02) < 0.005                     # everything else: the model's N(0, 0.02)


def test_residual_projections_scale_with_depth():
    """GPT-2's rule: N(0, 0.02 / sqrt(residual branches)); normalised-output mixers a further 0.1."""
    from subquad.models.lm import NORMED_OUTPUT_SCALE

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, d_model=128, n_layers=8, n_heads=2, pattern="softmax,mamba2*7", mlp=True)  # hybrid
    model = LanguageModel(cfg)
    std = 0.02 / math.sqrt(16)                                          # 8 layers x (mixer + MLP)
    assert model.blocks[0].mixer.o_proj.weight.std().item() == pytest.approx(std, rel=0.05)
    assert model.blocks[0].mlp.w_down.weight.std().item() == pytest.approx(std, rel=0.05)
    assert model.blocks[1].mixer.out_proj.weight.std().item() == pytest.approx(std * NORMED_OUTPUT_SCALE, rel=0.05)
    assert model.blocks[1].mixer.in_proj.weight.std().item() == pytest.approx(0.02, rel=0.05)
    no_mlp = LanguageModel(ModelConfig(vocab_size=64, d_model=128, n_layers=4, n_heads=2, mlp=False))
    assert no_mlp.blocks[0].mixer.o_proj.weight.std().item() == pytest.approx(0.02 / 2, rel=0.05)


@pytest.mark.parametrize("name", ["gla", "gated_deltanet", "retention"])
def test_output_gates_start_open(name):
    """The swish gate after the norm starts at ~1 on the model's normalised input (it was ~0 +- 0.08)."""
    torch.manual_seed(0)
    model = LanguageModel(ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=2, pattern=name, mlp=False))
    mixer = model.blocks[0].mixer
    proj = mixer.r_proj if name == "gla" else mixer.g_proj
    x = model.blocks[0].norm1(torch.randn(4, 50, 64))
    gate = F.silu(proj(x) + mixer.gate_bias)
    assert 0.9 <= gate.mean().item() <= 1.1 and gate.std().item() < 0.3
    closed = LanguageModel(ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=2, pattern=name, mlp=False,
                                       mixer_options={name: {"open_gate": False}}))
    assert closed.blocks[0].mixer.gate_bias is None                     # the paper's gate, for checkpoints
    g = F.silu((mixer.r_proj if name == "gla" else mixer.g_proj)(x))
    assert abs(g.mean().item()) < 0.1                                   # what "nearly closed" meant


@pytest.mark.parametrize("name", ["mamba2", "gla", "deltanet", "gated_deltanet", "retention", "linear", "mamba"])
def test_a_hybrids_layers_write_into_the_stream_comparably_at_init(name):
    """In a hybrid (name, softmax), each layer's output RMS at init on the same normalised input within 5x
    of the attention layer's: as built, Mamba-2 and DeltaNet wrote ~40x more. A pure model keeps one
    scale for every branch (the normalised outputs are not scaled down there)."""
    torch.manual_seed(0)
    model = LanguageModel(ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=2, pattern=f"{name},softmax",
                                      mlp=False, context_length=128))
    x = model.blocks[0].norm1(torch.randn(8, 128, 64, generator=torch.Generator().manual_seed(1)))
    with torch.no_grad():
        rms = [model.blocks[i].mixer(x)[0].pow(2).mean().sqrt().item() for i in (0, 1)]
    ratio = rms[0] / rms[1]
    lo = 1 / 8 if name == "mamba" else 1 / 5          # Mamba's unnormalised output starts smallest of all
    assert lo <= ratio <= 5, f"{name}: {ratio:.2f}x the attention layer's output at init"
    pure = LanguageModel(ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=2, pattern=name, mlp=False))
    std = pure.blocks[0].mixer.output_projection().weight.std().item()
    assert std == pytest.approx(0.02 / math.sqrt(2), rel=0.1)


def _old_init_residual_branches(self):
    """``LanguageModel._init_residual_branches`` as it read before the table declared ``attention``: a hybrid
    was found by ``isinstance(block.mixer, SoftmaxAttention)``."""
    from subquad.layers.attention import SoftmaxAttention
    from subquad.layers.channel_mix import ChannelMix
    from subquad.layers.mlp import ReLU2MLP, SwiGLU
    from subquad.models.lm import NORMED_OUTPUT_SCALE
    from subquad.models.moe import MoE

    branches = self.config.n_layers * (2 if self.config.mlp else 1)
    std = 0.02 / branches ** 0.5
    hybrid = any(isinstance(b.mixer, SoftmaxAttention) for b in self.blocks)
    with torch.no_grad():
        for block in self.blocks:
            for mixer in block.mixers():
                proj = mixer.output_projection()
                if proj is not None and not getattr(proj, "keep_init", False):
                    proj.weight.normal_(0, std * (NORMED_OUTPUT_SCALE if hybrid and mixer.normed_output else 1.0))
            if isinstance(block.mlp, (SwiGLU, ReLU2MLP)):
                block.mlp.w_down.weight.normal_(0, std)
            elif isinstance(block.mlp, ChannelMix):
                block.mlp.value.weight.normal_(0, std)
            elif isinstance(block.mlp, MoE):
                block.mlp.w_down.normal_(0, std)
                if block.mlp.shared is not None:
                    block.mlp.shared.w_down.weight.normal_(0, std)


def test_the_table_declares_attention_as_the_old_class_test_found_it():
    from subquad.layers.attention import SoftmaxAttention
    from subquad.layers.registry import MIXERS

    for name, e in MIXERS.items():
        assert isinstance(e.attention, bool), f"{name}: attention must be declared True or False"
        assert e.attention == issubclass(e.cls, SoftmaxAttention), name


@pytest.mark.parametrize("name", causal_mixers())
def test_every_mixer_gets_the_init_and_blocks_of_the_rule_before_the_table(name, monkeypatch):
    """The init read from the table equals the old class test's, weight for weight, alone and beside
    attention (and the Falcon-H1 block, where the attention is the second mixer: not a hybrid, as before)."""
    from subquad.layers.registry import MIXERS

    beside = "mamba2" if MIXERS[name].attention else "softmax"
    configs = [dict(pattern=name), dict(pattern=f"{name},softmax"), dict(pattern=f"mamba2,{name}"),
               dict(pattern=name, parallel={name: beside})]
    for over in configs:
        cfg = ModelConfig(**{"vocab_size": 32, "d_model": 16, "n_layers": 2, "n_heads": 2, "context_length": 16,
                             "mixer_options": {"mamba2": {"head_dim": 8, "d_state": 4}}, **over})
        torch.manual_seed(0)
        new = LanguageModel(cfg)
        with monkeypatch.context() as m:
            m.setattr(LanguageModel, "_init_residual_branches", _old_init_residual_branches)
            torch.manual_seed(0)
            old = LanguageModel(cfg)
        assert [type(b) for b in new.blocks] == [type(b) for b in old.blocks], over
        a, b = new.state_dict(), old.state_dict()
        assert list(a) == list(b), over
        for k in a:
            assert torch.equal(a[k], b[k]), f"{over}: {k} starts differently"
