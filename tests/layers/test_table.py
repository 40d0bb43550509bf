"""The table of mechanisms (``subquad.layers.registry``): every entry passes the generic battery
(``subquad.testing``), a registered mixer joins patterns, options and the battery with no other edit,
and the battery fails a mixer that breaks the contract."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from subquad.layers.base import Mixer
from subquad.layers.registry import MIXERS, build_mixer, mixer_options, register_mixer
from subquad.ops import simple_gla
from subquad.testing import CHECKS, check_mixer


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("name", list(MIXERS))
def test_every_mechanism_passes_the_battery(name, check):
    check_mixer(name, checks=[check], options={"chunk_size": 4})


class Forgetful(Mixer):
    """A decayed recurrence that drops the state it is given: one forward is right, decoding is not."""

    def __init__(self, d_model, n_heads=2, mode="chunk", chunk_size=64):
        super().__init__(d_model, mode, chunk_size)
        self.n_heads, self.head_dim = n_heads, d_model // n_heads
        self.qkv, self.g = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, n_heads)

    def mix_flops(self, T):
        return 4.0 * self.d_model * self.head_dim

    def empty_state(self, batch_size, device=None, dtype=torch.float32):
        return {"S": self.zeros(batch_size, self.n_heads, self.head_dim, self.head_dim, device=device, dtype=dtype)}

    def mix(self, x, state, seq):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, self.head_dim).unbind(2)
        o, S = seq.recurrence(simple_gla, q, k, v, -F.softplus(self.g(x)), mode=self.mode,
                              chunk_size=self.chunk_size, initial_state=None)      # the bug: state ignored
        return o.reshape(B, T, -1), {"S": S}


@pytest.fixture
def registered():
    names = []

    def register(name, cls, **entry):
        entry = register_mixer(name, cls, **entry)
        names.append(name)                               # only what this test added
        return entry

    yield register
    for n in names:
        MIXERS.pop(n, None)


def test_a_registered_mixer_builds_takes_options_and_passes_what_it_can(registered):
    registered("forgetful", Forgetful)
    assert isinstance(build_mixer("forgetful", 16, 2), Forgetful)
    assert mixer_options("forgetful") == ["chunk_size", "mode"]
    check_mixer("forgetful", checks=["contract", "varlen", "bf16", "compile", "model"])
    with pytest.raises(AssertionError, match="forgetful: prefill \\+ steps differ"):
        check_mixer("forgetful", checks=["decode"])


def test_register_refuses_what_the_table_cannot_hold(registered):
    with pytest.raises(ValueError, match="already registered"):
        registered("softmax", Forgetful)
    with pytest.raises(ValueError, match="identifier"):
        registered("two words", Forgetful)
    with pytest.raises(ValueError, match="subclass of subquad.layers.base.Mixer"):
        registered("module", nn.Linear)
    with pytest.raises(ValueError, match="unknown check"):
        check_mixer("softmax", checks=["speed"])
