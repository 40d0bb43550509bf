"""Mamba block (Gu & Dao 2023, arXiv:2312.00752): a selective SSM between a short conv and a gate.

    x, z  = in_proj(input)                              (B, T, d_inner) each, d_inner = expand * d_model
    x     = silu(conv1d(x))                          depthwise, kernel 4, its own decoding state
    dt, B, C = x_proj(x)                             dt (dt_rank), B and C (N)
    dt    = softplus(dt_proj(dt))                    (B, T, d_inner), bias initialised so dt ~ logU[1e-3, 0.1]
    A     = -exp(A_log)                              S4D-real init: A[d, n] = -(n + 1)
    (Falcon-Mamba: dt, B, C = rms(dt), rms(B), rms(C), weightless; Jamba: the same norms with weights)
    (Zamba: ``heads`` > 1 splits d_inner into heads of d_inner / heads channels, each with its own x_proj and
    dt_proj, so its own dt, B and C: one scan per head)
    y     = selective_scan(x, dt, A, B, C, D=D, z=z) h_t = exp(dt A) h + dt B x;  y = C.h + D x, * silu(z)
    out   = out_proj(y)
"""

from __future__ import annotations

import math
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from subquad import kernels
from subquad.kernels import qgemv
from subquad.layers.base import Mixer
from subquad.layers import sequence
from subquad.layers.conv import ShortConv
from subquad.layers.linear import C_ROWS, Linear
from subquad.layers.norm import RMSNorm
from subquad.layers.rollback import PerToken
from subquad.layers.sequence import SingleDevice
from subquad.ops import selective_scan
from subquad.ops.mamba import fused_block, fused_scan, fused_step
from subquad.ops.common.checks import state_dtype


def kernel_weight(lin, rows: int):
    """A projection as the block kernels read it for ``rows`` rows (``kernels.qgemv.proj_args``), or None:
    a float32-able ``Linear``'s weight stored row- or column-major; (q, scale, 2, 0) of an int8 one per output
    channel (``models.quant.Int8Linear``) of an input width that is a multiple of 32, for at most
    ``kernels.qgemv.block_int8q_rows()`` rows, and beyond, up to ``AMX_ROWS``, (its AMX tiles, scale, 9, 0) where
    the CPU has them or AVX-512 VNNI (``qgemv.packed_int8``) and the width is a multiple of 64; (q, scale, 6 or 7,
    groups) of one per block without offsets (a GGUF file's Q8_0 / Q6_K matrices: 7 with x rounded per block
    where ``kernels.qgemv.rounds_x`` says, for ``ROUNDED_ROWS``, 6 x exact, for ``INT8_ROWS``) and (q, scale, 8,
    groups) of Q4_0's packed nibbles, for ``ROUNDED_ROWS``; (w, scale_zero, 2 + layout, groups) of an
    ``Int4Linear`` packed for torch's kernel, for at most ``INT4_ROWS`` rows (more: the libraries' int8 and int4
    products are faster, qgemv.py); (w, None, 10, tiles) of a ``Bf16Linear`` without a bias, for
    ``BF16_ROWS``, where ``kernels.qgemv.bf16()`` offers its kernel; (w, None, 11, 0) of an ``F16Linear``, for
    ``F16_ROWS``, where ``kernels.qgemv.f16()`` does."""
    if type(lin) in (nn.Linear, Linear):
        return lin.weight if fused_block.layout(lin.weight) else None
    q, scale = getattr(lin, "q", None), getattr(lin, "scale", None)
    if isinstance(q, torch.Tensor) and q.dtype == torch.uint8 and q.is_cpu and q.is_contiguous():   # Q4_0's bytes
        ok = scale.is_contiguous() and rows <= qgemv.ROUNDED_ROWS and qgemv.rounds_x(q, scale, None)
        return (q, scale, 8, scale.shape[1]) if ok else None
    if isinstance(q, torch.Tensor) and q.dtype == torch.int8 and q.is_cpu and q.is_contiguous():
        if scale.dim() == 1 and q.shape[1] % 32 == 0 and rows <= qgemv.block_int8q_rows():
            return q, scale, 2, 0
        if scale.dim() == 1 and q.shape[1] % 64 == 0 and rows <= qgemv.AMX_ROWS and qgemv.packed_int8() \
                and hasattr(lin, "key_id"):
            return qgemv.amx_packed(q, lin.key_id), scale, 9, 0
        if scale.dim() == 2 and lin.offset is None and scale.is_contiguous():        # a GGUF file's Q8_0 / Q6_K
            rounds = qgemv.rounds_x(q, scale, None)
            if rows <= (qgemv.ROUNDED_ROWS if rounds else qgemv.INT8_ROWS):
                return q, scale, 7 if rounds else 6, scale.shape[1]
        return None
    w, sz = getattr(lin, "w", None), getattr(lin, "scale_zero", None)
    if isinstance(w, torch.Tensor) and w.dtype == torch.bfloat16 and sz is None:       # models.quant.Bf16Linear
        ok = lin.bias is None and w.is_cpu and w.is_contiguous() and w.shape[1] % 32 == 0 \
            and rows <= qgemv.BF16_ROWS and qgemv.bf16()
        return (w, None, 10, int(rows >= qgemv.BF16_TILE_ROWS and qgemv.bf16() == 2)) if ok else None
    if isinstance(w, torch.Tensor) and w.dtype == torch.float16 and sz is None:        # models.quant.F16Linear
        ok = w.is_cpu and w.is_contiguous() and qgemv.f16() and w.shape[1] % qgemv.f16() == 0 \
            and rows <= qgemv.F16_ROWS
        return (w, None, 11, 0) if ok else None
    if isinstance(sz, torch.Tensor) and getattr(lin, "layout", 0) and w.is_cpu and rows <= qgemv.INT4_ROWS:
        return w, sz, 2 + lin.layout, sz.shape[0]
    return None


def block_projections(mixer, h, norm):
    """(norm weight, in_proj's weight and bias, out_proj's weight and bias) where a pre-norm block's decoding step
    may run in one C call (``fused_block`` of Mamba and Mamba-2), else None: never while compiling (inductor fuses
    the block itself; tested before any size, so no guard on the batch), a plain RMSNorm without a bias, at most
    ``layers.linear.C_ROWS`` rows, projections the kernels read (``kernel_weight``: float32, int8 or int4).
    The kernel's own ``usable`` checks dtypes, devices and gradients (``checked`` gives it what to check)."""
    if torch.compiler.is_compiling():
        return None
    wi, wo = mixer.in_proj, mixer.out_proj
    if not (type(norm) is RMSNorm and h.shape[0] <= C_ROWS and h.shape[-1] == mixer.d_model):
        return None
    nw, w_in, w_out = norm.weight, kernel_weight(wi, h.shape[0]), kernel_weight(wo, h.shape[0])
    if nw is None or norm.bias is not None or w_in is None or w_out is None:
        return None
    return nw, w_in, wi.bias, w_out, wo.bias


_PLANS = kernels.KeptCalls()                                        # mixer -> {(rows, tokens): BlockStep}
STACKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()    # blocks -> {rows: models.stack's plan}


_DT_COLUMNS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Mamba layer -> dt_proj's column-major copy


def dt_columns(layer, w: torch.Tensor) -> torch.Tensor:
    """dt_proj's weight w (D, R) with the same values stored column-major (a (D, R) view of an (R, D) tensor), for
    the block kernel: its dt_proj then sums 32 channels a vector over the ranks instead of a dot per channel and
    row (``kernels/mamba_step.c``; 24 Mamba-1 steps at 16 rows ~1.5 ms less: benchmarks/RESULTS.md). Made once per
    storage and version of w and kept beside the layer (a weak mapping; ``kernels.derived``), so a kept call
    holding it is valid while w is; w itself where it is already column-major."""
    if w.stride(0) == 1:
        return w
    return kernels.derived(_DT_COLUMNS, layer, w, lambda t: t.detach().t().contiguous().t())


def planned_block(mixer, h, norm, state, kernel, build):
    """A pre-norm block's decoding step through a ``BlockStep`` kept for the mixer and the batch size: ``build(h,
    norm, state)`` makes one where every check passes (``block_projections``, the layer's ``_fusable``; None where
    it does not apply) the first time, and again whenever a module or tensor it read has changed
    (``kernels.Held``); later tokens check only what changes between tokens - not compiling, h and the state as
    ``kernels.usable`` wants them, the sequence backend (the block checks hooks) -, ~10 us against the ~80 of
    the checks and argument conversion (benchmarks/RESULTS.md) -> (h', new state) or None. Kept per rows and
    tokens: one token under ``SingleDevice`` (decoding), or T > 1 under ``layers.rollback.PerToken`` (a
    verification; Mamba's and Mamba-2's ``TokensStep``: the state after every token). Kept outside the module (a weak
    mapping), so copies and pickles of a model carry none."""
    if torch.compiler.is_compiling():                # before any size is read: no guard on the batch
        return None
    if type(sequence.backend()) is not block_backend(h.shape[1]):     # a prompt, another backend: the modules
        return None
    got = _PLANS.get(mixer, norm, tuple(h.shape[:2]), lambda: build(h, norm, state))
    if got is None:
        return None
    _, step, kept = got
    if kept and (state is None or not kernels.usable(kernel, h if h.shape[1] == 1 else h[:, :1], state["ssm"],
                                                     state["conv"])):
        return None
    h, conv, ssm = step(h, state["conv"], state["ssm"])
    return h, {"ssm": ssm, "conv": conv}


def kept_plan(mixer, norm, rows: int):
    """(``kernels.Held``, step) that ``planned_block`` keeps for ``mixer`` after ``norm`` at ``rows`` rows of one
    token, or None where it keeps none (``models.stack`` puts consecutive ones in one call)."""
    return _PLANS.peek(mixer, norm, (rows, 1))


def block_backend(T: int) -> type:
    """The sequence backend a block's one call runs under: ``SingleDevice`` for one token (decoding), ``PerToken``
    for T > 1 (a verification's tokens, each token's state kept)."""
    return SingleDevice if T == 1 else PerToken


def forget_block_steps(model) -> None:
    """Drop the calls kept for ``model``'s layers (``kernels.KeptCalls``: ``planned_block``'s, the MLPs' and
    attention layers') and ``models.stack``'s plans of its blocks, and with them their references to the
    weights: ``quantize`` and ``decode_layout`` replace the weights, whose old copies would otherwise stay alive
    until the next decoding step finds the kept steps stale."""
    kernels.KeptCalls.forget(model.modules())
    for m in model.modules():
        STACKS.pop(m, None)


def _float_or_int8(lin) -> bool:
    """Whether the fused kernels may read ``lin``'s weight as float32: a ``Linear``, or an int8 one (a GGUF Q8_0
    file's x_proj), whose ``weight`` is its dequantised copy - made once for a kept block step, per token for the
    layer's own step (~50 us at mamba-130m's x_proj: far less than the op-by-op step it replaces)."""
    return isinstance(lin, nn.Linear) or (getattr(lin, "q", None) is not None and hasattr(lin, "dequantized"))


def checked(proj) -> list:
    """``block_projections``'s tensors that must be float32 (a quantised weight's own are checked in
    ``kernel_weight``)."""
    return [p for p in proj if not isinstance(p, tuple)]


class Mamba(Mixer):
    """Mamba (S6): h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t, y_t = C_t h_t + D x_t, gated by silu(z).

    Args: d_model; d_state N; conv_size (the short convolution's width); expand (d_inner = expand d_model);
    dt_rank (default ceil(d_model / 16)); dt_min, dt_max (dt's initial range); bcdt_rms_eps (Falcon-Mamba:
    an RMS norm on dt, B and C after x_proj, with this epsilon; None: none); bcdt_rms_weight (Jamba: those
    norms have learned weights, ``dt_norm``, ``b_norm``, ``c_norm``; Falcon-Mamba's have none); heads (Zamba's
    multi-head Mamba: d_inner in ``heads`` groups of channels, each with its own projections to dt, B and C -
    ``x_proj_weight`` (heads, dt_rank + 2N, d_inner / heads), ``dt_proj_weight`` (heads, d_inner / heads,
    dt_rank), ``dt_proj_bias`` (heads, d_inner / heads) in place of ``x_proj`` and ``dt_proj``); mode; chunk_size.
    State: {"ssm": (B, d_inner, N) float32 (float64 for float64), "conv": (B, conv_size - 1, d_inner)}.
    """
    piece_size = 2048   # fixed state: long forwards run in pieces (base.Mixer.forward); bench_pieces.py's best

    @property
    def per_token_states(self) -> bool:
        """Whether under ``layers.rollback.PER_TOKEN`` its scan keeps every token's state in one call (the C kernel,
        ``ops.mamba.fused_scan``: float32 on the CPU, kernels on and built), so that an eager verification keeps
        states rather than replaying (``models.speculative.verify``); elsewhere the per-token loop would be slower."""
        return self.A_log.dtype == torch.float32 and self.A_log.is_cpu and kernels.enabled() \
            and fused_scan.KERNEL.available()

    def __init__(self, d_model: int, d_state: int = 16, conv_size: int = 4, expand: int = 2, dt_rank: int | None = None,
                 dt_min: float = 1e-3, dt_max: float = 0.1, bcdt_rms_eps: float | None = None,
                 bcdt_rms_weight: bool = False, heads: int = 1, mode: str = "chunk", chunk_size: int = 64):
        super().__init__(d_model, mode, chunk_size)
        self.d_inner, self.d_state = expand * d_model, d_state
        if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1 or self.d_inner % heads:
            raise ValueError(f"heads must be a positive int dividing d_inner={self.d_inner}, got {heads!r}")
        if heads > 1 and bcdt_rms_eps is not None:
            raise ValueError("heads > 1 (Zamba's multi-head Mamba) takes no bcdt_rms_eps norms")
        self.heads = heads
        self.dt_rank = dt_rank or math.ceil(d_model / 16)
        self.bcdt_rms_eps = bcdt_rms_eps
        if bcdt_rms_weight and bcdt_rms_eps is None:
            raise ValueError("bcdt_rms_weight=True needs the norms' epsilon bcdt_rms_eps")
        self.bcdt_norms = nn.ModuleDict({n: RMSNorm(dim, bcdt_rms_eps) for n, dim in
                                         (("dt_norm", self.dt_rank), ("b_norm", d_state), ("c_norm", d_state))}
                                        ) if bcdt_rms_weight else None
        self.in_proj = nn.Linear(d_model, 2 * self.d_inner, bias=False)
        self.conv = ShortConv(self.d_inner, conv_size)
        self.x_proj = nn.Linear(self.d_inner, self.dt_rank + 2 * d_state, bias=False)
        self.dt_proj = nn.Linear(self.dt_rank, self.d_inner, bias=True)
        nn.init.uniform_(self.dt_proj.weight, -self.dt_rank ** -0.5, self.dt_rank ** -0.5)
        dt = torch.exp(torch.rand(self.d_inner) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        with torch.no_grad():
            self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))         # inverse softplus
        self.dt_proj.keep_init = True      # a model's generic re-initialisation must leave this alone
        if heads > 1:                      # the same initialisation, held per head (Zamba's layout)
            hd = self.d_inner // heads
            self.x_proj_weight = nn.Parameter(torch.randn(heads, self.dt_rank + 2 * d_state, hd) * hd ** -0.5)
            self.dt_proj_weight = nn.Parameter(self.dt_proj.weight.detach().view(heads, hd, self.dt_rank).clone())
            self.dt_proj_bias = nn.Parameter(self.dt_proj.bias.detach().view(heads, hd).clone())
            self.x_proj = self.dt_proj = None
        self.A_log = nn.Parameter(torch.log(torch.arange(1, d_state + 1, dtype=torch.float32)).repeat(self.d_inner, 1))
        self.D = nn.Parameter(torch.ones(self.d_inner))
        self.A_log._no_weight_decay = self.D._no_weight_decay = True     # the reference's marks (decay_groups)
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=False)
        self.register_load_state_dict_post_hook(kernels.loaded_in_place)    # dt_columns' copy made again

    def mix_flops(self, T):
        """The write dt B x and the read C . h per channel, N states each."""
        return 4.0 * self.d_inner * self.d_state

    def empty_state(self, batch_size, device=None, dtype=torch.float32):
        return {"ssm": self.zeros(batch_size, self.d_inner, self.d_state, device=device, dtype=dtype),
                "conv": self.conv.empty_state(batch_size, device, dtype)}

    def _step_weights(self):
        """What the fused kernels read besides the state: (conv weight, conv bias, x_proj's, dt_proj's weights and
        dt's bias (``_dt_weights``), A_log, D)."""
        conv = self.conv
        return (conv.weight, conv.bias, *self._dt_weights(), self.A_log, self.D)

    def _fusable(self, kernel, x, state, seq, *tensors, backend=SingleDevice) -> bool:
        """Whether one decoding token may take ``kernel`` (the layer's step or its block's, float32 on the CPU, no
        gradient; ``kernels.usable``) with ``tensors`` (the layer's ``_step_weights`` and any others); ``backend``:
        the sequence backend it runs under (``PerToken`` for a verification's tokens)."""
        return state is not None and self.bcdt_rms_eps is None and type(seq) is backend \
            and (self.heads > 1 or _float_or_int8(self.x_proj) and isinstance(self.dt_proj, nn.Linear)) \
            and kernels.usable(kernel, x, state["ssm"], state["conv"], *tensors)

    def fused_block(self, h, norm, state):
        """A pre-norm block's whole decoding step, h + mix(norm(h)), in one call (``ops.mamba.fused_block``):
        h (B, 1, d_model) -> (h', new state), or None where it does not apply (``block_projections``, or what
        keeps the layer's own fused step from running). Under ``layers.rollback.PerToken`` (a verification), h
        (B, T, d_model) -> (h', the states after every token) the same way (``TokensStep``). The call is kept
        between tokens (``planned_block``)."""
        return planned_block(self, h, norm, state, fused_block.KERNEL, self._block_step)

    def _block_step(self, h, norm, state):
        """``fused_block``'s ``ops.mamba.fused_block.BlockStep`` for h's rows (``TokensStep`` for T > 1 tokens
        each), or None where it does not apply."""
        B, T, d = h.shape
        proj = block_projections(self, h.reshape(B * T, 1, d), norm)          # the products' rows: B T
        if proj is None:
            return None
        conv_w, conv_b, wx, wdt, bdt, A_log, Dp = weights = self._step_weights()
        if not self._fusable(fused_block.KERNEL, h[:, :1], state, sequence.backend(), *weights, *checked(proj),
                             backend=block_backend(T)):
            return None
        nw, w_in, b_in, w_out, b_out = proj
        if self.heads == 1:
            wdt = dt_columns(self, wdt)
        weights = (nw, norm.eps, w_in, b_in, w_out, b_out, conv_w, conv_b, wx, wdt, bdt, A_log, Dp)
        step = fused_block.BlockStep(B, *weights) if T == 1 else fused_block.TokensStep(T, B, *weights)
        if self.heads == 1 and not isinstance(self.x_proj, nn.Linear):
            step.tensors = [t for t in step.tensors if t is not wx]  # a dequantised copy: Held checks its codes
        return step

    def mix(self, x, state, seq):
        if self._fusable(fused_step.KERNEL, x, state, seq, *self._step_weights()):
            return self._fused_step(x, state)       # one decoding token: the kernel (float32 CPU, no gradient)
        xs, z = self.in_proj(x).chunk(2, dim=-1)
        xs, conv = self.short_conv(xs, state, seq, activation="silu")
        if self.heads > 1:
            return self._mix_heads(xs, z, state, seq, conv)
        dt, Bm, Cm = torch.split(self.x_proj(xs), [self.dt_rank, self.d_state, self.d_state], dim=-1)
        if self.bcdt_norms is not None:                                    # Jamba
            n = self.bcdt_norms
            dt, Bm, Cm = n["dt_norm"](dt), n["b_norm"](Bm), n["c_norm"](Cm)
        elif self.bcdt_rms_eps is not None:                                # Falcon-Mamba
            dt, Bm, Cm = (_weightless_rms(t, self.bcdt_rms_eps) for t in (dt, Bm, Cm))
        A = -torch.exp(self.A_log.to(state_dtype(xs.dtype)))                 # (d_inner, N) < 0
        y, h = seq.recurrence(selective_scan, xs, self.dt_proj(dt), A, Bm, Cm, D=self.D.to(xs.dtype), z=z,
                              delta_softplus=True, mode=self.mode, chunk_size=self.chunk_size,
                              initial_state=None if state is None else state["ssm"])    # dt = softplus(dt_proj)
        return self.out_proj(y), {"ssm": h, "conv": conv}

    def _dt_weights(self):
        """x_proj's and dt_proj's weights and dt's bias (Zamba's per-head tensors with heads > 1)."""
        if self.heads > 1:
            return self.x_proj_weight, self.dt_proj_weight, self.dt_proj_bias
        return self.x_proj.weight, self.dt_proj.weight, self.dt_proj.bias

    def _fused_step(self, x, state):
        """One token through ``ops.mamba.fused_step`` (the same math as ``mix``'s ops, in one call)."""
        wx, wdt, bdt = self._dt_weights()
        y, conv, h = fused_step.mamba_step(self.in_proj(x), state["conv"], self.conv.weight, self.conv.bias, wx, wdt,
                                           bdt, self.A_log, self.D, state["ssm"])
        return self.out_proj(y[:, None]), {"ssm": h, "conv": conv}

    def _mix_heads(self, xs, z, state, seq, conv):
        """Zamba's multi-head Mamba: head j's channels xs[..., j hd:(j + 1) hd] get their own dt, B and C and
        their own scan (the scans share nothing but the convolution before and out_proj after)."""
        Hm, hd = self.heads, self.d_inner // self.heads
        xh = xs.unflatten(-1, (Hm, hd))                                     # (B, T, Hm, hd)
        p = torch.einsum("bthd,hrd->bthr", xh, self.x_proj_weight.to(xs.dtype))
        dt, Bm, Cm = torch.split(p, [self.dt_rank, self.d_state, self.d_state], dim=-1)    # (B, T, Hm, .)
        dt = F.softplus(torch.einsum("bthr,hdr->bthd", dt, self.dt_proj_weight.to(xs.dtype))
                        + self.dt_proj_bias.to(xs.dtype)).flatten(-2)           # (B, T, d_inner)
        A = -torch.exp(self.A_log.to(state_dtype(xs.dtype)))                 # (d_inner, N) < 0
        D = self.D.to(xs.dtype)
        ys, hs = [], []
        for j in range(Hm):
            c = slice(j * hd, (j + 1) * hd)
            y, h = seq.recurrence(selective_scan, xs[..., c], dt[..., c], A[c], Bm[:, :, j], Cm[:, :, j], D=D[c],
                                  z=z[..., c], mode=self.mode, chunk_size=self.chunk_size,
                                  initial_state=None if state is None else state["ssm"][:, c])
            ys.append(y)
            hs.append(h)
        return self.out_proj(torch.cat(ys, -1)), {"ssm": torch.cat(hs, -2), "conv": conv}


def _weightless_rms(x, eps):
    """x / rms(x) over the last dim, computed in float32 (Falcon-Mamba's norm on dt, B and C)."""
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
