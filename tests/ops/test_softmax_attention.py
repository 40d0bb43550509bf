import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from subquad.ops import KVCache, merge_attention, naive_softmax_attention, softmax_attention
from tests.ops.harness import assert_close, check_forms_agree, check_grads_agree, check_split, flat

F64 = torch.float64


def make(B, T, H=2, K=5, V=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, K, generator=g, dtype=F64) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=g, dtype=F64)
    return {"q": q.requires_grad_(), "k": k.requires_grad_(), "v": v.requires_grad_()}


def caller(window=None, causal=True):
    def call(mode, x, chunk_size, initial_state, out):
        fn = naive_softmax_attention if mode == "naive" else softmax_attention
        kw = {} if mode == "naive" else {"mode": mode}
        return fn(x["q"], x["k"], x["v"], causal=causal, window=window, chunk_size=chunk_size,
                  initial_state=initial_state, output_final_state=out, **kw)
    return call


def cache0(inputs, L=9, seed=3, window=None):
    x = make(inputs["q"].shape[0], L, inputs["q"].shape[2], inputs["q"].shape[3], inputs["v"].shape[3], seed)
    return KVCache(x["k"], x["v"], window=window)


@pytest.mark.parametrize("window", [None, 0, 5, 40])
@pytest.mark.parametrize("T", [1, 7, 64, 100])
def test_forms_agree_with_naive(T, window):
    x = make(2, T, seed=T)
    for C in (16, 64):
        check_forms_agree(caller(window), x, C, ref="naive", modes=("parallel", "recurrent", "chunk"))
        check_forms_agree(caller(window), x, C, initial_state=cache0(x, window=window), ref="naive",
                          modes=("parallel", "recurrent", "chunk"))


@given(B=st.integers(1, 2), T=st.integers(1, 70), K=st.integers(1, 8), V=st.integers(1, 8),
       C=st.integers(1, 33), window=st.one_of(st.none(), st.integers(0, 30)), seed=st.integers(0, 2**16))
def test_forms_agree_property(B, T, K, V, C, window, seed):
    x = make(B, T, 2, K, V, seed=seed)
    check_forms_agree(caller(window), x, C, ref="naive", modes=("parallel", "recurrent", "chunk"))


def test_non_causal_parallel_and_chunk():
    x = make(2, 37, seed=1)
    check_forms_agree(caller(causal=False), x, 8, ref="naive", modes=("parallel", "chunk"))


@pytest.mark.parametrize("mode", ["parallel", "recurrent", "chunk"])
@pytest.mark.parametrize("window", [None, 6])
def test_split_sequence_equals_one_call(mode, window):
    x = make(2, 45, seed=2)
    check_split(caller(window), x, 17, chunk_size=8, mode=mode, seq_keys=("q", "k", "v"))


@pytest.mark.parametrize("window", [None, 4])
def test_gradients_agree(window):
    x = make(2, 29, seed=5)
    check_grads_agree(caller(window), x, 8, None, ref="naive", modes=("parallel", "recurrent", "chunk"))


def test_lse_merges_key_blocks_exactly():
    # Attention of the queries over keys [0, 20) and [20, 50) separately, merged, equals the whole.
    x = {n: t.detach() for n, t in make(2, 50, seed=7).items()}
    q, k, v = x["q"], x["k"], x["v"]
    o_full, _, lse_full = softmax_attention(q, k, v, causal=False, return_lse=True)
    o1, _, l1 = softmax_attention(q, k[:, :20], v[:, :20], causal=False, return_lse=True, chunk_size=7)
    # The second key block is longer than the first: the block helper takes any key length.
    from subquad.ops.softmax import blockwise_softmax_attention
    o2, l2 = blockwise_softmax_attention(q, k[:, 20:], v[:, 20:], scale=5 ** -0.5, chunk_size=7,
                                         causal=False, window=None, q_start=0, k_start=20)
    o, lse = merge_attention(o1, l1, o2, l2)
    assert_close(o, o_full, 1e-12, "merged o")
    assert_close(lse, lse_full, 1e-12, "merged lse")
    ref_lse = torch.logsumexp(torch.einsum("bthk,bshk->bhts", q, k) * 5 ** -0.5, -1).transpose(1, 2)
    assert_close(lse_full, ref_lse, 1e-12, "lse")


def test_lse_gradient_flows():
    x = make(1, 21, seed=4)
    _, _, lse = softmax_attention(x["q"], x["k"], x["v"], return_lse=True, chunk_size=4)
    g_chunk = torch.autograd.grad(lse.sum(), (x["q"], x["k"]))
    s = torch.einsum("bthk,bshk->bhts", x["q"], x["k"]) * 5 ** -0.5
    s = s.masked_fill(~torch.ones(21, 21, dtype=torch.bool).tril(), float("-inf"))
    g_ref = torch.autograd.grad(torch.logsumexp(s, -1).sum(), (x["q"], x["k"]))
    for a, b in zip(g_chunk, g_ref):
        assert_close(a, b, 1e-10, "dlse")


def test_window_cache_is_bounded():
    x = {n: t.detach() for n, t in make(1, 100, seed=1).items()}
    for mode in ("parallel", "recurrent", "chunk"):
        _, cache = softmax_attention(x["q"], x["k"], x["v"], window=16, mode=mode, output_final_state=True)
        assert cache.k.shape[1] == 16 and cache.seen == 100
        assert cache.nbytes <= 2 * 32 * 2 * (5 + 3) * 8  # bounded by the window, not by T
        assert torch.equal(cache.k, x["k"][:, -16:])


@pytest.mark.parametrize("mode", ["parallel", "recurrent", "chunk"])
def test_a_window_cache_that_dropped_keys_refuses_a_wider_window_and_continues_a_narrower_one(mode):
    """A window=4 cache of 10 tokens holds the last 4 keys: continuing it with no window or window=8 would attend
    over what is left as if it were everything - refused by name; window 4 or 2 sees only keys it holds and equals
    one call over the whole sequence (float64) - in the recurrent form too, which once attended over the cache's
    own window. A cache that dropped nothing continues with any window, one without a window with window 3."""
    x = {n: t.detach() for n, t in make(1, 13, seed=3).items()}
    a, b = ({n: t[:, s] for n, t in x.items()} for s in (slice(0, 10), slice(10, 13)))
    _, cache = softmax_attention(a["q"], a["k"], a["v"], window=4, mode=mode, output_final_state=True)
    for window in (None, 8):
        with pytest.raises(ValueError, match=r"window=4 cache that kept the last 4 of 10 keys.*window=" + str(window)):
            softmax_attention(b["q"], b["k"], b["v"], window=window, mode=mode, initial_state=cache)
    for window in (4, 2):
        got, _ = softmax_attention(b["q"], b["k"], b["v"], window=window, mode=mode, initial_state=cache)
        want = naive_softmax_attention(x["q"], x["k"], x["v"], window=window)[0][:, 10:]
        assert_close(got, want, 1e-10, f"window {window} after a window-4 cache")
    _, short = softmax_attention(a["q"][:, :3], a["k"][:, :3], a["v"][:, :3], window=4, mode=mode,
                                 output_final_state=True)
    got, _ = softmax_attention(b["q"], b["k"], b["v"], mode=mode, initial_state=short)
    want = naive_softmax_attention(*(torch.cat([a[n][:, :3], b[n]], 1) for n in "qkv"))[0][:, 3:]
    assert_close(got, want, 1e-10, "no window after a cache that dropped nothing")
    _, whole = softmax_attention(a["q"], a["k"], a["v"], mode=mode, output_final_state=True)
    got, _ = softmax_attention(b["q"], b["k"], b["v"], window=3, mode=mode, initial_state=whole)
    assert_close(got, naive_softmax_attention(x["q"], x["k"], x["v"], window=3)[0][:, 10:], 1e-10,
                 "window 3 after a cache without one")


def test_float32_long_sequence_chunk_matches_sdpa():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4096, 2, 32, generator=g) for _ in range(3))
    o_c, _ = softmax_attention(q, k, v, mode="chunk", chunk_size=256)
    o_p, _ = softmax_attention(q, k, v, mode="parallel")
    assert_close(o_c, o_p, 1e-4, "float32 T=4096 chunk vs sdpa")


@pytest.mark.parametrize("T,padded", [(64, False), (1024, True)])
def test_bf16_unequal_head_dims_take_the_flash_kernel_only_for_long_inputs(T, padded, monkeypatch):
    # K != V: SDPA's CPU flash kernel needs them equal. In 16 bits the value dim is padded (flash) only from
    # FLASH_16BIT score entries on; shorter inputs keep the math path's float32 softmax. Either way the
    # output equals a float64 softmax attention on the same bf16 numbers to bf16's rounding.
    import torch.nn.functional as F

    from subquad.ops.softmax import parallel

    seen = []
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(parallel.F, "scaled_dot_product_attention",
                        lambda q, k, v, **kw: seen.append(v.shape[-1]) or real(q, k, v, **kw))
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, T, 2, 16, generator=g).bfloat16() for _ in range(2))
    v = torch.randn(1, T, 2, 8, generator=g).bfloat16()
    o, _ = softmax_attention(q, k, v, mode="parallel")
    ref, _ = naive_softmax_attention(q.double(), k.double(), v.double())
    assert seen == [16 if padded else 8]
    assert o.dtype == torch.bfloat16 and (o.double() - ref).abs().max() < 0.03


def test_bad_arguments_raise():
    x = {n: t.detach() for n, t in make(1, 8).items()}
    q, k, v = x["q"], x["k"], x["v"]
    with pytest.raises(ValueError, match="mode"):
        softmax_attention(q, k, v, mode="flash")
    with pytest.raises(ValueError, match="chunk_size"):
        softmax_attention(q, k, v, chunk_size=0)
    with pytest.raises(ValueError, match="window"):
        softmax_attention(q, k, v, window=-1)
    with pytest.raises(ValueError, match="causal"):
        softmax_attention(q, k, v, window=3, causal=False)
    with pytest.raises(ValueError, match="causal"):
        softmax_attention(q, k, v, causal=False, mode="recurrent")
    with pytest.raises(ValueError, match="initial_state"):
        softmax_attention(q, k, v, causal=False, initial_state=(k, v))
    with pytest.raises(ValueError, match="initial_state"):
        softmax_attention(q, k, v, initial_state=(k[..., :2], v))
    with pytest.raises(ValueError, match="return_lse"):
        softmax_attention(q, k, v, mode="parallel", return_lse=True)
    with pytest.raises(ValueError, match="dtype"):
        softmax_attention(q, k.float(), v)
    assert flat(None) == []


@pytest.mark.parametrize("window", [None, 1, 7])
def test_kv_cache_appends_keep_every_token_and_windows_stay_bounded(window):
    B, H, K = 2, 3, 4
    cache = KVCache.empty(B, H, K, K, dtype=F64, window=window)
    ks = torch.randn(B, 60, H, K, dtype=F64)
    pos = 0
    for t in (1, 3, 9, 1, 20, 2, 1, 1, 5, 17):
        cache.append(ks[:, pos:pos + t], -ks[:, pos:pos + t])
        pos += t
        want = ks[:, :pos] if window is None else ks[:, max(0, pos - window):pos]
        assert torch.equal(cache.k, want) and torch.equal(cache.v, -want) and cache.seen == pos
        if window is not None:
            assert cache.nbytes == 2 * (2 * window) * B * H * K * 8


@pytest.mark.parametrize("window", [None, 1, 7])
@pytest.mark.parametrize("B", [1, 3])
def test_for_step_gives_room_in_place_and_leaves_the_cache_as_it_was(window, B):
    """KVCache.for_step (the compiled step's cache): a fork with room for t tokens past its live entries (a
    window's start past column 0), ragged with no padding at >= 2 rows; appending to it never reallocates,
    keeps every token and position, and the cache it came from is unchanged."""
    H, K = 2, 3
    ks = torch.randn(B, 40, H, K, dtype=F64)
    cache = KVCache(ks[:, :11].clone(), -ks[:, :11].clone(), window=window)     # full: as a prefill leaves it
    before = (cache.k.clone(), cache.v.clone(), cache.seen, cache.pad)
    pos = 11
    for t in (1, 1, 2, 1, 9, 1):
        ready = cache.for_step(t)
        assert ready.pad is None if B == 1 else (torch.equal(ready.pad, torch.zeros(B, dtype=torch.long))
                                                 and torch.equal(ready.row_seen, torch.full((B,), pos)))
        if window is None or t < window:        # (a block that fills a window alone takes fresh buffers)
            assert ready._start + len(ready) + t < ready._k.shape[1] + (window is not None)
            assert window is None or ready._start > 0
        buf = ready._k
        ready.append(ks[:, pos:pos + t], -ks[:, pos:pos + t])
        if window is None or t < window:
            assert ready._k is buf                                  # in place: no reallocation
        pos += t
        want = ks[:, :pos] if window is None else ks[:, max(0, pos - window):pos]
        assert torch.equal(ready.k, want) and torch.equal(ready.v, -want) and ready.seen == pos
        if window is not None:
            assert ready._k.shape[1] <= 2 * window + 1                # still bounded
        cache = ready
    first = KVCache(ks[:, :11].clone(), -ks[:, :11].clone(), window=window)
    first.for_step(1).append(ks[:, 11:12], ks[:, 11:12])
    assert torch.equal(first.k, before[0]) and torch.equal(first.v, before[1]) and first.seen == before[2]
