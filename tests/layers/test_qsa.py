"""QSA (``layers.qsa``) over a ragged batch - rows at different positions, as packed prompts of different lengths
leave them and a server's batch holds them: all rows at once (``IndexedAttention._ragged``) against row by row
(``batch_ragged = False``: each row alone, ``_rows``), float64, on fresh random inputs."""

import pytest
import torch

from subquad.layers.qsa import IndexedAttention

F64 = torch.float64
D_MODEL = 32
LENGTHS = [1, 8, 17]        # odd: a row of one token, one of several blocks (c = 3), one between


def _layer(index_heads=8, **options):
    torch.manual_seed(0)
    return IndexedAttention(D_MODEL, n_heads=4, n_kv_heads=2, index_heads=index_heads, index_head_dim=8,
                            index_budget=6, index_block=3, rotary_fraction=0.5, qk_norm="head", output_gate=True,
                            **options).to(F64).eval()


def _snapshot(state):
    return {k: (c.k.clone(), c.v.clone(), c.seen, len(c), c.pad.clone(), c.row_seen.clone()) for k, c in state.items()}


def _same(a, b) -> bool:
    return all(all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a[k], b[k])) for k in a)


def _run(layer, x, state, batched: bool):
    """The layer's output and state from ``state``, all rows at once or row by row; ``state`` left as it was."""
    before = _snapshot(state)
    layer.batch_ragged = batched
    try:
        y, new = layer(x, state)
    finally:
        layer.batch_ragged = True
    assert _same(_snapshot(state), before), "a state passed in was modified"
    return y, new


def _assert_same(layer, x, state):
    """All rows at once equal row by row: outputs, and the caches they leave. Returns the batched state."""
    want, s_want = _run(layer, x, state, False)
    got, s_got = _run(layer, x, state, True)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    for key in ("kv", "ik"):
        a, b = s_got[key], s_want[key]
        assert a.ragged and torch.equal(a.pad, b.pad) and torch.equal(a.row_seen, b.row_seen) and a.seen == b.seen
        torch.testing.assert_close(a.k, b.k, rtol=0, atol=1e-12)
        torch.testing.assert_close(a.v, b.v, rtol=0, atol=1e-12)
    return s_got


def _ragged_state(layer, g, lengths=LENGTHS):
    cu = torch.tensor([0] + lengths).cumsum(0)
    with torch.no_grad():
        _, state = layer(torch.randn(1, sum(lengths), D_MODEL, generator=g, dtype=F64), cu_seqlens=cu)
    assert state["kv"].ragged and state["kv"].pad.tolist() == [max(lengths) - n for n in lengths]
    return state


@pytest.mark.parametrize("gather_one", [True, False])
def test_a_ragged_batch_at_once_equals_row_by_row(gather_one):
    """Decoding steps (the gathered keys of one token, or the dense mask) from rows of 1, 8 and 17 tokens, past
    the budget of 2 blocks; then a verification of 4 tokens (speculative decoding: T > 1 on a ragged cache), a
    different count kept per row (``KVCache.rollback_rows``, as ``models.speculative`` does) and steps again."""
    layer = _layer()
    layer.gather_one = gather_one
    g = torch.Generator().manual_seed(1)
    state = _ragged_state(layer, g)
    B = len(LENGTHS)
    with torch.no_grad():
        for _ in range(5):
            state = _assert_same(layer, torch.randn(B, 1, D_MODEL, generator=g, dtype=F64), state)
        after = _assert_same(layer, torch.randn(B, 4, D_MODEL, generator=g, dtype=F64), state)
        state = {k: c.rollback_rows([4 - keep for keep in (1, 4, 0)]) for k, c in after.items()}
        for _ in range(3):
            state = _assert_same(layer, torch.randn(B, 1, D_MODEL, generator=g, dtype=F64), state)


def test_a_row_with_no_history_and_a_batch_of_equal_rows():
    """A row that joins with nothing cached (all padding: a server's batch, ``KVCache.stack``), and a batch whose
    rows are all at one position (``KVCache.for_step`` makes it ragged with no padding, as a compiled step does)."""
    from subquad.ops import KVCache

    layer = _layer()
    g = torch.Generator().manual_seed(2)
    state = _ragged_state(layer, g, [4, 9])
    empty = layer.empty_state(1, dtype=F64)
    joined = {k: KVCache.stack(state[k].unstack() + [empty[k]]) for k in state}
    with torch.no_grad():
        s = joined
        for _ in range(3):
            s = _assert_same(layer, torch.randn(3, 1, D_MODEL, generator=g, dtype=F64), s)
        _, even = layer(torch.randn(2, 7, D_MODEL, generator=g, dtype=F64))
        even = {k: c.for_step() for k, c in even.items()}
        assert even["kv"].ragged and not even["kv"].pad.any()
        _assert_same(layer, torch.randn(2, 1, D_MODEL, generator=g, dtype=F64), even)


def test_ties_among_block_scores_still_pick_a_top_set():
    """One index head: half of the block scores are relu's zeros, so ties at the budget's edge are common. A row
    with no padding (the longest) still equals the reference (the same ``topk`` call at one token); every
    query's blocks are a top min(budget / c, n) of its own n complete blocks' scores, computed row by row."""
    layer = _layer(index_heads=1)
    c, budget = layer.index_block, layer.index_budget // layer.index_block
    g = torch.Generator().manual_seed(3)
    state = _ragged_state(layer, g)
    ties = 0
    with torch.no_grad():
        for _ in range(6):
            x = torch.randn(len(LENGTHS), 1, D_MODEL, generator=g, dtype=F64)
            want, _ = _run(layer, x, state, False)
            got, new = _run(layer, x, state, True)
            torch.testing.assert_close(got[-1], want[-1], rtol=0, atol=1e-12)       # the longest row
            # the batched selection, and each row's scores alone (its own tokens, its own positions)
            iq, ik = _index_projections(layer, x)
            kv, icache = state["kv"], state["ik"]
            Lc = kv.k.shape[1]
            first = kv.pad
            pos = (Lc - first)[:, None]
            iq = layer._rotate(iq, pos)
            ik_all = torch.cat([icache.k[:, :, 0], ik], 1)
            S = ik_all.shape[1]
            nb = S // c
            at = (first[:, None] + torch.arange(nb * c)).clamp(max=S - 1)
            top, n = layer._own_blocks(iq, ik_all.gather(1, at[..., None].expand(-1, -1, ik_all.shape[2])), pos)
            for b in range(len(LENGTHS)):
                nb_b = int(n[b, 0])
                s = layer.block_scores(iq[b:b + 1], ik_all[b:b + 1, int(first[b]):])[0, 0]     # (nb_b,)
                assert s.shape == (nb_b,)
                k = min(budget, nb_b)
                picked = top[b, 0][top[b, 0] < nb_b]
                assert len(picked) == k and len(set(picked.tolist())) == k
                rest = torch.ones(nb_b, dtype=torch.bool)
                rest[picked] = False
                if rest.any():
                    assert s[picked].min() >= s[rest].max()
                    ties += int(s[picked].min() == s[rest].max())
            state = new
    assert ties, "no tie at the budget's edge: the case this test is for did not occur"


def _index_projections(layer, x):
    """The indexer's queries (normed, unrotated) and raw keys of x, as ``mix`` makes them."""
    B, T, _ = x.shape
    Hi, D = layer.index_heads, layer.index_head_dim
    iq, ik = layer.index_qk_proj(x).split([Hi * D, D], -1)
    return layer.index_q_norm(iq.reshape(B, T, Hi, D)), ik


def test_the_batched_step_traces_as_one_graph():
    """No graph break (no row loop, no read of a tensor's value), as ``compile_decode``'s one graph needs (its
    whole-model check: tests/models/test_decode.py, test_indexed_attention_decodes_in_one_graph): the layer
    captured whole (dynamo, the eager backend: no inductor build) equals eager as the cache grows."""
    layer = _layer()
    g = torch.Generator().manual_seed(4)
    state = {k: c.for_step() for k, c in _ragged_state(layer, g).items()}
    compiled = torch.compile(layer, fullgraph=True, backend="eager", dynamic=True)
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(len(LENGTHS), 1, D_MODEL, generator=g, dtype=F64)
            want, s_want = layer(x, state)
            got, _ = compiled(x, state)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
            state = {k: c.for_step() for k, c in s_want.items()}


def test_the_index_head_dim_holds_the_rotating_dims_by_default():
    """Without index_head_dim: 16, or the rotating dims where there are more - the pattern "qsa" at micro's shape
    (heads of 32) builds and passes the layer's decoding battery; an index_head_dim given too small is refused."""
    from subquad.layers.qsa import IndexedAttention
    from subquad.models import LanguageModel, ModelConfig

    assert IndexedAttention(16, n_heads=2).index_head_dim == 16
    assert IndexedAttention(128, n_heads=4).index_head_dim == 32
    assert IndexedAttention(128, n_heads=4, rotary_fraction=0.25).index_head_dim == 16
    with pytest.raises(ValueError, match="index_head_dim=16 must hold the 32 rotating dims"):
        IndexedAttention(128, n_heads=4, index_head_dim=16)
    torch.manual_seed(0)
    model = LanguageModel(ModelConfig(vocab_size=64, d_model=128, n_heads=4, n_layers=1, pattern="qsa")).double()
    x = torch.randint(0, 64, (2, 23))
    with torch.no_grad():
        full = model(x)
        logits, state = model.prefill(x[:, :20])
        steps = [logits[:, -1]]
        for t in range(20, 23):                   # past the budget (4 blocks of 4): the selection matters
            logits, state = model.step(x[:, t], state)
            steps.append(logits)
    torch.testing.assert_close(torch.stack(steps, 1), full[:, 19:], rtol=1e-10, atol=1e-10)
