"""Pure tensor functions: ``o, final_state = op(q, k, v, <gates>, *, mode=..., ...)``.

Dimension letters, used everywhere in subquad:

    B batch, T time, H heads, K key (feature) dim, V value dim,
    D model width, N SSM state size, P SSD head dim, C chunk size;
    Bz the batch where B is a scan's input matrix (Mamba, SSD); G Mamba-2's groups of heads sharing B, C;
    L tokens and n chunks per group of the chunk engines, ng the number of such groups.

Layout at the op boundary: q, k ``(B, T, H, K)``; v, o ``(B, T, H, V)``;
recurrent state ``(B, H, K, V)``, kept in float32 for lower-precision inputs
(float64 stays float64); an ``initial_state`` of another dtype is refused, not cast
(``common.checks``, which lists every input rule). ``scale=None`` means ``K ** -0.5``
on the queries.
Each op takes ``mode`` in ``("parallel", "recurrent", "chunk")``, ``chunk_size``,
``initial_state`` and ``output_final_state`` and returns ``(o, final_state)``;
``final_state`` is None unless asked for; ``cu_seqlens`` (N + 1,) packs N sequences of
different lengths in one row (``subquad.ops.common.varlen``). Every op's three forms are public too,
``parallel_<op>``, ``recurrent_<op>`` and ``chunk_<op>``, with the op's signature
less ``mode``. Gates follow the values: ``(q, k, v, g)``, ``(q, k, v, beta)``,
``(q, k, v, g, beta)``, ``(q, k, v, w, a, b)``; Mamba's scans take ``(x, dt, A, B, C)``, the RG-LRU ``(x, g)``,
the mLSTM ``(q, k, v, g, i)`` (its state the triple (C, n, m)).

The op families live in folders named after the family, not the op (so no function
shadows its package): ``softmax/`` (softmax_attention), ``linear/`` (linear_attention),
``decay/`` (retention, simple_gla, gla, ssd), ``delta/`` (delta_rule, gated_delta_rule, generalized_delta_rule),
``mamba/`` (selective_scan), ``lru/`` (rg_lru), ``xlstm/`` (mlstm); each has a file per form and a README with its
recurrence.
"""

from subquad.ops.common.checks import MODES
from subquad.ops.common.lse import merge_attention
from subquad.ops.common.precision import set_checks
from subquad.ops.common.transition import Transition, declare, transition_of
from subquad.ops.decay import (
    chunk_gla,
    chunk_retention,
    chunk_simple_gla,
    chunk_ssd,
    gla,
    parallel_gla,
    parallel_retention,
    parallel_simple_gla,
    parallel_ssd,
    recurrent_gla,
    recurrent_retention,
    recurrent_simple_gla,
    recurrent_ssd,
    retention,
    simple_gla,
    ssd,
)
from subquad.ops.delta import (
    chunk_delta_rule,
    chunk_gated_delta_rule,
    chunk_generalized_delta_rule,
    delta_rule,
    gated_delta_rule,
    generalized_delta_rule,
    parallel_delta_rule,
    parallel_generalized_delta_rule,
    parallel_gated_delta_rule,
    recurrent_delta_rule,
    recurrent_gated_delta_rule,
    recurrent_generalized_delta_rule,
)
from subquad.ops.feature_maps import FEATURE_MAPS, feature_map
from subquad.ops.linear import (
    chunk_linear_attention,
    linear_attention,
    parallel_linear_attention,
    recurrent_linear_attention,
)
from subquad.ops.linformer import linformer_attention
from subquad.ops.lru import chunk_rg_lru, parallel_rg_lru, recurrent_rg_lru, rg_lru
from subquad.ops.mamba import chunk_selective_scan, parallel_selective_scan, recurrent_selective_scan, selective_scan
from subquad.ops.softmax import (
    KVCache,
    chunk_softmax_attention,
    naive_softmax_attention,
    parallel_softmax_attention,
    recurrent_softmax_attention,
    softmax_attention,
)
from subquad.ops.xlstm import chunk_mlstm, mlstm, parallel_mlstm, recurrent_mlstm

# Each recurrent op's state-passing transition (the mLSTM has none: its max stabiliser makes the state
# non-affine in the initial one) (``common.transition``): what context parallelism and
# sequence parallelism read to carry a state across ranks, with no code of their own per op.
for _op, _t in ((linear_attention, Transition("identity", normaliser="normalize")),
                (retention, Transition("diagonal")), (simple_gla, Transition("diagonal")), (gla, Transition("diagonal")),
                (ssd, Transition("diagonal", values="x")), (selective_scan, Transition("diagonal", values="x")),
                (delta_rule, Transition("matrix")), (gated_delta_rule, Transition("matrix")),
                (generalized_delta_rule, Transition("matrix")),
                (rg_lru, Transition("diagonal", values="x"))):
    declare(_op, _t)

# the recurrent ops under the one contract: op(inputs..., *, mode, chunk_size, scale?, initial_state,
# output_final_state) -> (o, final_state); tests/test_contract.py checks every signature against it
RECURRENT_OPS = ("linear_attention", "retention", "simple_gla", "gla", "ssd", "delta_rule", "gated_delta_rule",
                 "generalized_delta_rule", "selective_scan", "rg_lru", "mlstm")
OPS = RECURRENT_OPS + ("softmax_attention",)

__all__ = [
    "MODES", "OPS", "RECURRENT_OPS", "set_checks", "FEATURE_MAPS", "KVCache", "feature_map", "merge_attention",
    "linformer_attention", "naive_softmax_attention", "Transition", "transition_of",
    *OPS,
    *(f"{form}_{op}" for op in OPS for form in ("parallel", "recurrent", "chunk")),
]
