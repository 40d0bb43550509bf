"""The mixer contract every layer follows.

    y, state = layer(x, state=None)      x, y (B, T, D); state a dict of named tensors (or None)
    state    = layer.empty_state(B)      what decoding starts from
    layer.state_bytes(state)             bytes of the tensors the state holds (measured, not computed)

Prefill a prompt with one call, then feed one token at a time with the state the
previous call returned: the outputs equal one forward over the whole sequence. A state
passed in is never modified.

A state is always a dict: fixed-state mixers hold tensors ({"S": ...}, {"ssm": ..., "conv": ...}),
softmax attention holds its ``KVCache`` under "kv", and a token counter, where a layer needs
one for positions, is a 0-d long tensor "pos" on the state's device.

``Mixer.forward`` does what every layer shares - the input checks (a state passed in must have
``empty_state``'s layout: ``check_state``; a block's fused decoding calls skip it), refusing a state
where the sequence backend sees only part of each sequence (context parallelism), and running a long
forward of a fixed-state mixer in pieces - and calls the layer's ``mix(x, state, seq)``, which
holds the layer's equations. ``seq`` is the sequence backend (``subquad.layers.sequence``): the
one entry point for positions, short convolutions, attention and recurrences.

Values that cross layers: ``carry`` is a dict the model creates for one forward and hands to every layer
in order (``Mixer.forward(x, state, cu_seqlens, carry)``); a layer that sets ``uses_carry`` gets it as
``mix(x, state, seq, carry)`` and may read what an earlier layer stored or store what a later one reads
(RWKV-7's value residual: the first layer's values under "v_first"). Its entries are per-token tensors of
this forward only, never part of a decoding state; None when a layer runs alone. Such a layer runs its
forward whole, not in pieces.

Pieces: a sequence longer than ``piece_size`` tokens runs as consecutive pieces with the state
carried between them (and autograd through it). The result is the same; every temporary is a
piece long instead of T long, so inference memory stays bounded at any length, and it is faster
(benchmarks/RESULTS.md, "Fixed-state layers in pieces").
"""

from __future__ import annotations

import torch
from torch import nn

from subquad.layers import sequence
from subquad.layers.conv import Activated, ShortConv
from subquad.ops.common.checks import state_dtype
from subquad.ops.common.chunking import in_pieces


def tensor_bytes(obj) -> int:
    """Bytes of every tensor inside a (nested) dict / list / tuple / object with ``nbytes``."""
    if obj is None:
        return 0
    if isinstance(obj, torch.Tensor):
        return obj.nelement() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    if hasattr(obj, "nbytes"):
        return int(obj.nbytes)
    return 0


def _structure(state):
    """A state's layout: dicts by key, tensors by their shape past the batch, anything else by its type."""
    if isinstance(state, dict):
        return {k: _structure(v) for k, v in state.items()}
    if isinstance(state, torch.Tensor):
        return (state.dim(), tuple(state.shape[1:]))
    return type(state).__name__


def check_state(layer, state, rows: int) -> None:
    """A state passed to ``layer`` has the layout its ``empty_state`` gives - the same keys, each tensor
    ``rows`` rows and (``Mixer.fixed_state_shapes``) the same shape past them - or a ValueError says what
    differs (a state of another layer, batch or width reached the op as a KeyError or a size error). The
    layout is taken once per layer, on the meta device; a layer whose ``empty_state`` needs more, and 0-d
    entries, are not checked."""
    spec = layer.__dict__.get("_state_layout")
    if spec is None:
        try:
            spec = _structure(layer.empty_state(1, device="meta"))
        except Exception:                       # noqa: BLE001  (a layer's own empty_state: not checked then)
            spec = False
        layer.__dict__["_state_layout"] = spec
    if not isinstance(spec, dict):
        return
    name = type(layer).__name__
    if not isinstance(state, dict) or set(state) != set(spec):
        got = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"state: {name} takes a state with keys {sorted(spec)} (its empty_state), got {got}")
    fixed = getattr(layer, "fixed_state_shapes", True)
    for key, want in spec.items():
        t = state[key]
        if not isinstance(want, tuple) or want[0] == 0:
            continue
        dim, past = want
        if not isinstance(t, torch.Tensor) or t.dim() != dim or t.shape[0] != rows \
                or (fixed and tuple(t.shape[1:]) != past):
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            shape = f"({rows}, {', '.join(map(str, past))})" if fixed else f"{dim}-d tensors of {rows} row(s)"
            raise ValueError(f"state[{key!r}]: {name} takes {shape} for {rows} row(s), got {got}")


class Mixer(nn.Module):
    """Base class: a sequence mixer (B, T, D) -> (B, T, D) that carries its own decoding state."""

    piece_size: int | None = None   # fixed-state mixers: tokens per piece of a long forward
    # a state passed in is checked against empty_state's layout (``check_state``): its keys, each tensor's rows
    # and, where this holds, each tensor's shape past them; a mixer whose state tensors grow sets False
    fixed_state_shapes = True
    normed_output = False           # the output is normalised before the output projection (LanguageModel's init)
    uses_carry = False              # mix(x, state, seq, carry): reads or writes values that cross layers (module doc)

    def __init__(self, d_model: int, mode: str = "chunk", chunk_size: int = 64):
        super().__init__()
        from subquad.ops.common.checks import check_chunk_size, check_mode

        if d_model <= 0:
            raise ValueError(f"d_model must be positive, got {d_model}")
        check_mode(mode)
        check_chunk_size(chunk_size)
        self.d_model, self.mode, self.chunk_size = d_model, mode, chunk_size

    def flops_per_token(self, T: int) -> float:
        """Useful forward FLOPs per token over a sequence of T tokens: 2 per weight of every projection and
        short convolution, plus the sequence mixing itself (``mix_flops``), counted as its recurrent or
        exact form computes it - the work any form must do, not what a chunk form spends on top.
        A training step costs 3x (forward, and a backward of twice the work)."""
        weights = sum(m.weight.numel() for m in self.modules()
                      if isinstance(m, (nn.Linear, ShortConv)))
        return 2.0 * weights + self.mix_flops(T)

    def mix_flops(self, T: int) -> float:
        """The sequence mixing's forward FLOPs per token (``flops_per_token``); each layer states its own."""
        raise NotImplementedError(f"{type(self).__name__} does not count its FLOPs")

    def output_projection(self):
        """The Linear that writes this layer's output into the residual stream (``o_proj`` / ``out_proj``);
        the model scales its initialisation with depth."""
        return getattr(self, "o_proj", None) or getattr(self, "out_proj", None)

    def forward(self, x, state=None, cu_seqlens=None, carry=None):
        """x (B, T, d_model), state (from ``empty_state`` or a previous call) or None -> (y, new state).

        ``cu_seqlens`` (N + 1,): x is N sequences packed in one row (1, T, d_model) with these cumulative
        lengths; nothing crosses a boundary (positions restart, convolutions and recurrences stop), and
        the state has one row per sequence, in and out (``empty_state(N)``). ``carry``: the model's dict of
        values that cross layers in this forward (module doc), or None."""
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must be (B, T, d_model={self.d_model}), got shape {tuple(getattr(x, 'shape', ()))}")
        if x.shape[1] == 0:
            raise ValueError(f"x must hold at least one token, got shape {tuple(x.shape)}")
        if state is not None and not torch.compiler.is_compiling():
            rows = x.shape[0] if cu_seqlens is None else len(cu_seqlens) - 1
            check_state(self, state, rows)
        seq = sequence.backend()
        if cu_seqlens is not None:
            if not seq.whole_sequence:
                raise ValueError("cu_seqlens is not supported across processes: each rank's shard is one piece of "
                                 "one sequence")
            packed = sequence.Packed(cu_seqlens)
            if x.shape[1] != sum(packed.lengths) or x.shape[0] != 1:
                raise ValueError(f"with cu_seqlens x must be packed as (1, T={sum(packed.lengths)}, d_model), "
                                 f"got {tuple(x.shape)}")
            if self.piece_size and x.shape[1] > self.piece_size and not torch.is_grad_enabled() and not self.uses_carry:
                return self._packed_pieces(x, state, packed.lengths)     # inference: memory stays bounded
            with sequence.use(packed):
                return self._mix(x, state, packed, carry)
        if not seq.whole_sequence:
            if state is not None:
                raise ValueError("context parallelism runs whole sequences from an empty state; got a decoding state")
            return self._mix(x, None, seq, carry)[0], None
        P = self.piece_size
        if P and x.shape[1] > P and not self.uses_carry:
            return in_pieces(self, (x,), P, state)
        return self._mix(x, state, seq, carry)

    def _mix(self, x, state, seq, carry):
        return self.mix(x, state, seq, carry) if self.uses_carry else self.mix(x, state, seq)

    def _packed_pieces(self, x, state, lengths):
        """A long packed row, without autograd, as pieces of whole sequences (about ``piece_size`` tokens, a
        longer sequence alone), each with its sequences' state rows: memory stays bounded, as for one
        sequence. (With autograd every piece's activations are kept anyway, and whole packed rows measured
        as fast: benchmarks/RESULTS.md.)"""
        groups, start = [], 0
        while start < len(lengths):
            end, total = start + 1, lengths[start]
            while end < len(lengths) and total + lengths[end] <= self.piece_size:
                total += lengths[end]
                end += 1
            groups.append((start, end))
            start = end
        ys, states, s = [], [], 0
        for a, b in groups:
            n = sum(lengths[a:b])
            cu = torch.tensor([0] + lengths[a:b], device=x.device).cumsum(0)
            rows = None if state is None else {key: t[a:b] for key, t in state.items()}
            y, st = self.forward(x[:, s:s + n], rows, cu_seqlens=cu) if b - a > 1 else self.forward(x[:, s:s + n], rows)
            ys.append(y)
            states.append(st)
            s += n
        return torch.cat(ys, 1), {key: torch.cat([st[key] for st in states], 0) for key in states[0]}

    def mix(self, x, state, seq):
        """The layer's equations: x (B, T, d_model), its state or None, the sequence backend -> (y, state)."""
        raise NotImplementedError

    def short_conv(self, x, state, seq, key: str = "conv", activation: str | None = None):
        """The layer's ``self.conv`` (a ``ShortConv``) over x with the state's tail ``state[key]``; ``activation``
        ("silu") after it, in the same pass where the convolution runs in C."""
        conv = self.conv if activation is None else Activated(self.conv, activation)
        return seq.causal_conv(conv, x, self.conv.kernel_size - 1, None if state is None else state[key])

    def conv_projections(self, parts, state, seq):
        """The optional short convolution of linear attention, retention and GLA (``conv_size``; fla's
        ``use_short_conv``, Zoology's short convolution before every attention-like mixer): silu(conv(.)) over
        the concatenated projections ``parts`` (each (B, T, width)), split back. Returns (parts, conv state);
        without ``self.conv`` the parts pass through and the conv state is None."""
        if getattr(self, "conv", None) is None:
            return parts, None
        y, conv = self.short_conv(torch.cat(parts, -1), state, seq, activation="silu")
        return list(y.split([p.shape[-1] for p in parts], -1)), conv

    def with_conv(self, state, conv=None, batch_size=None, device=None, dtype=torch.float32):
        """``state`` plus the optional convolution's tail under "conv": ``conv`` (from ``conv_projections``),
        or with ``batch_size`` an empty one; unchanged for a layer without ``self.conv``."""
        if getattr(self, "conv", None) is not None and batch_size is not None:
            conv = self.conv.empty_state(batch_size, device, dtype)
        if conv is not None:
            state["conv"] = conv
        return state

    @staticmethod
    def zeros(*shape, device=None, dtype=torch.float32) -> torch.Tensor:
        """A recurrent state's zeros: float32 for every dtype but float64 (``state_dtype``)."""
        return torch.zeros(*shape, device=device, dtype=state_dtype(dtype))

    def empty_state(self, batch_size: int, device=None, dtype=torch.float32) -> dict:
        raise NotImplementedError

    def state_bytes(self, state) -> int:
        return tensor_bytes(state)
