"""A compiled decoding step: one token per row through the whole model without per-op overhead.

    compile_decode(model)            model.step(tokens, state) now runs compiled; generate, `subquad generate`
                                     and the server decode through model.step
    compile_decode(model, False)     back to eager (the reference)
    decode_layout(model)             wide float32 matrices stored column-major, as a one-token step reads them

An eager step of a small model is mostly overhead: some 30-50 small ops per layer, each a dispatch of a few
microseconds on tensors of a few thousand numbers, the Python around them, and the value checks the ops run
on CPU. torch.compile (inductor) fuses each block's elementwise work into a few C++ loops and keeps the
matrix products as library calls (and the quantised ones as ``subquad::int8_linear`` and
``subquad::int4_linear``, ``models.quant``).

One graph holds every block, the final norm and the head; the embedding and the position count run in
Python around it. One graph per block, shared by the blocks of the same structure, would compile several
times faster but pay guards and a call per block on every token, where the whole-model graph pays them once.
Sizes are symbolic from the first compile (``DYNAMIC``), so a KV cache that grows or a batch that changes
size runs the same graph. A mixture of experts stays in the graph too: a step's few rows read their k
experts' weights by index (``MoE._gathered``); a batch with more choices than experts (rows * k > E) runs
the routed loop as one op inside the graph (``subquad::moe_experts``: its loop's shapes depend on the routing,
the op's output does not). A state keeps one structure from step to step (``_for_graph``: KV caches with room
to append in place and ragged at >= 2 rows, tensors dense and without a base), so a batch of >= 2 rows runs
one graph and a batch of 1 another (dynamo specialises sizes of 1), whatever the steps between.

Equality: tested against the eager step over 64 steps for every mixer and every checkpoint type
(tests/models/test_decode.py): float32 within 1e-5 of the logits' scale - inductor may reorder a sum.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from subquad.models.state import ModelState
from subquad.ops import KVCache

RECOMPILE_LIMIT = 64        # graphs per model: a new one only where the state's structure changes
DYNAMIC = True             # sizes symbolic from the first compile: batches and KV caches change without recompiling
OPTIONS = {"cpp_wrapper": True}   # inductor calls the kernels from C++, not Python: less overhead per token


def _dense(t: torch.Tensor) -> torch.Tensor:
    """t with row-major strides and no base: itself when it has them, else a copy. ``contiguous()`` is not
    enough: a (1, 3, D) view of a (1, 4, D) buffer counts as contiguous with stride 4D on dim 0, and the graph
    guards on strides - a short convolution's tail would recompile it once more; and it guards on a view's base
    (a state that a prefill left as a view, the next step's not: once more)."""
    expect, n = [], 1
    for size in reversed(t.shape):
        expect.append(n)
        n *= size
    if t.stride() == tuple(reversed(expect)) and t._base is None:
        return t
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


def _for_graph(v):
    """A state entry as the graph takes it: a tensor with row-major strides, a KV cache ready to append in
    place (``KVCache.for_step``: no reallocation in the graph, ragged at >= 2 rows)."""
    if isinstance(v, torch.Tensor):
        return _dense(v)
    return v.for_step() if isinstance(v, KVCache) else v


def _blocks_and_head(model, h, states):
    """h (B, 1, d_model) and the per-layer states -> (logits (B, vocab), new per-layer states): the graph."""
    out, carry = [], model._carry(h)        # carry: values that cross layers (``LanguageModel._hidden``)
    for block, s in zip(model.blocks, states):
        h, s = block(h, s, carry=carry)
        out.append(s)
    return model._logits(h)[:, -1], out


class CompiledStep:
    """``model.step``'s compiled form (module doc): tokens (B, 1) long, state -> (logits (B, vocab), state)."""

    def __init__(self, model):
        self.model = model
        # dynamo keeps compiled graphs per code object, so each model gets a copy of the function's code: its own
        # cache and recompile limit, and no guard scan over other models' graphs
        code = _blocks_and_head.__code__.replace()
        own = types.FunctionType(code, _blocks_and_head.__globals__, _blocks_and_head.__name__)
        self.graph = torch.compile(own, dynamic=DYNAMIC, options=OPTIONS)

    def __call__(self, tokens, state):
        model = self.model
        h, pos = model._embed_tokens(tokens, state)
        states = [None] * len(model.blocks) if state is None else [{k: _for_graph(v) for k, v in s.items()} for s in state]
        # no duck sizing: a batch of 3 beside a convolution's 3-token tail would tie the two sizes (a recompile)
        with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT), \
                torch.fx.experimental._config.patch(use_duck_shape=False):
            logits, out = self.graph(model, h, states)
        return logits, ModelState(out, pos=pos)


def compile_decode(model, on: bool = True):
    """Make ``model.step`` (and so ``generate``) run the compiled step (module doc), or eager with ``on=False``;
    returns the model. The first steps compile (seconds for a small model, longer for a large one)."""
    if not isinstance(on, bool):
        raise ValueError(f"compile_decode's on must be a bool, got {on!r}")
    model._decode_step = CompiledStep(model) if on else None
    return model


def decode_layout(model):
    """Store every wide matrix of ``model`` (out_features >= 2 in_features: input projections, the vocabulary
    head or the tied embedding; an untied embedding is only looked up and keeps its rows) column-major, and
    return the model. Same shapes, values and state dict.
    Decoding one token reads each weight in a matrix-vector product, which CPU BLAS streams faster from the
    column-major layout; prefill and training run at the same speed either way. float32 weights only: for
    bfloat16 weights the row-major layout is the faster one. ``from_pretrained`` applies it."""
    tied = getattr(model, "head", None) is None            # the embedding is the head's matrix too
    for m in model.modules():
        if not isinstance(m, (nn.Linear, nn.Embedding)):
            continue                                   # (a quantised module's ``weight`` is a dequantised copy)
        w = m.weight
        if isinstance(m, nn.Embedding) and not tied:
            continue                                   # looked up a row at a time: row-major serves it best
        if w is not None and w.dim() == 2:
            wide = w.shape[0] >= 2 * w.shape[1]            # Linear: (out, in); Embedding: (vocab, d_model)
            if wide and w.is_contiguous() and w.dtype == torch.float32:
                m.weight = nn.Parameter(w.detach().T.contiguous().T, requires_grad=w.requires_grad)
    return model
