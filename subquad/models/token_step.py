"""A decoding token from its ids to its logits with the fewest Python steps between the C calls.

``LanguageModel.step`` without a compiled step ran the prefill's path for one token: ``prefill``, ``_hidden``,
``_blocks``, ``_embed_tokens`` and the embedding module, the blocks (``models.stack``: one C call a run), then
``_logits`` - the final norm's five ops and the head module's call - and a slice. After a token's weights have
streamed through the caches each of those Python objects is read from memory: ~0.5 ms of an 8- or 4-bit token
of 5-11 ms (benchmarks/RESULTS.md, "The token's ends in C"). ``decode_token`` takes the same path in three
steps: the embedding's lookup (one op), ``models.stack.stacked_blocks`` and ``HeadStep``, the final RMSNorm and
the head's product in one C call (``kernels/layer_stack.c``'s ``head_rows``: the head float32 - the tied
embedding's or its own -, int8, int4, bfloat16 or float16, as the block kernels read a projection,
``layers.mamba.kernel_weight``). The norm and the product are the same math in another order of sums, so the
logits agree with ``prefill``'s within float32's rounding, not bit for bit.

It applies where the model's ends are that plain - an ``nn.Embedding`` without scale, learned positions, norm or
hyper-connections; no shared blocks; a plain RMSNorm; no logit cap; no hooks on the embedding, the norm or the
head - to up to ``layers.linear.C_ROWS`` rows of float32 tokens on the CPU without gradients, autocast or a
trace, and where ``stacked_blocks`` takes the blocks (``models.stack.has_runs``: a run of them exists; else
None: ``eager_step`` takes the prefill's path, ``models.lm``). The head's call is kept per rows with a
``kernels.Held`` of what it read (rebuilt when the norm, head or embedding changes). ``ENABLED = False`` turns
it off; tests/models/test_token_step.py holds it to the prefill's path and to a float64 model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from subquad import kernels
from subquad.kernels import FLOAT, I64, INT, PTR, Call, Kernel
from subquad.kernels.fpenv import flush_denormals
from subquad.kernels.qgemv import proj_args
from subquad.layers.linear import C_ROWS
from subquad.layers.mamba import kernel_weight
from subquad.layers.norm import RMSNorm
from subquad.models.stack import has_runs, stacked_blocks
from subquad.models.state import ModelState
from subquad.ops.mamba.fused_block import layout

ENABLED = True
KERNEL = Kernel("head_rows", [I64, I64, I64, INT, PTR, PTR, FLOAT, PTR, PTR, PTR, INT, I64, PTR, PTR],
                "layer_stack")
_PLANS = kernels.KeptCalls()                                        # head module (or the tied embedding) -> {rows}


class HeadStep:
    """rmsnorm(h) W^T + b for ``B`` rows with ``norm`` and the head's weight ``w`` (a float32 (V, d) matrix or
    ``kernel_weight``'s tuple) of ``V`` outputs fixed: ``step(h (B, 1, d))`` -> logits (B, V)."""

    def __init__(self, B: int, norm, w, bias, V: int):
        w, s, kind, groups = proj_args(w)
        self.B, self.d, self.V = B, norm.weight.shape[0], V
        self.tensors = [norm.weight, w, s, bias]
        self.floats = [norm.weight, bias] + ([w] if kind in (0, 1) else [])
        self.call = Call(KERNEL, [B, self.d, self.V, None, None, norm.weight, float(norm.eps), w, s, bias, kind,
                                  groups, None, None], (3, 4, 12, 13))

    def __call__(self, h):
        B, d = self.B, self.d
        h2 = h.reshape(B, d).contiguous()
        logits = h2.new_empty(B, self.V)
        self.call(torch.get_num_threads(), h2, logits, h2.new_empty(B * d))
        return logits


def _ends_plain(model) -> bool:
    """Whether the model's embedding, final norm and head are what ``decode_token`` computes (module doc)."""
    cfg, norm = model.config, model.norm
    mods = [model.embed, norm] + ([] if model.head is None else [model.head])
    return type(model.embed) is nn.Embedding and model.pos_embed is None and cfg.embed_scale is None \
        and model.embed_norm is None and cfg.hyper is None and model.shared is None \
        and cfg.logit_soft_cap is None and type(norm) is RMSNorm and norm.weight is not None \
        and norm.bias is None and not any(m._forward_hooks or m._forward_pre_hooks for m in mods)


def _head(model, h):
    """The ``HeadStep`` kept for ``model`` at h's rows, or None."""
    B, norm = h.shape[0], model.norm
    module = model.embed if model.head is None else model.head

    def make():
        if model.head is None:
            w, bias, V = model.embed.weight, None, model.embed.num_embeddings
            w = w if w.dtype == torch.float32 and layout(w) else None       # (column-major: decode_layout's)
        else:
            head = model.head
            w, bias, V = kernel_weight(head, B), getattr(head, "bias", None), getattr(head, "out_features", None)
        if w is None or not isinstance(V, int):
            return None
        step = HeadStep(B, norm, w, bias, V)
        return step if kernels.usable(KERNEL, h, *step.floats) else None
    got = _PLANS.get(module, norm, B, make)
    if got is None or not got[0].ok or (got[2] and not kernels.usable(KERNEL, h)):
        return None
    return got[1]


def decode_token(model, tokens, state):
    """tokens (B, 1), the state after each row's previous tokens -> (logits (B, vocab), new state), or None where
    the module doc's conditions fail (nothing is changed then)."""
    if not ENABLED or state is None or tokens.dim() != 2 or tokens.shape[1] != 1 or tokens.shape[0] > C_ROWS \
            or len(state) != len(model.blocks) or torch.is_grad_enabled() or torch.compiler.is_compiling() \
            or not _ends_plain(model) or model.embed.weight.dtype != torch.float32 or not model.embed.weight.is_cpu \
            or not has_runs(model.blocks):
        return None
    model._check_idx(tokens)
    h = F.embedding(tokens.long(), model.embed.weight)
    head = _head(model, h)
    if head is None:
        return None
    with flush_denormals():
        out = stacked_blocks(model.blocks, h, state)
        if out is None:
            return None
        logits = head(out[0])
    return logits, ModelState(out[1], pos=getattr(state, "pos", 0) + 1)
