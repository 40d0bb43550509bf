"""A compiled decoding step: one token per row through the whole model without per-op overhead.

    compile_decode(model)            model.step(tokens, state) now runs compiled; generate, `subquad generate`
                                     and the server decode through model.step
    compile_decode(model, False)     back to eager (the reference)

An eager step of a small model is mostly overhead: some 30-50 small ops per layer, each a dispatch of a few
microseconds on tensors of a few thousand numbers, the Python around them, and the value checks the ops run
on CPU (benchmarks/RESULTS.md "Decoding at the bandwidth bound"). torch.compile (inductor) fuses each
block's elementwise work into a few C++ loops and keeps the matrix products as library calls (and the int8
ones as ``subquad::int8_linear``, ``models.quant``).

One graph holds every block, the final norm and the head; the embedding and the position count run in
Python around it. Measured against the alternatives on mamba-130m (benchmarks/RESULTS.md): one graph per
block, shared by the blocks of the same structure, compiles in ~3 s instead of ~25 s but pays ~250 us of
guards and calls per block - 30 against 25-27 ms per float32 token; the eager step takes 41-43. Sizes are
symbolic from the first compile (``DYNAMIC``), so a KV cache that grows or a batch that changes size runs
the same graph. A mixture of experts' routed loop runs eagerly inside the graph (it depends on the
routing: ``MoE._dispatch``).

Equality: tested against the eager step over 64 steps for every mixer and every checkpoint type
(tests/models/test_decode.py): float32 within 1e-5 of the logits' scale - inductor may reorder a sum.
"""

from __future__ import annotations

import types

import torch

RECOMPILE_LIMIT = 64        # graphs per model: a new one only where the state's structure changes
DYNAMIC = True             # sizes symbolic from the first compile: batches and KV caches change without recompiling
OPTIONS = {"cpp_wrapper": True}   # inductor calls the kernels from C++, not Python: ~1.8 ms less per mamba-130m token


def _dense(t: torch.Tensor) -> torch.Tensor:
    """t with row-major strides: itself when it has them, else a copy. ``contiguous()`` is not enough: a (1, 3,
    D) view of a (1, 4, D) buffer counts as contiguous with stride 4D on dim 0, and the graph guards on
    strides - a short convolution's tail would recompile it once more."""
    expect, n = [], 1
    for size in reversed(t.shape):
        expect.append(n)
        n *= size
    if t.stride() == tuple(reversed(expect)):
        return t
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


def _blocks_and_head(model, h, states):
    """h (B, 1, d_model) and the per-layer states -> (logits (B, vocab), new per-layer states): the graph."""
    out = []
    for block, s in zip(model.blocks, states):
        h, s = block(h, s)
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
        from subquad.models.lm import ModelState

        model = self.model
        h, pos = model._embed_tokens(tokens, state)
        states = [None] * len(model.blocks) if state is None else \
            [{k: _dense(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()} for s in state]
        with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            logits, out = self.graph(model, h, states)
        return logits, ModelState(out, pos=pos)


def compile_decode(model, on: bool = True):
    """Make ``model.step`` (and so ``generate``) run the compiled step (module doc), or eager with ``on=False``;
    returns the model. The first steps compile (seconds for a small model, ~25 s for mamba-130m)."""
    if not isinstance(on, bool):
        raise ValueError(f"compile_decode's on must be a bool, got {on!r}")
    model._decode_step = CompiledStep(model) if on else None
    return model
