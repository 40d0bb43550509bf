"""A decoding state passed to a layer is read-only: reusing it (several samples from one prompt, beam
search, retrying a step, --load-state twice) gives the same answers, and its tensors do not change."""

import pytest
import torch

from subquad.layers import build_mixer
from subquad.layers.registry import causal_mixers
from subquad.ops import KVCache


def snapshot(state):
    if isinstance(state, KVCache):
        return (state.k.clone(), state.v.clone(), state.seen, len(state))
    return {n: t.clone() for n, t in state.items() if isinstance(t, torch.Tensor)} | {
        n: snapshot(t) for n, t in state.items() if isinstance(t, (dict, KVCache))}


def same(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[n], b[n]) for n in a)
    if isinstance(a, tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("name", sorted(causal_mixers()))
@torch.no_grad()
def test_a_state_reused_gives_the_same_answers_and_is_not_modified(name):
    torch.manual_seed(0)
    layer = build_mixer(name, 32, 2, **({"window": 4} if name == "swa" else {})).eval()
    g = torch.Generator().manual_seed(1)
    prompt, a, b = (torch.randn(2, n, 32, generator=g) for n in (7, 1, 3))
    _, state = layer(prompt)
    before = snapshot(state)
    ya, sa = layer(a, state)                       # one continuation ...
    yb, _ = layer(b, state)                        # ... another from the same state ...
    ya2, _ = layer(a, state)                       # ... and the first again
    yaa, _ = layer(a, sa)                          # a continuation of the continuation
    assert torch.equal(ya, ya2), f"{name}: reusing a state changed the answer"
    assert same(snapshot(state), before), f"{name}: the state passed in was modified"
    full, _ = layer(torch.cat([prompt, a, a], 1))
    torch.testing.assert_close(torch.cat([ya, yaa], 1), full[:, 7:], rtol=1e-4, atol=1e-5)
    full_b, _ = layer(torch.cat([prompt, b], 1))
    torch.testing.assert_close(yb, full_b[:, 7:], rtol=1e-4, atol=1e-5)


def test_kv_cache_forks_share_buffers_without_overwriting_each_other():
    k = torch.arange(6.0).view(1, 6, 1, 1)
    base = KVCache.empty(1, 1, 1, 1, capacity=16).append(k, k)
    f1, f2 = base.fork(), base.fork()
    f1.append(torch.full((1, 2, 1, 1), 10.0), torch.full((1, 2, 1, 1), 10.0))
    f2.append(torch.full((1, 1, 1, 1), 20.0), torch.full((1, 1, 1, 1), 20.0))   # not at the tail: moves
    assert f1.k.flatten().tolist() == [0, 1, 2, 3, 4, 5, 10, 10]
    assert f2.k.flatten().tolist() == [0, 1, 2, 3, 4, 5, 20]
    assert base.k.flatten().tolist() == [0, 1, 2, 3, 4, 5] and base.seen == 6
    assert f1._k is base._k and f2._k is not base._k        # the first fork appended in place: O(1)
