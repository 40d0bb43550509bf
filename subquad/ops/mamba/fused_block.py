"""One decoding token of a whole pre-norm Mamba-1 block without an MLP, in one call (``kernels/mamba_block.c``).

    x  = h / sqrt(mean(h^2) + eps) * norm_w        h (B, 1, d): the residual stream
    xz = x W_in^T + b_in                            in_proj: W_in (2 Dm, d)
    y  = ops.mamba.fused_step's step of xz          (B, Dm), the new conv state and h
    h' = h + y W_out^T + b_out                      out_proj: W_out (d, Dm)   -> (h' (B, 1, d), conv, h)

``TokensStep``: T consecutive tokens of each row (a speculative verification's forward under
``layers.rollback.PER_TOKEN``), h (B, T, d) -> (h' (B, T, d), conv (B, T, K-1, Dm), h (B, T, Dm, N)): the
products over all B T rows at once, the step token by token, and the states after every token kept - what the
layer's modules give under ``PerToken`` (its reference), in one call instead of a dozen ops per layer
(``kernels/mamba_block.c``'s ``mamba_block_tokens``).

mamba-130m's layer and every mamba checkpoint's without Falcon-Mamba's norms: the step's norm, two products,
kernel and residual cost one call instead of a dozen ops and five module calls (~170 us of Python and dispatch
per layer on the AVX2 EPYC hosts; benchmarks/RESULTS.md). ``models.lm.PreNormBlock`` takes it through
``layers.mamba.Mamba.fused_block`` where the layer's fused step would run and the block has no MLP, a plain
RMSNorm and projections the kernel reads (``layers.mamba.block_projections``: float32 row- or column-major up to
``layers.linear.C_ROWS`` rows, int8 per channel and int4 for a few); ``BlockStep`` keeps the call between
tokens (``layers.mamba.planned_block``). The block's PyTorch forward is the reference. The states passed in are
read, never written. Eager only (a compiled step leaves it to inductor, as it does the layer's fused step:
``kernels.usable``).
"""

from __future__ import annotations

import array
import struct

import torch

from subquad.kernels import FLOAT, I64, INT, PTR, Call, Kernel
from subquad.kernels.qgemv import proj_args
from subquad.ops import mlp_block
from subquad.ops.mamba.fused_step import prepare_weights

# One C function for both: a decoding step is T = 1 token of B rows
KERNEL = TOKENS = Kernel("mamba_block_tokens", [I64] * 8 + [INT, PTR, PTR, FLOAT] + [PTR] * 6 + [INT, INT, I64, I64]
                         + [PTR] * 5 + [I64, I64] + [PTR] * 8, "mamba_block")
# Consecutive blocks' steps in one call (``StackStep``): (L, 37 args each, threads, h, h', scratch)
STACK = Kernel("mamba_block_stack", [I64, PTR, INT, PTR, PTR, PTR], "mamba_block")


def layout(w: torch.Tensor) -> bool:
    """Whether the kernel reads ``w`` as it is: row-major or column-major."""
    return w.is_contiguous() or w.T.is_contiguous()


class KeptStep:
    """What both blocks' kept steps share (this module's ``BlockStep``, ``ops.decay.fused_block.BlockStep``): a
    subclass sets ``B``, ``d``, ``conv_shape`` and ``state_shape`` (the states it holds), ``scratch`` (floats),
    ``call`` (a ``kernels.Call`` whose per-call slots take threads, h, the conv state, the state, h', the new conv
    state, the new state and the scratch, in that order) and ``tensors``; ``step(h, conv_state, state)`` -> (h'
    (B, 1, d), new conv state, new state), the states passed in read, never written."""

    name = "block"

    def __call__(self, h, conv_state, state):
        B, d = self.B, self.d
        if tuple(conv_state.shape) != self.conv_shape or tuple(state.shape) != self.state_shape or h.shape[0] != B:
            raise ValueError(f"the {self.name} step holds {B} rows: conv state {self.conv_shape}, state "
                             f"{self.state_shape}; got h {tuple(h.shape)}, {tuple(conv_state.shape)}, "
                             f"{tuple(state.shape)}")
        h2, conv_state, state = h.reshape(B, d).contiguous(), conv_state.contiguous(), state.contiguous()
        h_out, state_out, conv_out = h2.new_empty(B, d), torch.empty_like(state), torch.empty_like(conv_state)
        self.call(torch.get_num_threads(), h2, conv_state, state, h_out, conv_out, state_out,
                  h2.new_empty(self.scratch))
        return h_out.view(B, 1, d), conv_out, state_out


class BlockStep(KeptStep):
    """The module doc's step for ``B`` rows with the layer's weights fixed: ``BlockStep(B, norm_w, eps, w_in, b_in,
    w_out, b_out, conv_w, conv_b, wx, wdt, bdt, A_log, Dp)`` converts them once (``kernels.Call``), then
    ``step(h, conv_state, ssm)`` -> (h' (B, 1, d), new conv state (B, K-1, Dm), new ssm state (B, Dm, N)) per
    token; h (B, 1, d) float32, B <= 16; w_in and w_out float32 row- or column-major (``layout``) or quantised
    (``kernels.qgemv.proj_args``); the rest as ``ops.mamba.fused_step.mamba_step`` takes them. ``tensors``: what it
    was built from (``kernels.Held`` finds them in the modules)."""

    name = "Mamba block"

    def __init__(self, B, norm_w, eps, w_in, b_in, w_out, b_out, conv_w, conv_b, wx, wdt, bdt, A_log, Dp, T=0):
        (w_in, s_in, in_kind, in_g), (w_out, s_out, out_kind, out_g) = proj_args(w_in), proj_args(w_out)
        self.tensors = [norm_w, w_in, s_in, b_in, w_out, s_out, b_out, conv_w, conv_b, wx, wdt, bdt, A_log, Dp]
        conv_w, wx, wdt, bdt, A_log, (N, K, R, heads) = prepare_weights(conv_w, wx, wdt, bdt, A_log)
        d, D = norm_w.shape[0], A_log.shape[0]
        self.B, self.d, self.conv_shape, self.state_shape = B, d, (B, K - 1, D), (B, D, N)
        self.scratch = max(T, 1) * B * (d + 5 * D + heads * (R + 2 * N))   # per row and token
        self.call = Call(KERNEL, [max(T, 1), B, d, D, N, R, K, heads, None, None, norm_w, float(eps), w_in, s_in, b_in,
                                  w_out, s_out, b_out, in_kind, out_kind, in_g, out_g, None, conv_w, conv_b, wx, wdt,
                                  wdt.stride(0), wdt.stride(1), bdt, A_log, Dp, None, None, None, None, None],
                         (8, 9, 22, 32, 33, 34, 35, 36))


def _words(raw: list, floats: tuple) -> list:
    """A kept call's arguments as 64-bit words: None as 0, the floats at ``floats`` as their bits."""
    row = [0 if v is None else v for v in raw]
    for i in floats:
        row[i] = struct.unpack("<i", struct.pack("<f", row[i]))[0]
    return row


class StackStep:
    """``L`` kept one-token steps of one kind (``BlockStep``s of consecutive blocks at the same rows) in one C call
    (``kernel``: this module's ``STACK``, or ``ops.decay.fused_block.STACK`` for Mamba-2's): the ~20 us of Python
    a block's call costs besides its arithmetic paid once per step, not per block (``models.stack``). Each layer's
    arguments are converted once into an (L, n) int64 table (the floats at ``floats`` as their bits), and the
    states' slots filled per call; layer l reads the h' layer l - 1 wrote. ``step(h (B, 1, d), [(conv state,
    state) per layer])`` -> (h' after the last, [(new conv state, new state) per layer]): the states passed in
    read, never written, each new one its own tensor, as the layers' own steps return them."""

    def __init__(self, kernel: Kernel, steps: list, floats: tuple, mlps: list | None = None):
        self.kernel, self.steps = kernel, tuple(steps)
        self.B, self.d = steps[0].B, steps[0].d
        rows = []
        for i, step in enumerate(steps):
            row = _words(step.call.raw, floats)
            if mlps is not None:            # Mamba-2's rows: 1 and the MLP's arguments, or 0 and zeros
                mlp = mlps[i]
                row += [0] * (1 + mlp_block.ARGS) if mlp is None else [1] + _words(mlp.call.raw, mlp_block.FLOATS)
            rows.append(row)
        # the (L, n) table as a flat array of C int64s, copied and filled per call with plain Python: as a tensor,
        # clone, index_put and the pointers' tensor were four ops of cold dispatch a call (benchmarks/RESULTS.md)
        self.table = array.array("q", [v for row in rows for v in row])
        slots = steps[0].call.slots         # threads, h, conv state, state, h', new conv state, new state, scratch
        width = len(rows[0])
        self.fill = [(width * i + slots[2], width * i + slots[3], width * i + slots[5], width * i + slots[6])
                     for i in range(len(rows))]
        self.scratch = max([step.scratch for step in steps] + [m.scratch for m in mlps or () if m is not None])

    def __call__(self, h, states):
        B, d, L = self.B, self.d, len(self.steps)
        if tuple(h.shape) != (B, 1, d) or len(states) != L:
            raise ValueError(f"the stacked step holds {L} layers of {B} rows of width {d}; got h {tuple(h.shape)} "
                             f"and {len(states)} states")
        table, keep, outs = self.table[:], [], []
        for step, (conv, state), (a, b, c, e) in zip(self.steps, states, self.fill):
            if tuple(conv.shape) != step.conv_shape or tuple(state.shape) != step.state_shape:
                raise ValueError(f"a {step.name} step holds conv state {step.conv_shape}, state "
                                 f"{step.state_shape}; got {tuple(conv.shape)}, {tuple(state.shape)}")
            conv, state = conv.contiguous(), state.contiguous()
            new = torch.empty_like(conv), torch.empty_like(state)
            table[a], table[b], table[c], table[e] = conv.data_ptr(), state.data_ptr(), new[0].data_ptr(), \
                new[1].data_ptr()
            keep.append((conv, state))
            outs.append(new)
        h2 = h.reshape(B, d).contiguous()
        h_out = h2.new_empty(B, d)
        self.kernel(L, table.buffer_info()[0], torch.get_num_threads(), h2, h_out, h2.new_empty(self.scratch))
        return h_out.view(B, 1, d), outs


class TokensStep(BlockStep):
    """The module doc's ``TokensStep`` for ``T`` tokens of ``B`` rows (T B <= 16), the weights as ``BlockStep``
    takes them: ``step(h (B, T, d), conv_state, ssm)`` -> (h' (B, T, d), the conv state after each token (B, T,
    K-1, Dm), the ssm state after each (B, T, Dm, N)); the states passed in read, never written. The kernel runs
    tokens t-major (row t B + b); for B > 1 the outputs are views of (T, B, ...) buffers."""

    name = "Mamba block (tokens)"

    def __init__(self, T, B, *weights):
        super().__init__(B, *weights, T=T)
        self.T = T

    def __call__(self, h, conv_state, state):
        B, T, d = self.B, self.T, self.d
        if tuple(conv_state.shape) != self.conv_shape or tuple(state.shape) != self.state_shape \
                or tuple(h.shape) != (B, T, d):
            raise ValueError(f"the {self.name} step holds {B} rows of {T} tokens: conv state {self.conv_shape}, "
                             f"state {self.state_shape}; got h {tuple(h.shape)}, {tuple(conv_state.shape)}, "
                             f"{tuple(state.shape)}")
        ht, conv_state, state = h.transpose(0, 1).contiguous(), conv_state.contiguous(), state.contiguous()
        h_out = ht.new_empty(T, B, d)
        conv_out, state_out = ht.new_empty(T, *conv_state.shape), ht.new_empty(T, *state.shape)
        self.call(torch.get_num_threads(), ht, conv_state, state, h_out, conv_out, state_out,
                  ht.new_empty(self.scratch))
        return h_out.transpose(0, 1), conv_out.transpose(0, 1), state_out.transpose(0, 1)


def block_step(h, norm_w, eps, w_in, b_in, w_out, b_out, conv_state, conv_w, conv_b, wx, wdt, bdt, A_log, Dp, ssm):
    """``BlockStep``'s step once: (h', new conv state, new ssm state)."""
    return BlockStep(h.shape[0], norm_w, eps, w_in, b_in, w_out, b_out, conv_w, conv_b, wx, wdt, bdt, A_log,
                     Dp)(h, conv_state, ssm)
