"""Sparse mixture-of-experts SwiGLU MLP with top-k routing (Shazeer et al. 2017; Mixtral; Jamba).

    p      = softmax(x W_r^T)                          (N, E) router probabilities, at least float32
    S, w   = top_k(p)                                  each token's k experts and their probabilities
                                                       (renormalised to sum 1 with ``renormalize``, as
                                                       Mixtral; Jamba keeps them as they are)
    y      = sum_{e in S} w_e * W_down_e (silu(W_gate_e x) * W_up_e x)

Full capacity: no token is dropped. Each expert runs one matmul over the tokens routed to it
(``_dispatch``) - a loop whose shapes depend on the routing. Inside a compiled graph that loop is the custom
op ``subquad::moe_experts`` (x, weights, choices -> y, shapes known from x alone), so the graph holds it at
any batch instead of breaking around it; for the few rows of a decoding step (rows * k <= 4 E: ``GATHER``) each row
instead reads its k experts' weights by index (``_gathered``): the same sum in plain tensor ops, which
inductor fuses into one reduction per projection that reads the chosen weights in place. A compiled model
that trains (gradients on) runs the loop eagerly, outside the graph: the op has no backward.

With ``shared`` > 0 a dense SwiGLU of that width runs on every token beside the routed experts, scaled by
a learned sigmoid gate (Qwen2-MoE / Qwen3-Next: y += sigmoid(x W_sg^T) * shared(x)) or not (``shared_gate``
False: DeepSeek-V3, Kimi Linear).

``router="sigmoid"`` is DeepSeek-V3's routing (Kimi Linear): s = sigmoid(x W_r^T); experts are chosen by
s + b (``score_bias``, a buffer the checkpoint carries: the auxiliary-loss-free balancing bias), first the
``topk_groups`` best of ``groups`` expert groups (a group's score: its two best), then the top k inside
them; the weights are s of the chosen (renormalised with ``renormalize``: w / (sum w + ``renorm_eps``)) times
``scale``. Its load-balancing
statistics use softmax(x W_r^T), as transformers' auxiliary loss does for every router.

The router's load-balancing loss (Switch Transformer, eqs. 4-6), over all MoE layers of a forward as
transformers' ``load_balancing_loss_func`` computes it (one pool of L * N router rows):

    f_e = (choices of expert e, each token counting k) / (L N),   P_e = sum of p_e / (L N)
    aux = E * sum_e f_e P_e                                        (= k at a uniform router)

``aux`` reaches its minimum when routing is uniform; the trainer adds ``aux_loss_coef * aux`` to the loss.

``kind="relu2"`` makes the experts, and the shared expert, ungated squared-ReLU MLPs (Nemotron-H's MoE layers):
y_e = W_down_e relu(W_up_e x)^2, no ``w_gate``. ``latent`` (Nemotron-H's ``moe_latent_size``) runs the routed
experts in a narrower space: x -> W_in x (latent wide) -> the experts' weighted sum -> W_out (back to d_model);
the router and the shared expert read x itself.
"""

from __future__ import annotations

import itertools
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from subquad.layers.linear import linear
from subquad.layers.mlp import ReLU2MLP, SwiGLU
from subquad.ops.common.precision import outside_graphs

KINDS = {"swiglu": ("w_gate", "w_up", "w_down"), "relu2": ("w_up", "w_down")}    # an expert's projections

# a compiled step reads each row's experts by index up to GATHER * E choices (rows * k), the routed loop beyond:
# measured at 64 experts of 256 x 1,024, top 8, 2 threads, AMD EPYC (benchmarks/RESULTS.md): by index 2.4-10x
# faster up to 4 E choices, level at 8 E, slower past it
GATHER = 4
_keys = itertools.count()
_LAYERS: dict[int, weakref.ref] = {}        # key -> the MoE layer ``subquad::moe_experts`` runs


class MoE(nn.Module):
    """x (..., d_model) -> (..., d_model). Weights: ``router`` (E, d_model), ``w_gate`` (``kind`` "swiglu"
    only) and ``w_up`` (E, hidden, D_e), ``w_down`` (E, D_e, hidden) - D_e is ``latent`` when given, with
    ``latent_in`` (latent, d_model) and ``latent_out`` (d_model, latent), else d_model; with ``shared``,
    ``shared`` (a SwiGLU, or a ``ReLU2MLP`` for "relu2") and ``shared_gate`` (1, d_model). After each forward
    ``router_stats`` holds (choices per expert (E,), sum of router probabilities per expert (E,), rows) for
    the auxiliary loss."""

    def __init__(self, d_model: int, hidden: int, experts: int, top_k: int = 2, renormalize: bool = False,
                 shared: int = 0, shared_gate: bool = True, router: str = "softmax", groups: int = 1,
                 topk_groups: int = 1, scale: float = 1.0, renorm_eps: float = 1e-20, kind: str = "swiglu",
                 latent: int | None = None):
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
        if not 1 <= top_k <= experts:
            raise ValueError(f"top_k={top_k} must lie in [1, experts={experts}]")
        if router not in ("softmax", "sigmoid"):
            raise ValueError(f"router must be 'softmax' or 'sigmoid', got {router!r}")
        if experts % groups or not 1 <= topk_groups <= groups:
            raise ValueError(f"groups={groups} must divide experts={experts} and topk_groups={topk_groups} lie in "
                             f"[1, groups]")
        self.experts, self.top_k, self.renormalize = experts, top_k, renormalize
        self.router_kind, self.groups, self.topk_groups, self.scale = router, groups, topk_groups, scale
        self.renorm_eps = renorm_eps        # sigmoid routing's renormalisation: w / (sum w + eps) (LFM2-MoE: 1e-6)
        if router == "sigmoid":
            self.register_buffer("score_bias", torch.zeros(experts))
        self.kind, self.projections = kind, KINDS[kind]
        self.router = nn.Linear(d_model, experts, bias=False)
        self.latent_in = self.latent_out = None
        if latent is not None:
            self.latent_in = nn.Linear(d_model, latent, bias=False)
            self.latent_out = nn.Linear(latent, d_model, bias=False)
        width = d_model if latent is None else latent                  # the experts' input and output width
        if kind == "swiglu":
            self.w_gate = nn.Parameter(torch.randn(experts, hidden, width) * 0.02)
        self.w_up = nn.Parameter(torch.randn(experts, hidden, width) * 0.02)
        self.w_down = nn.Parameter(torch.randn(experts, width, hidden) * 0.02)
        self.router_stats = None
        self._name_for_op()
        self.shared, self.shared_gate = None, None
        if shared:
            self.shared = SwiGLU(d_model, shared) if kind == "swiglu" else ReLU2MLP(d_model, shared)
            self.shared_gate = nn.Linear(d_model, 1, bias=False) if shared_gate else None

    def route(self, x):
        """x (N, d_model) -> (probabilities (N, E) float32, top-k weights (N, k), top-k experts (N, k)). A router
        held in another dtype than x (a checkpoint that keeps it in float32, as transformers' Nemotron-H and
        DeepSeek-V3 do, read without a dtype) computes the logits in its own."""
        w = self.router.weight if isinstance(self.router, nn.Linear) else None    # None: quantised (models.quant)
        logits = self.router(x) if w is None or w.dtype == x.dtype else F.linear(x.to(w.dtype), w)
        probs = torch.softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))
        if self.router_kind == "softmax":
            w, idx = probs.topk(self.top_k, dim=-1)
            if self.renormalize:
                w = w / w.sum(-1, keepdim=True)
            return probs, w * self.scale if self.scale != 1.0 else w, idx
        scores = torch.sigmoid(logits.to(probs.dtype))
        choice = scores + self.score_bias.to(scores.dtype)
        if self.groups > 1:
            per = self.experts // self.groups
            best = choice.view(-1, self.groups, per).topk(min(2, per), dim=-1)[0].sum(-1)     # (N, groups)
            keep = torch.zeros_like(best, dtype=torch.bool).scatter_(1, best.topk(self.topk_groups, dim=-1)[1], True)
            choice = choice.masked_fill(~keep.repeat_interleave(per, dim=1), float("-inf"))
        idx = choice.topk(self.top_k, dim=-1)[1]
        w = scores.gather(1, idx)
        if self.renormalize:
            w = w / (w.sum(-1, keepdim=True) + self.renorm_eps)
        return probs, w * self.scale, idx

    def _expert(self, name: str, e: int, h):
        """h @ W_e^T for expert e's projection ``name`` (one of ``projections``): its quantised module when
        ``quantize_experts`` made them, else ``layers.linear.linear`` - a few float32 rows of an inference step
        through the C product (W_e is a row-major (out, in) slice; the matmul of its transposed view took a
        Granite-4-like model's decoding step 1.3x the time: benchmarks/RESULTS.md)."""
        q = getattr(self, "quantized_experts", None)
        return linear(h, getattr(self, name)[e]) if q is None else q[name][e](h)

    def quantize_experts(self, make):
        """Replace the stacked expert weights by one module per expert and projection, ``make(W_e)`` (an
        inference-only model: ``models.quant``)."""
        self.quantized_experts = nn.ModuleDict({n: nn.ModuleList(make(w) for w in getattr(self, n).detach())
                                                for n in self.projections})
        for n in self.projections:
            delattr(self, n)
            self.register_buffer(n, None)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs, w, idx = self.route(x)
        flat = idx.reshape(-1)                                   # (N k,) choice j belongs to token j // k
        counts = flat.new_zeros(self.experts).scatter_add_(0, flat, torch.ones_like(flat))   # bincount, static shape
        self.router_stats = (counts.to(probs.dtype), probs.sum(0), x.shape[0])
        h = x if self.latent_in is None else self.latent_in(x)
        if not torch.compiler.is_compiling():
            out = self._dispatch(h, w.reshape(-1), flat, counts)
        elif getattr(self, "quantized_experts", None) is None and x.shape[0] * self.top_k <= GATHER * self.experts:
            out = self._gathered(h, w, idx)
        elif torch.is_grad_enabled():
            out = self._dispatch_outside(h, w.reshape(-1), flat, counts)
        else:
            out = torch.ops.subquad.moe_experts(h, w.reshape(-1), flat, counts, self._op_key)
        if self.latent_out is not None:
            out = self.latent_out(out)
        if self.shared is not None:
            y = self.shared(x)
            out = out + (y if self.shared_gate is None else torch.sigmoid(self.shared_gate(x)) * y)
        return out.reshape(shape)

    def _gathered(self, x, w, idx):
        """``_dispatch``'s sum from each row's own k experts: x (N, D_e), w and idx (N, k) -> (N, D_e). Written
        as products and sums over weights indexed by idx, not as matmuls of gathered copies, so inductor
        reads each chosen expert's weights once without copying them (for the few rows of a decoding step;
        eagerly it would materialise N k weight copies)."""
        def proj(name, h):                          # (N, k, out, in) weights by index, applied to h (N, [k,] in)
            W = getattr(self, name)[idx]
            return (W * (h[:, None, None, :] if h.dim() == 2 else h[:, :, None, :])).sum(-1)

        if self.kind == "swiglu":
            y = F.silu(proj("w_gate", x)) * proj("w_up", x)
        else:
            y = F.relu(proj("w_up", x)).square()
        y = proj("w_down", y) * w.to(y.dtype).unsqueeze(-1)        # (N, k, D_e)
        return y.sum(1)

    def _name_for_op(self):
        """A 0-d tensor naming this layer to ``subquad::moe_experts`` (``_LAYERS`` holds the layer weakly); a
        copy (deepcopy, pickle: ``__setstate__``) gets a name of its own."""
        n = next(_keys)
        _LAYERS[n] = weakref.ref(self)
        weakref.finalize(self, _LAYERS.pop, n, None)
        self._op_key = torch.tensor(n)

    def __setstate__(self, state):
        super().__setstate__(state)
        self._name_for_op()

    @outside_graphs
    def _dispatch_outside(self, x, w, flat, counts):
        """``_dispatch`` run eagerly outside a compiled graph (a graph break): where gradients flow."""
        return self._dispatch(x, w, flat, counts)

    def _dispatch(self, x, w, flat, counts):
        """sum over each token's chosen experts of w * expert(x): one product per expert over its tokens."""
        order = flat.argsort(stable=True)                        # choices grouped by expert
        out = None
        start = 0
        for e, c in enumerate(counts.tolist()):
            if c == 0:
                continue
            sel = order[start:start + c]
            start += c
            tok = sel // self.top_k
            h = x[tok]
            if self.kind == "swiglu":
                y = F.silu(self._expert("w_gate", e, h)) * self._expert("w_up", e, h)
            else:
                y = F.relu(self._expert("w_up", e, h)).square()
            y = self._expert("w_down", e, y) * w[sel].to(y.dtype).unsqueeze(-1)
            if out is None:
                out = torch.zeros(x.shape, dtype=y.dtype, device=x.device)
            out.index_add_(0, tok, y)
        return torch.zeros_like(x) if out is None else out      # None: no tokens


def moe_experts(x: torch.Tensor, w: torch.Tensor, flat: torch.Tensor, counts: torch.Tensor,
                key: torch.Tensor) -> torch.Tensor:
    """x (N, D_e), w and flat (N k,) (each choice's weight and expert), counts (E,) (choices per expert), key
    naming the layer -> (N, D_e): the layer's ``_dispatch`` (its routed loop), an op a compiled graph holds
    (module doc)."""
    return _LAYERS[int(key)]()._dispatch(x, w, flat, counts)


_LIB = torch.library.Library("subquad", "FRAGMENT")
_LIB.define("moe_experts(Tensor x, Tensor w, Tensor flat, Tensor counts, Tensor key) -> Tensor")
_LIB.impl("moe_experts", moe_experts, "CompositeExplicitAutograd")


@torch.library.register_fake("subquad::moe_experts")
def _(x, w, flat, counts, key):
    return x.new_empty(x.shape)


def load_balancing_loss(stats: list, experts: int) -> torch.Tensor:
    """The auxiliary loss (module doc) from the ``router_stats`` of every MoE layer of one forward."""
    counts = sum(s[0] for s in stats)
    probs = sum(s[1] for s in stats)
    rows = sum(s[2] for s in stats)
    return experts * (counts / rows * probs / rows).sum()
