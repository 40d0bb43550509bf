"""Softmax attention's one-token decoding route (``SoftmaxAttention._one_token``: SDPA over the appended cache,
grouped heads through ``enable_gqa``) against the op's route (``seq.attention`` with the cache repeated per query
head), in float64: grouped and plain heads, partial rotary, q/k norms, the output gate, a scale; a cache that
grows over steps and one reused for two continuations; a ragged batch's cache (its padding masked); where the
route does not apply, the op runs."""

from __future__ import annotations

import pytest
import torch

from subquad.layers import attention
from subquad.layers.attention import SoftmaxAttention

pytestmark = pytest.mark.skipif(not attention.GQA_SDPA, reason="SDPA's enable_gqa needs torch >= 2.5")


def _layer(**kw):
    torch.manual_seed(0)
    return SoftmaxAttention(**{"d_model": 48, "n_heads": 6, **kw}).double().eval()


def _steps(layer, x, state, monkeypatch, fast: bool):
    """The layer over x (B, T, d) one token at a time from ``state`` -> (outputs (B, T, d), final state, calls of
    the one-token route)."""
    calls = []
    real = SoftmaxAttention._one_token
    monkeypatch.setattr(SoftmaxAttention, "_one_token",
                        lambda self, *a: (real(self, *a) and fast) and (calls.append(1) or True))
    outs = []
    with torch.no_grad():
        for t in range(x.shape[1]):
            y, state = layer(x[:, t:t + 1], state)
            outs.append(y)
    monkeypatch.undo()
    return torch.cat(outs, 1), state, len(calls)


@pytest.mark.parametrize("kw", [
    {"n_kv_heads": 2},                                            # 3 query heads per key head
    {"n_kv_heads": 6},                                            # no grouping
    {"n_kv_heads": 3, "rotary_fraction": 0.5, "qk_norm": "head"},
    {"n_kv_heads": 2, "output_gate": True, "scale": 0.3},
])
def test_one_token_equals_the_ops_route(monkeypatch, kw):
    layer = _layer(**kw)
    g = torch.Generator().manual_seed(1)
    prompt, x = torch.randn(2, 7, 48, generator=g, dtype=torch.float64), torch.randn(2, 9, 48, generator=g,
                                                                                     dtype=torch.float64)
    with torch.no_grad():
        _, state = layer(prompt, None)
    want, s_want, n0 = _steps(layer, x, state, monkeypatch, fast=False)
    got, s_got, n = _steps(layer, x, state, monkeypatch, fast=True)
    assert n0 == 0 and n == 9                                     # every step took the route
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(s_got["kv"].k, s_want["kv"].k, rtol=0, atol=0)
    again, _, _ = _steps(layer, x, state, monkeypatch, fast=True)   # the state reused: the same answers
    torch.testing.assert_close(again, want, rtol=1e-10, atol=1e-12)
    with torch.no_grad():                                         # and the whole sequence at once agrees
        full, _ = layer(torch.cat([prompt, x], 1), None)
    torch.testing.assert_close(got, full[:, 7:], rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("kw", [{"n_kv_heads": 2}, {"n_kv_heads": 3, "rotary_fraction": 0.5, "scale": 0.3}])
def test_a_ragged_cache_takes_it_with_its_padding_masked(monkeypatch, kw):
    """Prompts of 3, 8 and 5 tokens prefilled packed (a left-padded ragged cache, each row at its own position),
    then 6 tokens a row: the route at every step, equal to the op's and to each row's whole sequence alone."""
    layer = _layer(**kw)
    g = torch.Generator().manual_seed(3)
    lengths = [3, 8, 5]
    prompts = [torch.randn(1, n, 48, generator=g, dtype=torch.float64) for n in lengths]
    x = torch.randn(3, 6, 48, generator=g, dtype=torch.float64)
    with torch.no_grad():
        _, state = layer(torch.cat(prompts, 1), None, cu_seqlens=torch.tensor([0, 3, 11, 16]))
    assert state["kv"].ragged
    want, _, n0 = _steps(layer, x, state, monkeypatch, fast=False)
    got, _, n = _steps(layer, x, state, monkeypatch, fast=True)
    assert n0 == 0 and n == 6
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    with torch.no_grad():
        for b, p in enumerate(prompts):
            full, _ = layer(torch.cat([p, x[b:b + 1]], 1), None)
            torch.testing.assert_close(got[b:b + 1], full[:, p.shape[1]:], rtol=1e-9, atol=1e-11)


def test_where_it_does_not_apply_the_op_runs(monkeypatch):
    """A window, a first token into an empty cache, a prompt of several tokens, gradients: the op."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 3, 48, generator=g, dtype=torch.float64)
    windowed = _layer(n_kv_heads=2, window=4)
    with torch.no_grad():
        _, state = windowed(torch.randn(1, 6, 48, generator=g, dtype=torch.float64), None)
    assert _steps(windowed, x, state, monkeypatch, fast=True)[2] == 0
    layer = _layer(n_kv_heads=2)
    ragged = layer.empty_state(2, dtype=torch.float64)["kv"].for_step()      # pad and row_seen: ragged, empty
    assert ragged.ragged
    assert _steps(layer, torch.randn(2, 1, 48, generator=g, dtype=torch.float64), {"kv": ragged}, monkeypatch,
                  fast=True)[2] == 0
    calls = []
    real = SoftmaxAttention._one_token
    monkeypatch.setattr(SoftmaxAttention, "_one_token", lambda self, *a: calls.append(real(self, *a)) or False)
    with torch.no_grad():
        _, state = layer(torch.randn(1, 5, 48, generator=g, dtype=torch.float64), None)
        layer(torch.randn(1, 2, 48, generator=g, dtype=torch.float64), state)   # two tokens
    layer(torch.randn(1, 1, 48, generator=g, dtype=torch.float64), state)      # gradients on
    assert calls == [False, False, False]
