"""Every threshold that picks a route or a work size inside the ops, in one place, with its reason.

No route changes a result beyond rounding: each is tested against the parallel form in float64
(tests/ops). The speeds behind the numbers are in benchmarks/RESULTS.md.

Token loop or chunks
    SHORT       calls of fewer tokens (a decoding step) take the recurrent token loop in the chunk
                form of the decayed family, the delta rules and SSD: batching chunks costs more
                tensor ops than the loop has tokens.
    SHORT_SCAN  the same for Mamba's selective scan, whose chunked "lanes" cost more per call:
                below ~16-32 tokens its token loop is faster.

Pieces of a differentiable call (autograd keeps a piece's temporaries, not a whole call's)
    PIECE               tokens per piece of the decayed family's and the delta rules' chunk forms.
    PIECE_PER_KEY_DIM   GLA's per-key-dim decay: its sub-chunk temporaries are 4x larger.

No-gradient fast paths (``inference.py``, ``ssd.py``): groups of chunks in reused buffers
    TOKEN_HEADS_DECAY / _SSD / _DELTA   about this many (token, head) pairs per group: large enough
                to batch, small enough to stay in cache (each the best of 1K-16K measured here).
    FACTOR_LIMIT  the decayed family's scores may be factorised as exp(b_i) exp(-b_j) (one matmul for
                all pairs) only while every exponent stays below e^FACTOR_LIMIT (float32 keeps 7
                digits of a product of factors up to e^30 and e^-30); SSD's factors are taken about the
                chunk's midpoint, so a chunk may decay by up to 2 FACTOR_LIMIT. A group whose chunks
                decay more takes the exact route (every exponent a difference <= 0).
    DELTA_CHUNK   the delta rules' fast path uses chunks of at most this many tokens whatever the
                caller's ``chunk_size`` (faster than 64 at 4K-16K tokens; the result does not depend
                on the chunk size beyond rounding, and this path has no gradient to keep).
"""

SHORT = 4
SHORT_SCAN = 16
PIECE = 2048
PIECE_PER_KEY_DIM = 256
TOKEN_HEADS_DECAY = 4096
TOKEN_HEADS_SSD = 16384
TOKEN_HEADS_DELTA = 2048
FACTOR_LIMIT = 30.0
DELTA_CHUNK = 32
