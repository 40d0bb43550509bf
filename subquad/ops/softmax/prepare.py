"""What every softmax-attention form starts and ends with: the argument checks, a KV cache from
``initial_state``, the visibility mask, and the final cache. One module the forms import, so no form reaches
back into its dispatcher (``softmax/__init__.py``)."""

from __future__ import annotations

import torch

from subquad.ops.common.checks import check_bool, check_chunk_size, check_qkv, default_scale, describe
from subquad.ops.softmax.cache import KVCache


def visible_mask(T: int, L: int, *, causal: bool, window, q_start: int, k_start: int = 0, device=None):
    """(T, L) bool: query at absolute position q_start + t may see key at k_start + j."""
    qpos = torch.arange(q_start, q_start + T, device=device).unsqueeze(1)
    kpos = torch.arange(k_start, k_start + L, device=device).unsqueeze(0)
    m = torch.ones(T, L, dtype=torch.bool, device=device)
    if causal:
        m &= kpos <= qpos
    if window is not None:
        m &= (qpos - kpos) <= window
    return m


def check_flags(causal, output_final_state, return_lse):
    check_bool("causal", causal)
    check_bool("output_final_state", output_final_state)
    check_bool("return_lse", return_lse)


def check_common(q, k, v, causal, window, scale, chunk_size):
    check_qkv(q, k, v, same_length=causal)  # non-causal (cross) attention may have L != T keys
    if q.shape[1] < 1:
        raise ValueError(f"q must hold at least one token (T >= 1), got shape {tuple(q.shape)}")
    check_chunk_size(chunk_size)
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            raise ValueError(f"window must be a non-negative int or None, got {describe(window)}")
        if not causal:
            raise ValueError("window is a causal sliding window; it needs causal=True")
    return default_scale(scale, q.shape[-1])


def check_window(cache, window) -> None:
    """A window cache that dropped keys continues only under a window it holds: a wider one, or none, would
    attend over what is left as if it were everything - refused by name. The windows are compared first: a
    compiled decoding step (the same window) then guards on no count of tokens, which changes every step."""
    if cache.window is not None and (window is None or window > cache.window) and cache.seen > len(cache):
        raise ValueError(f"initial_state is a window={cache.window} cache that kept the last {len(cache)} of "
                         f"{cache.seen} keys, but window={window!r} attends to older ones it dropped: continue "
                         f"with window={cache.window} (or a smaller one)")


def as_cache(initial_state, q, v, window):
    """initial_state may be a KVCache or a pair (k (B, L, H, K), v (B, L, H, V))."""
    if initial_state is None:
        return None
    if isinstance(initial_state, KVCache):
        cache = initial_state
    elif isinstance(initial_state, (tuple, list)) and len(initial_state) == 2:
        if not all(isinstance(t, torch.Tensor) for t in initial_state):
            raise ValueError("initial_state must be a KVCache or a pair of tensors (k (B, L, H, K), v (B, L, H, V)), "
                             f"got a pair of {type(initial_state[0]).__name__} and {type(initial_state[1]).__name__}")
        try:
            cache = KVCache(*initial_state, window=window)
        except ValueError as e:
            raise ValueError(f"initial_state: {e}") from None
    else:
        raise ValueError(f"initial_state must be a KVCache or a pair (k, v), got {describe(initial_state)}")
    check_window(cache, window)
    ck, cv = cache.k, cache.v
    if ck.shape[0] != q.shape[0] or ck.shape[2:] != q.shape[2:] or cv.shape[2:] != v.shape[2:]:
        raise ValueError(f"initial_state's keys/values must be (B, L, H, K)/(B, L, H, V) matching q {tuple(q.shape)} "
                         f"and v {tuple(v.shape)}, got {tuple(ck.shape)} and {tuple(cv.shape)}")
    for name, t in (("keys", ck), ("values", cv)):
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"initial_state's {name} must have q's dtype and device ({q.dtype}, {q.device}), got "
                             f"({t.dtype}, {t.device})")
    return cache


def prepare(q, k, v, causal, window, scale, chunk_size, initial_state):
    """Checks; returns scale, the cache, keys and values including the cache, and the first query's position."""
    scale = check_common(q, k, v, causal, window, scale, chunk_size)
    if initial_state is not None and not causal:
        raise ValueError("initial_state (a KV cache) needs causal=True: a non-causal query sees future keys no cache holds")
    cache = as_cache(initial_state, q, v, window)
    if cache is None or len(cache) == 0:
        return scale, cache, k, v, (cache.seen if cache is not None else 0)
    return scale, cache, torch.cat([cache.k, k], 1), torch.cat([cache.v, v], 1), cache.seen


def finish(o, lse, cache, k, v, window, output_final_state, return_lse):
    state = None
    if output_final_state:
        if cache is None:
            state = KVCache(k, v, window=window)
        else:
            state = KVCache(torch.cat([cache.k, k], 1), torch.cat([cache.v, v], 1), window=window,
                            seen=cache.seen + k.shape[1])
    return (o, state, lse) if return_lse else (o, state)
