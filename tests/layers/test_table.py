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
from subquad.testing import CAUSAL, CHECKS, ENCODER, check_mixer


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("name", list(MIXERS))
def test_every_mechanism_passes_the_battery(name, check):
    """Each check that applies to it, as the table declares (an encoder-only one: no decoding, packing or model)."""
    options = {"chunk_size": 4} if "chunk_size" in mixer_options(name) else {}
    ran = check_mixer(name, checks=[check], options=options)
    skipped = CAUSAL if MIXERS[name].encoder_only else ENCODER
    assert ran == ([] if check in skipped else [check])


@pytest.mark.parametrize("name,options", [("mamba", {"heads": 2}), ("mamba2", {"conv_size": 2}),
                                          ("gla", {"conv_size": 4}), ("mamba", {"bcdt_rms_eps": 1e-5})])
def test_rollback_per_token_with_options(name, options):
    """A "states" mixer keeps its state per verified token with the options checkpoints set (Zamba's heads)."""
    assert MIXERS[name].rollback == "states"
    assert check_mixer(name, checks=["rollback"], options=options) == ["rollback"]


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


class Narrow(Forgetful):
    """Returns one channel too few."""

    def mix(self, x, state, seq):
        y, s = super().mix(x, state, seq)
        return y[..., :-1], s


class Unkeyed(Forgetful):
    """Reads a state entry its empty_state does not hold."""

    def mix(self, x, state, seq):
        if state is not None:
            state["conv"]
        return super().mix(x, state, seq)


def test_the_contract_names_a_wrong_output_or_state_and_a_mixer_is_replaced_under_its_name(registered):
    registered("narrow", Narrow)
    with pytest.raises(AssertionError, match=r"narrow: mix returned \(2, 5, 15\) for x \(2, 5, 16\)"):
        check_mixer("narrow", checks=["contract"])
    registered("unkeyed", Unkeyed)
    with pytest.raises(AssertionError, match="unkeyed: its forward from empty_state\\(2\\) failed: KeyError: 'conv'"):
        check_mixer("unkeyed", checks=["contract"])
    with pytest.raises(ValueError, match="replace=True replaces it"):
        register_mixer("narrow", Forgetful)
    register_mixer("narrow", Forgetful, replace=True)             # the class edited, registered again
    assert check_mixer("narrow", checks=["contract"]) == ["contract"]


def test_register_refuses_what_the_table_cannot_hold(registered):
    with pytest.raises(ValueError, match="already registered"):
        registered("softmax", Forgetful)
    with pytest.raises(ValueError, match="one of subquad's own"):
        registered("softmax", Forgetful, replace=True)
    with pytest.raises(ValueError, match="identifier"):
        registered("two words", Forgetful)
    with pytest.raises(ValueError, match="subclass of subquad.layers.base.Mixer"):
        registered("module", nn.Linear)
    with pytest.raises(ValueError, match="rollback must be one of"):
        registered("rewinding", Forgetful, rollback="rewind")
    with pytest.raises(ValueError, match="unknown check"):
        check_mixer("softmax", checks=["speed"])


def test_the_table_not_the_name_says_which_checks_apply(registered):
    """The same encoder layer under another name: declared encoder-only it passes what applies and skips the
    causal checks; undeclared, the battery runs them and they fail."""
    from subquad.layers import Linformer

    registered("encoder_a", Linformer, encoder_only=True)
    assert check_mixer("encoder_a") == ["contract", "bf16", "compile", "encoder"]
    registered("encoder_b", Linformer)
    with pytest.raises(ValueError, match="no decoding state"):
        check_mixer("encoder_b", checks=["decode"])


def test_a_language_model_refuses_an_encoder_only_mixer():
    from subquad.models import ModelConfig

    for over in ({"pattern": "mamba2,linformer"}, {"pattern": "linformer"}):
        with pytest.raises(ValueError, match=r"pattern '.*linformer'.*linformer is encoder-only.*causal mixers: "):
            ModelConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, **over)
    with pytest.raises(ValueError, match="parallel must be"):
        ModelConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, pattern="mamba2",
                    parallel={"mamba2": "linformer"})


def test_every_entry_declares_its_fields():
    for name, e in MIXERS.items():
        assert isinstance(e.attention, bool) and isinstance(e.encoder_only, bool), name
        assert e.heads in ("n_heads", "n_kv_heads", None) and isinstance(e.own_heads, bool), name
        assert isinstance(e.recall, dict) and e.about, name
        assert not (e.attention and e.encoder_only), f"{name}: attention is a language model's layer"
        assert (e.rollback == "truncate") == e.attention, f"{name}: attention truncates its cache, nothing else"
        assert e.encoder_only or e.rollback != "replay" or name in ("retention", "rglru"), \
            f"{name}: a fixed state kept per token (\"states\") unless it holds a position count (replayed)"
