"""Every threshold that picks a route or a work size inside the ops, in one place, with its reason.

No route changes a result beyond rounding: each is tested against the parallel form in float64
(tests/ops). The speeds behind the numbers are in benchmarks/RESULTS.md.

Token loop or chunks
    SHORT       calls of fewer tokens (a decoding step) take the recurrent token loop in the chunk
                form of the decayed family, the delta rules and SSD: batching chunks costs more
                tensor ops than the loop has tokens.
    SHORT_SCAN  the same for Mamba's selective scan, whose chunked "lanes" cost more per call:
                below ~16-32 tokens its token loop is faster.

Groups of chunks in reused buffers (the chunk engines, with a gradient and without; ``ssd.py``). Long
layer calls are cut into pieces at one level only, the layer's ``piece_size`` (``layers.base.Mixer``).
    TOKEN_HEADS_DECAY / _SSD / _DELTA   about this many (token, head) pairs per group: large enough
                to batch, small enough to stay in cache (each the best of 1K-16K measured here). The
                delta rules' one engine (``ops/delta/chunk.py``) runs in these groups with a gradient too:
                autograd keeps a group's temporaries, and 4K was the best there as well.
    STATES_DECAY  at most this many numbers in a group's buffer of chunk states (n B H K V) in the decayed
                family's chunk engine: with large K and V a group holds fewer chunks (4 MiB in float32).
    FACTOR_LIMIT  the decayed family's scores may be factorised as exp(b_i) exp(-b_j) (one matmul for
                all pairs) only while every exponent stays below e^FACTOR_LIMIT (float32 keeps 7
                digits of a product of factors up to e^30 and e^-30); SSD's factors are taken about the
                chunk's midpoint, so a chunk may decay by up to 2 FACTOR_LIMIT. A group whose chunks
                decay more takes the exact route (every exponent a difference <= 0). The generalised
                delta rule's four score sets take midpoint factors too (``delta/chunk.py``,
                ``_dplr_scores``): one matmul, against four sub-chunked score sets (2.3x faster forward
                at RWKV-7's decays), and the exact sub-chunked scores beyond 2 FACTOR_LIMIT.
    DELTA_CHUNK   the delta rules' chunk engine uses chunks of at most this many tokens whatever the
                caller's ``chunk_size`` (faster than 16 and 64 at 4K-16K tokens, with a gradient and
                without; the result does not depend on the chunk size beyond rounding).

Exact or factorised products
    SPAN          GLA's per-key-dim decay: the 16 x 16 diagonal blocks of a sub-chunk become a matmul
                (factors about the sub-chunk's midpoint) when no channel decays by more than this
                inside any sub-chunk (by dtype: factors within e^(+-SPAN/2)); else elementwise.
    FLASH_16BIT   softmax attention, 16-bit scores with K != V: SDPA's math path below this many
                (T x L) score entries (it keeps the probabilities in float32), the flash kernel above
                (the math path's T x T scores cost 6.5x the time at T = 8,192 in bf16).
    ABSORBED_MAX_T  multi-head latent attention: calls of at most this many tokens continuing a cache
                attend in the latent space (the absorbed form); longer ones expand keys and values.

Which route a call took
    Every op whose route depends on its inputs reports it to ``took(op, route)``; ``routes_taken()``
    returns the counts since ``reset_routes()`` (tests read them; a debug log line goes to the
    ``subquad.routes`` logger when it is enabled). Ops with a ``route=`` argument check it with
    ``check_route``: None picks by the thresholds here, a name forces that route.
"""

import logging
from collections import Counter

import torch

SHORT = 4
SHORT_SCAN = 16
TOKEN_HEADS_DECAY = 4096
TOKEN_HEADS_SSD = 16384
TOKEN_HEADS_DELTA = 4096
STATES_DECAY = 1 << 20
FACTOR_LIMIT = 30.0
DELTA_CHUNK = 32
SPAN = {torch.float32: 60.0, torch.float64: 600.0}
FLASH_16BIT = 1 << 20
ABSORBED_MAX_T = 16

_log = logging.getLogger("subquad.routes")
_taken: Counter = Counter()


def took(op: str, route: str) -> None:
    """Record that ``op`` ran by ``route`` (not while torch.compile traces: a Python side effect there
    would be replayed or break the graph, and the compiled call's route is the eager one's)."""
    if torch.compiler.is_compiling():
        return
    _taken[(op, route)] += 1
    if _log.isEnabledFor(logging.DEBUG):
        _log.debug("%s: %s route", op, route)


def routes_taken() -> dict[tuple[str, str], int]:
    """{(op, route): calls} since the last ``reset_routes()``."""
    return dict(_taken)


def reset_routes() -> None:
    _taken.clear()


def check_route(route, allowed: tuple[str, ...], op: str):
    """``route`` is None (automatic) or one of ``allowed``; else a ValueError naming the argument."""
    if route is not None and route not in allowed:
        raise ValueError(f"route must be None (automatic) or one of {', '.join(map(repr, allowed))} for {op}, "
                         f"got {route!r}")
    return route
