"""Row operations on decoding states: a batch joined from single sequences' states, then stepped, equals
each sequence stepped alone; rows taken back out continue as they would have alone; inputs never change."""

import pytest
import torch

from subquad.models import LanguageModel, ModelConfig
from subquad.models.rows import cat_states, num_rows, row_positions, select_rows, state_nbytes, with_capacity
from subquad.ops import KVCache

PATTERNS = ["mamba", "mamba2,softmax", "gla,swa,retention,softmax", "deltanet,mla", "linear"]


def tiny(pattern):
    torch.manual_seed(0)
    n = pattern.count(",") + 1
    cfg = ModelConfig(vocab_size=61, d_model=32, n_layers=max(n, 2) if n == 1 else n, n_heads=2, pattern=pattern,
                      context_length=128, mixer_options={"swa": {"window": 4}, "*": {"chunk_size": 8}})
    return LanguageModel(cfg).double().eval()


def snapshot(state):
    """Every tensor of a state, cloned (KV caches as their live keys and values)."""
    out = []
    for layer in state:
        for key, v in layer.items():
            out += [v.k.clone(), v.v.clone()] if isinstance(v, KVCache) else [v.clone()]
    return out


@pytest.mark.parametrize("pattern", PATTERNS)
@torch.no_grad()
def test_joined_states_step_as_each_alone_and_rows_come_back_out(pattern):
    model = tiny(pattern)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 61, (1, T), generator=g) for T in (5, 11, 1, 7)]
    singles = [model.prefill(p)[1] for p in prompts]
    before = [snapshot(s) for s in singles]
    tokens = torch.tensor([3, 14, 15, 9])
    alone = [model.step(tokens[i:i + 1], s) for i, s in enumerate(singles)]

    batch = cat_states([singles[0], cat_states(singles[1:3]), singles[3]])   # a state of two rows joins too
    assert num_rows(batch) == 4 and row_positions(batch).tolist() == [5, 11, 1, 7]
    logits, after = model.step(tokens, batch)
    for i in range(4):
        torch.testing.assert_close(logits[i:i + 1], alone[i][0], rtol=0, atol=1e-12)
    for s, snap in zip(singles, before):                   # the states passed in are untouched
        assert all(torch.equal(a, b) for a, b in zip(snapshot(s), snap))

    # rows 3 and 1 out of the stepped batch, stepped again: as each sequence continued alone
    sub = select_rows(after, [3, 1])
    assert row_positions(sub).tolist() == [8, 12]
    nxt = torch.tensor([7, 2])
    got, _ = model.step(nxt, sub)
    for j, i in enumerate((3, 1)):
        want, _ = model.step(nxt[j:j + 1], alone[i][1])
        torch.testing.assert_close(got[j:j + 1], want, rtol=0, atol=1e-12)
    one = select_rows(after, [2])                           # a single row is a plain one-sequence state
    assert isinstance(one.pos, int) and one.pos == 2
    assert state_nbytes(one) > 0


def test_select_rows_drops_padding_no_row_needs():
    model = tiny("softmax")
    with torch.no_grad():
        states = [model.prefill(torch.zeros(1, T, dtype=torch.long))[1] for T in (2, 9, 3)]
    batch = cat_states(states)
    assert batch[0]["kv"].k.shape[1] == 9 and batch[0]["kv"].pad.tolist() == [7, 0, 6]
    short = select_rows(batch, [0, 2])
    assert short[0]["kv"].k.shape[1] == 3 and short[0]["kv"].pad.tolist() == [1, 0]


def test_bad_rows_are_refused():
    model = tiny("linear")
    with torch.no_grad():
        s = model.prefill(torch.zeros(1, 3, dtype=torch.long))[1]
    with pytest.raises(ValueError, match="rows"):
        select_rows(s, [1])
    with pytest.raises(ValueError, match="rows"):
        select_rows(s, [])
    with pytest.raises(ValueError, match="at least one"):
        cat_states([])
    with pytest.raises(ValueError, match="layers"):
        cat_states([s, tiny("mamba2,softmax").empty_state(1)[:1]])


@torch.no_grad()
def test_with_capacity_sizes_kv_buffers_once_and_changes_nothing_else():
    """After ``with_capacity(state, n)`` appends up to n tokens write in place (the buffers neither move nor
    grow), the steps equal those of the state as it was, the state passed in is untouched, and a fixed-size
    tensor that is a view of a larger buffer is copied out."""
    model = tiny("mamba2,softmax")
    g = torch.Generator().manual_seed(2)
    batch = cat_states([model.prefill(torch.randint(0, 61, (1, T), generator=g))[1] for T in (4, 9)])
    before = snapshot(batch)
    sized = with_capacity(batch, 9 + 6)
    kv = sized[1]["kv"]
    buffer, capacity = kv.k.untyped_storage().data_ptr(), kv.k.untyped_storage().nbytes()
    plain = batch
    for t in range(6):
        tokens = torch.tensor([t, 2 * t])
        want, plain = model.step(tokens, plain)
        got, sized = model.step(tokens, sized)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        storage = sized[1]["kv"].k.untyped_storage()
        assert (storage.data_ptr(), storage.nbytes()) == (buffer, capacity)
    assert capacity == 2 * 15 * kv.k.shape[2] * kv.k.shape[3] * 8      # 2 rows x 15 tokens x H x K, float64
    assert all(torch.equal(a, b) for a, b in zip(snapshot(batch), before))
    assert state_nbytes(sized) == state_nbytes(with_capacity(sized, 15))          # room already: no new buffer
    conv = sized[0]["conv"]                                  # a step's convolution tail: a view of a larger input
    own = with_capacity(sized, 15)[0]["conv"]
    assert conv.untyped_storage().nbytes() > conv.nelement() * conv.element_size()
    assert own.untyped_storage().nbytes() == own.nelement() * own.element_size() and torch.equal(own, conv)
    with pytest.raises(ValueError, match="capacity"):
        KVCache.empty(1, 1, 2, 2).reserve(-1)


@torch.no_grad()
def test_a_float64_model_decodes_from_its_own_empty_state():
    """The ops refuse a state of another dtype than state_dtype(inputs) (issue 32): the model's empty state
    follows its dtype, so a float64 model starts from float64 states, not float32 ones."""
    model = tiny("mamba,mamba2,gla,deltanet,linear,softmax")
    idx = torch.randint(0, 61, (2, 6), generator=torch.Generator().manual_seed(0))
    state = model.empty_state(2)
    assert all(t.dtype == torch.float64 for t in snapshot(state))
    torch.testing.assert_close(model.prefill(idx, state)[0], model.prefill(idx)[0], rtol=0, atol=0)


@pytest.mark.parametrize("pattern", ["mamba2,softmax", "deltanet,mla", "gla,swa,retention,softmax"])
@torch.no_grad()
def test_joins_and_leaves_with_capacity_copy_once_and_step_as_sized_after(pattern):
    """``cat_states(.., capacity)`` and ``select_rows(.., capacity)`` - what a server does when a row joins or
    leaves - give the states ``with_capacity`` gives after the plain call (same steps, to 1e-12), with buffers of
    exactly that room that the next steps append into in place; rows picked out of order, a batch whose rows
    rolled back by different counts (padding inside), and a window (re-stacked) included."""
    model = tiny(pattern)
    g = torch.Generator().manual_seed(3)
    singles = [model.prefill(torch.randint(0, 61, (1, T), generator=g))[1] for T in (6, 2, 9)]
    cap = 20
    batch = model.step(torch.tensor([1, 2, 3]), cat_states(singles))[1]
    if "swa" not in pattern:                               # rows that kept different counts of 3 tokens
        for layer in batch:
            for key, v in layer.items():
                if isinstance(v, KVCache):
                    layer[key] = v.rollback_rows([0, 1, 0])
        batch.pos = batch.pos - torch.tensor([0, 1, 0])
    cases = [(cat_states([batch, singles[1]], cap), with_capacity(cat_states([batch, singles[1]]), cap)),
             (select_rows(batch, [2, 0], cap), with_capacity(select_rows(batch, [2, 0]), cap)),
             (select_rows(batch, [1], cap), with_capacity(select_rows(batch, [1]), cap))]
    for got, want in cases:
        assert row_positions(got).tolist() == row_positions(want).tolist()
        kv = [v for layer in got for v in layer.values() if isinstance(v, KVCache) and v.window is None]
        for v in kv:
            assert v.k.untyped_storage().nbytes() == v.k.shape[0] * cap * v.k.shape[2] * v.k.shape[3] * 8
        ptrs = [v.k.untyped_storage().data_ptr() for v in kv]
        for t in range(4):
            tokens = torch.arange(t, t + num_rows(got)) % 61
            a, got = model.step(tokens, got)
            b, want = model.step(tokens, want)
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
        kv = [v for layer in got for v in layer.values() if isinstance(v, KVCache) and v.window is None]
        assert [v.k.untyped_storage().data_ptr() for v in kv] == ptrs    # appended in place
