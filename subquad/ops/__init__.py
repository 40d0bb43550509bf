"""Pure tensor functions: ``o, final_state = op(q, k, v, <gates>, *, mode=..., ...)``.

Dimension letters, used everywhere in subquad:

    B batch, T time, H heads, K key (feature) dim, V value dim,
    D model width, N SSM state size, C chunk size.

Layout at the op boundary: q, k ``(B, T, H, K)``; v, o ``(B, T, H, V)``;
recurrent state ``(B, H, K, V)``, kept in float32 for lower-precision inputs
(float64 stays float64). ``scale=None`` means ``K ** -0.5`` on the queries.
Each op takes ``mode`` in ``("parallel", "recurrent", "chunk")``, ``chunk_size``,
``initial_state`` and ``output_final_state`` and returns ``(o, final_state)``;
``final_state`` is None unless asked for.
"""

from subquad.ops.common.lse import merge_attention
from subquad.ops.feature_maps import FEATURE_MAPS, feature_map
from subquad.ops.delta_rule import delta_rule, gated_delta_rule
from subquad.ops.gla import gla, retention, simple_gla
from subquad.ops.linformer import linformer_attention
from subquad.ops.mamba import selective_scan
from subquad.ops.linear_attn import (
    chunk_linear_attention,
    linear_attention,
    parallel_linear_attention,
    recurrent_linear_attention,
)
from subquad.ops.softmax import (
    KVCache,
    chunk_softmax_attention,
    naive_softmax_attention,
    parallel_softmax_attention,
    recurrent_softmax_attention,
    softmax_attention,
)

from subquad.ops.common.checks import MODES
from subquad.ops.common.precision import set_checks

__all__ = [
    "MODES",
    "set_checks",
    "FEATURE_MAPS",
    "KVCache",
    "feature_map",
    "merge_attention",
    "linear_attention",
    "retention",
    "simple_gla",
    "gla",
    "delta_rule",
    "gated_delta_rule",
    "selective_scan",
    "linformer_attention",
    "parallel_linear_attention",
    "recurrent_linear_attention",
    "chunk_linear_attention",
    "softmax_attention",
    "naive_softmax_attention",
    "parallel_softmax_attention",
    "recurrent_softmax_attention",
    "chunk_softmax_attention",
]
