"""Memory accounting: a softmax KV cache against a linear-attention state, per layer and head.

    KV cache      2 T d numbers      (keys and values of every token so far)
    linear state  d d + d numbers    (S, and the normaliser z)

Alongside the formula, ``measure`` runs the ops and reads the bytes of the
tensors they actually keep (``KVCache.nbytes``; ``S.nbytes + z.nbytes``).
The ops keep recurrent state in float32 for 16-bit inputs, so at
``--dtype float16`` the measured state is twice the analytic figure.
"""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}
DEFAULT_CONTEXTS = [1024, 4096, 16384, 65536, 131072, 262144, 1048576]


def dtype_of(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


def analytic(contexts, head_dim: int, dtype: str = "float32") -> list[dict]:
    """Numbers and bytes per layer and head at each context length."""
    size = torch.finfo(dtype_of(dtype)).bits // 8
    rows = []
    for T in contexts:
        kv, st = 2 * T * head_dim, head_dim * head_dim + head_dim
        rows.append({"context": T, "kv_numbers": kv, "state_numbers": st, "kv_bytes": kv * size,
                     "state_bytes": st * size, "ratio": kv / st})
    return rows


def flops(contexts, head_dim: int) -> list[dict]:
    """Operation counts of the attention product: softmax N^2 d against linear N d^2."""
    return [{"context": N, "softmax_flops": N * N * head_dim, "linear_flops": N * head_dim * head_dim,
             "ratio": N / head_dim} for N in contexts]


def measured_contexts(contexts, measure_max: int) -> list[int]:
    """The contexts ``subquad memory`` measures: those up to ``measure_max``, else the shortest one alone (the
    measured table is never empty, so it may hold one context past ``measure_max``)."""
    return [T for T in contexts if T <= measure_max] or [min(contexts)]


def measured_title(rows: list[dict]) -> str:
    """The measured table's header, from the contexts in its rows (not from the limit asked for)."""
    Ts = sorted(r["context"] for r in rows)
    span = f"T = {Ts[0]:,}" if len(Ts) == 1 else f"T = {Ts[0]:,} to {Ts[-1]:,}"
    return f"Measured from the tensors the ops keep (B=1, one head), {span}:"


@torch.no_grad()
def measure(contexts, head_dim: int, dtype: str = "float32") -> list[dict]:
    """Bytes the ops actually keep after T tokens, for one head (B=1, H=1)."""
    from subquad.ops import feature_map, linear_attention, softmax_attention

    torch_dtype = dtype_of(dtype)
    g = torch.Generator().manual_seed(0)
    phi = feature_map("elu+1")
    rows = []
    for T in contexts:
        q, k, v = (torch.randn(1, T, 1, head_dim, generator=g, device=g.device).to(torch_dtype) for _ in range(3))
        _, cache = softmax_attention(q, k, v, mode="parallel", output_final_state=True)
        _, (S, z) = linear_attention(phi(q), phi(k), v, mode="chunk", output_final_state=True)
        rows.append({"context": T, "kv_cache_bytes": cache.nbytes, "state_bytes": S.nbytes + z.nbytes,
                     "state_dtype": str(S.dtype).replace("torch.", "")})
    return rows


PROBE = (8, 16)         # tokens each mixer reads before its state is measured: below swa's window, above a conv's


def check_mixers(names) -> None:
    """ValueError naming the names that are no mixer with a decoding state (``--mixers``)."""
    from subquad.layers import MIXERS

    unknown = [n for n in names if n not in MIXERS or MIXERS[n].encoder_only]
    if unknown:
        known = sorted(n for n in MIXERS if not MIXERS[n].encoder_only)
        raise ValueError(f"--mixers: no decoding state for {', '.join(unknown)}; known: {', '.join(known)}")


@torch.no_grad()
def mixer_states(names, contexts, d_model: int, n_heads: int, dtype: str = "float32") -> list[dict]:
    """Each mixer's decoding state per layer (B = 1) at each context, measured: the layer (``build_mixer`` at
    this width and head count) reads ``PROBE`` tokens and the bytes of the state it returns are read
    (``models.state.live_bytes``). A state that grows - a KV cache - grows by the same bytes every token, up to
    its window: bytes(T) = base + per_token * min(T, window), from the two probes; a fixed state is the same at
    both."""
    from subquad.layers import build_mixer
    from subquad.models.state import live_bytes
    from subquad.ops import KVCache

    torch_dtype = dtype_of(dtype)
    check_mixers(names)
    g = torch.Generator().manual_seed(0)
    rows = []
    for name in names:
        with torch.random.fork_rng(devices=[]):          # the caller's random state untouched
            torch.manual_seed(0)
            layer = build_mixer(name, d_model, n_heads).to(torch_dtype).eval()
        sizes, window = [], None
        for T in PROBE:
            x = torch.randn(1, T, d_model, generator=g).to(torch_dtype)
            _, state = layer(x, layer.empty_state(1, dtype=torch_dtype))
            sizes.append(live_bytes(state))
            windows = [t.window for t in state.values() if isinstance(t, KVCache) and t.window is not None]
            window = min(windows) if windows else None
        per_token = (sizes[1] - sizes[0]) // (PROBE[1] - PROBE[0])
        base = sizes[0] - per_token * PROBE[0]
        grows = "no" if per_token == 0 else f"up to {window:,} tokens" if window else "yes"
        rows.append({"mixer": name, "grows": grows, "per_token": per_token,
                     "bytes": {T: base + per_token * (T if window is None else min(T, window)) for T in contexts}})
    return rows
