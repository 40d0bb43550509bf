"""A decoder-only language model whose layers can be any mixer, or a hybrid of them.

    h = embed(idx)
    for each layer:  h = h + mixer(rmsnorm(h));  h = h + swiglu(rmsnorm(h))      (PreNormBlock)
    logits = rmsnorm(h) @ embed^T            (tied embeddings)

Four other residual schemes, chosen by the config: ``PostNormBlock`` for the mixers named in
``config.post_norm`` (OLMo 2's norms on the branch outputs), ``SandwichNormBlock`` with ``config.sandwich_norm``
(norms before and after each branch: LFM3), ``ScaledResidualBlock`` with
``config.scaled_residual`` (MiniMax-01's scaled residual from the normed stream) and ``ParallelBlock`` for
the mixers ``config.parallel`` names (a second mixer beside the first on the same input, summed: Falcon-H1).
``SharedUseBlock`` at the layers ``config.shared`` lists: one of the model's shared transformer blocks
(``models.shared``, ``LanguageModel.shared``) writes into the mixer's input (Zamba2).
``HyperBlock`` in every layer with ``config.hyper`` (``models.hyper``: Qwen4-Exp's hyper-connections, n residual
streams the embedding fills and the final norm mixes back to one, and its per-layer n-gram embeddings, which read
the token ids from ``carry``).
RWKV-7's layout is options of these: ``config.norm="layer"`` (LayerNorms with bias), ``config.embed_norm`` (a norm on the embeddings),
``config.mlp_kind="rwkv7"`` (the channel mix, an MLP with a one-token state, kept in the layer's state under
"mlp.*" beside the mixer's), and the ``carry`` dict each forward hands every block (values that cross layers:
RWKV-7's value residual, ``subquad.layers.base``).

``forward(idx)`` trains with each mixer's configured form (chunk by default, SDPA for softmax); ``prefill``
returns the per-layer state, and ``generate`` (``models.generate``) decodes token by token from it: a KV cache
for softmax layers, a bounded window for sliding-window layers, a fixed-size state for the rest.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from subquad.layers import MIXERS, RMSNorm, build_mixer, sequence, tensor_bytes
from subquad.layers.channel_mix import ChannelMix
from subquad.layers.mlp import ReLU2MLP, SwiGLU, dense_mlp
from subquad.layers.linear import linear, use_linear
from subquad.kernels.fpenv import flush_denormals
from subquad.layers.attention import SoftmaxAttention
from subquad.layers.attention_step import fits as attention_fits, fused_attention, kept_plan as attention_kept_plan
from subquad.layers.mamba import kept_plan
from subquad.layers.mlp_step import fits as mlp_fits, fused_mlp
from subquad.models.config import ModelConfig
from subquad.models.generate import generate
from subquad.models.hyper import PLE, PLE_STATE, TOKENS, HyperConnection
from subquad.models.loss import linear_cross_entropy
from subquad.models.moe import MoE, load_balancing_loss
from subquad.models.mode import decoding
from subquad.models.shared import EMBEDDINGS, SharedTransformer, SharedUse
from subquad.models.stack import stacked_blocks
from subquad.models.token_step import decode_token
from subquad.models.state import ModelState, check_rows
from subquad.ops.common.checks import state_dtype
from subquad.ops.common.precision import checks_on


NORMED_OUTPUT_SCALE = 0.1   # see LanguageModel._init_residual_branches
MLP_STATE = "mlp."          # a stateful MLP's entries in its layer's state dict


def make_norm(cfg: ModelConfig, bias: bool = False) -> nn.Module:
    """The blocks' and the final norm: RMSNorm (with ``bias``, a bias: the blocks' with ``cfg.norm_bias``), or
    LayerNorm with a bias (``cfg.norm == "layer"``: RWKV)."""
    return RMSNorm(cfg.d_model, cfg.norm_eps, bias=bias) if cfg.norm == "rms" else nn.LayerNorm(cfg.d_model,
                                                                                                cfg.norm_eps)


class Block(nn.Module):
    """One layer: ``norm1``, ``mixer``, ``norm2`` and ``mlp`` (``layers.mlp.dense_mlp``: a SwiGLU, GeGLU, squared-ReLU
    MLP or RWKV's channel mix; a mixture of experts; or None - without MLPs, or at a layer ``cfg.mlp_layers``
    leaves out). Each subclass's ``forward(h (B, T, d_model), state, cu_seqlens, carry) -> (h, state)`` is one way the two
    branches meet the residual stream; all share these parameter names, which the checkpoint formats map
    (``models.hf``). ``Block.build`` picks the subclass the config asks for."""

    def __init__(self, cfg: ModelConfig, mixer_name: str, moe: bool = False, mlp: bool = True):
        super().__init__()
        mlp = cfg.mlp and mlp                              # mlp False: this layer is the mixer alone
        opts = {**cfg.mixer_options.get("*", {}), **cfg.mixer_options.get(mixer_name, {})}
        self.mixer_name = mixer_name
        self.norm1 = make_norm(cfg, cfg.norm_bias)
        heads = opts.pop("n_heads", cfg.n_heads)           # a layer's own head count (a MixerEntry with own_heads)
        self.mixer = build_mixer(mixer_name, cfg.d_model, heads, n_kv_heads=cfg.n_kv_heads, **opts)
        self.norm2 = make_norm(cfg, cfg.norm_bias) if mlp else None
        if moe:
            m = cfg.moe
            self.mlp = MoE(cfg.d_model, m["hidden"] or cfg.mlp_hidden, m["experts"], m["top_k"], m["renormalize"],
                           m["shared"], m["shared_gate"], m["router"], m["groups"], m["topk_groups"], m["scale"],
                           m["renorm_eps"], cfg.mlp_kind, m.get("latent"))
        else:
            self.mlp = dense_mlp(cfg) if mlp else None
        self.stateful_mlp = hasattr(self.mlp, "empty_state")

    def empty_state(self, batch_size: int, device=None, dtype=torch.float32) -> dict:
        """The mixer's empty state, and a stateful MLP's under "mlp.*"."""
        state = self.mixer.empty_state(batch_size, device=device, dtype=dtype)
        if self.stateful_mlp:
            state.update({MLP_STATE + k: v for k, v in self.mlp.empty_state(batch_size, device, dtype).items()})
        return state

    def _mix(self, x, state, cu_seqlens, carry):
        """The mixer over x with its part of the layer's state."""
        if state is not None and self.stateful_mlp:
            state = {k: v for k, v in state.items() if not k.startswith(MLP_STATE)}
        return self.mixer(x, state, cu_seqlens=cu_seqlens, carry=carry)

    def _ffn(self, x, state, cu_seqlens, new_state):
        """The MLP over x -> (y, the layer's new state): a stateful MLP reads its part of ``state`` (the layer's
        state before this call) and adds its new part to ``new_state`` (the mixer's after it)."""
        if not self.stateful_mlp:
            return self.mlp(x), new_state
        mine = None if state is None else {k[len(MLP_STATE):]: v for k, v in state.items() if k.startswith(MLP_STATE)}
        y, s = self.mlp(x, mine, cu_seqlens=cu_seqlens)
        if new_state is None or s is None:          # context parallelism: no decoding state
            return y, None
        return y, {**new_state, **{MLP_STATE + k: v for k, v in s.items()}}

    def _mlp_half(self, h, new, state, cu_seqlens):
        """h + mlp(norm2(h)) and the layer's new state (a pre-norm MLP after the mixers' half): at a decoding
        token in one call where it applies (``layers.mlp_step``: a SwiGLU's or ReLU^2's norm, products and
        residual)."""
        if state is not None and cu_seqlens is None and not self.stateful_mlp:
            out = fused_mlp(self.mlp, h, self.norm2)
            if out is not None:
                return out, new
        y, new = self._ffn(self.norm2(h), state, cu_seqlens, new)
        return h + y, new

    @staticmethod
    def build(cfg: ModelConfig, mixer_name: str, moe: bool = False, mlp: bool = True, shared=None,
              layer: int = 0) -> "Block":
        """The block ``cfg`` asks for at a ``mixer_name`` layer: ``ScaledResidualBlock`` with
        ``cfg.scaled_residual``, else ``PostNormBlock`` for a mixer named in ``cfg.post_norm``, else
        ``PreNormBlock`` (``ParallelBlock`` before all for a mixer ``cfg.parallel`` names; ``SharedUseBlock``
        at a layer given the ``shared`` block it uses; ``HyperBlock`` with ``cfg.hyper``, ``layer`` its index)."""
        if cfg.hyper is not None:
            return HyperBlock(cfg, mixer_name, moe, mlp, layer)
        if shared is not None:
            return SharedUseBlock(cfg, mixer_name, moe, mlp, shared)
        if mixer_name in cfg.parallel:
            return ParallelBlock(cfg, mixer_name, moe, mlp)
        if cfg.scaled_residual is not None:
            return ScaledResidualBlock(cfg, mixer_name, moe, mlp)
        if cfg.sandwich_norm:
            return SandwichNormBlock(cfg, mixer_name, moe, mlp)
        if mixer_name in cfg.post_norm:
            return PostNormBlock(cfg, mixer_name, moe, mlp)
        return PreNormBlock(cfg, mixer_name, moe, mlp)


    def mixers(self) -> list:
        """The block's mixers, each once: ``mixer`` (and ``beside`` in a ``ParallelBlock``)."""
        return [self.mixer]

    def state_parts(self) -> list:
        """The modules holding the layer's state, each (module, rollback kind, prefix of its entries in the layer's
        state): the mixers, rolled back as the table declares (``MixerEntry.rollback``; speculative decoding,
        ``layers.rollback``), and a stateful MLP (its ``rollback``, else "replay"), its entries under "mlp."."""
        parts = [(self.mixer, MIXERS[self.mixer_name].rollback, "")]
        kind = getattr(self.mlp, "rollback", "replay")
        return parts + ([(self.mlp, kind, MLP_STATE)] if self.stateful_mlp else [])


def _mixer_call(m, h, norm, state):
    """A pre-norm mixer's half of a decoding step, h + m(norm(h)), as the mixer's one call (``fused_block``:
    Mamba's, Mamba-2's; softmax attention's two, ``layers.attention_step``) -> (h', new state), or None where it
    has none or it does not apply."""
    if hasattr(m, "fused_block"):
        return m.fused_block(h, norm, state)
    return fused_attention(m, h, norm, state) if type(m) is SoftmaxAttention else None


class PreNormBlock(Block):
    """h = h + mixer(rmsnorm(h));  h = h + mlp(rmsnorm(h))  (GPT-2, Llama, Mamba). A decoding step may run the
    mixer's half (norm, mixer, residual) in one call where the mixer offers it (``fused_block``: Mamba's,
    Mamba-2's; softmax attention's in two around its cache's append, ``layers.attention_step``); an MLP (not a
    stateful one) then follows, itself in one call where it is a SwiGLU or ReLU^2 (``layers.mlp_step``: Bamba's,
    Nemotron-H's blocks, attention layers' MLPs)."""

    one_call = True     # its mixer's half may run as the mixer's one call (models.speculative asks)

    def kept_step(self, rows: int):
        """(``kernels.Held``, step) of the mixer's one call kept for ``rows`` rows of one token
        (``layers.mamba.planned_block``; softmax attention's two, ``layers.attention_step``) where this block's
        decoding step is that call, then the MLP's where it has one (``layers.mlp_step``: the stack asks it for its
        own) - no other MLP, no hooks on the block or the mixer, ``forward`` this class's -, else None
        (``models.stack``)."""
        m = self.mixer
        if type(self).forward is not PreNormBlock.forward or self.stateful_mlp \
                or (self.mlp is not None and not mlp_fits(self.mlp, self.norm2)) \
                or self._forward_hooks or self._forward_pre_hooks or m._forward_hooks or m._forward_pre_hooks:
            return None
        if type(m) is SoftmaxAttention:            # its two calls (``layers.attention_step``)
            return attention_kept_plan(m, self.norm1, rows) if attention_fits(m, self.norm1) else None
        return kept_plan(m, self.norm1, rows) if hasattr(m, "fused_block") else None

    def forward(self, h, state=None, cu_seqlens=None, carry=None):
        m = self.mixer
        if state is not None and cu_seqlens is None and not self.stateful_mlp \
                and not (m._forward_hooks or m._forward_pre_hooks):     # (a hook expects the mixer's own call)
            out = _mixer_call(m, h, self.norm1, state)
            if out is not None:
                return out if self.mlp is None else self._mlp_half(*out, state, cu_seqlens)
        y, new = self._mix(self.norm1(h), state, cu_seqlens, carry)
        h = h + y
        if self.mlp is not None:
            return self._mlp_half(h, new, state, cu_seqlens)
        return h, new



class PostNormBlock(Block):
    """h = h + rmsnorm(mixer(h));  h = h + rmsnorm(mlp(h)): the norms on the branches' outputs (OLMo 2,
    arXiv:2501.00656, whose order OLMo-Hybrid's attention layers keep)."""

    def forward(self, h, state=None, cu_seqlens=None, carry=None):
        y, new = self._mix(h, state, cu_seqlens, carry)
        h = h + self.norm1(y)
        if self.mlp is not None:
            y, new = self._ffn(h, state, cu_seqlens, new)
            h = h + self.norm2(y)
        return h, new


class SandwichNormBlock(Block):
    """h = h + rmsnorm(mixer(rmsnorm(h)));  h = h + rmsnorm(mlp(rmsnorm(h))): a norm before and one after each
    branch (Gemma 2's sandwich, arXiv:2408.00118; LFM3's ``use_sandwich_norm``): ``post_norm1``, ``post_norm2``."""

    def __init__(self, cfg: ModelConfig, mixer_name: str, moe: bool = False, mlp: bool = True):
        super().__init__(cfg, mixer_name, moe, mlp)
        self.post_norm1 = make_norm(cfg)
        self.post_norm2 = make_norm(cfg) if self.mlp is not None else None

    def forward(self, h, state=None, cu_seqlens=None, carry=None):
        y, new = self._mix(self.norm1(h), state, cu_seqlens, carry)
        h = h + self.post_norm1(y)
        if self.mlp is not None:
            y, new = self._ffn(self.norm2(h), state, cu_seqlens, new)
            h = h + self.post_norm2(y)
        return h, new


class ScaledResidualBlock(Block):
    """x = rmsnorm(h);  h = a x + b mixer(x), and so for the MLP: the residual is the normed stream, scaled
    (MiniMax-01, arXiv:2501.08313). ``cfg.scaled_residual`` gives (a, b) per mixer name and for "mlp";
    a name it leaves out gets (1, 1)."""

    def __init__(self, cfg: ModelConfig, mixer_name: str, moe: bool = False, mlp: bool = True):
        super().__init__(cfg, mixer_name, moe, mlp)
        sr = cfg.scaled_residual
        self.mixer_factors = tuple(sr.get(mixer_name, (1.0, 1.0)))
        self.mlp_factors = tuple(sr.get("mlp", (1.0, 1.0)))

    def forward(self, h, state=None, cu_seqlens=None, carry=None):
        (a1, b1), (a2, b2) = self.mixer_factors, self.mlp_factors
        x = self.norm1(h)
        y, new = self._mix(x, state, cu_seqlens, carry)
        h = a1 * x + b1 * y
        if self.mlp is not None:
            x = self.norm2(h)
            y, new = self._ffn(x, state, cu_seqlens, new)
            h = a2 * x + b2 * y
        return h, new


class ParallelBlock(Block):
    """x = rmsnorm(h);  h = h + mixer(x) + beside(x);  h = h + mlp(rmsnorm(h)): two mixers side by side on one
    normed input, their outputs summed (TII's Falcon-H1: Mamba-2 beside attention in every layer).
    ``cfg.parallel`` names the mixer ``beside`` for this block's mixer; it takes that mixer's options. The state
    is one dict holding both mixers' entries (their names must differ: Mamba-2's "ssm" and "conv", attention's
    "kv"), so whatever handles a layer's state - rows, saving, serving - handles this one."""

    def __init__(self, cfg: ModelConfig, mixer_name: str, moe: bool = False, mlp: bool = True):
        super().__init__(cfg, mixer_name, moe, mlp)
        self.beside_name = name = cfg.parallel[mixer_name]
        opts = {**cfg.mixer_options.get("*", {}), **cfg.mixer_options.get(name, {})}
        heads = opts.pop("n_heads", cfg.n_heads)
        self.beside = build_mixer(name, cfg.d_model, heads, n_kv_heads=cfg.n_kv_heads, **opts)
        keys = [set(m.empty_state(1, device="meta")) for m in (self.mixer, self.beside)]
        if keys[0] & keys[1]:
            raise ValueError(f"parallel mixers {mixer_name} and {name} name state entries alike: {keys[0] & keys[1]}")
        self.state_keys = keys

    def mixers(self) -> list:
        return [self.mixer, self.beside]

    def state_parts(self) -> list:
        return [(self.beside, MIXERS[self.beside_name].rollback, "")] + super().state_parts()

    def empty_state(self, batch_size: int, device=None, dtype=torch.float32) -> dict:
        return {**super().empty_state(batch_size, device=device, dtype=dtype),
                **self.beside.empty_state(batch_size, device=device, dtype=dtype)}

    def forward(self, h, state=None, cu_seqlens=None, carry=None):
        if state is not None and cu_seqlens is None and not self.stateful_mlp and h.dim() == 3 and h.shape[1] == 1:
            out = self._fused_mixers(h, state)
            if out is not None:
                return out if self.mlp is None else self._mlp_half(*out, state, cu_seqlens)
        x = self.norm1(h)
        ys, states = [], {}
        for m, keys in zip((self.mixer, self.beside), self.state_keys):
            y, s = m(x, None if state is None else {k: state[k] for k in keys}, cu_seqlens=cu_seqlens, carry=carry)
            ys.append(y)
            states.update(s or {})
        h = h + ys[0] + ys[1]
        new = states or None
        return (h, new) if self.mlp is None else self._mlp_half(h, new, state, cu_seqlens)

    def _fused_mixers(self, h, state):
        """A decoding step's two mixers each in its one call where both have one (a pre-norm block's: Mamba-2's
        ``fused_block``, attention's ``fused_attention``), each giving h + its output from the same norm of h:
        (h', new state) with h' = out0 + (out1 - h) - within float32's rounding of the modules' h + y0 + y1, not bit
        for bit - or None (a hook on a mixer, or a call that does not apply)."""
        pairs = list(zip((self.mixer, self.beside), self.state_keys))
        if any(m._forward_hooks or m._forward_pre_hooks for m, _ in pairs):
            return None
        parts = {}
        for i in sorted(range(2), key=lambda i: type(pairs[i][0]) is not SoftmaxAttention):   # attention's (which
            m, keys = pairs[i]                                            # refuses more) first: no wasted call
            out = _mixer_call(m, h, self.norm1, {k: state[k] for k in keys})
            if out is None:
                return None
            parts[i] = out
        (h0, s0), (h1, s1) = parts[0], parts[1]
        return h0 + (h1 - h), {**s0, **s1}


class SharedUseBlock(Block):
    """t = use(h, embeddings);  h = h + mixer(rmsnorm(h + t));  h = h + mlp(rmsnorm(h)): a layer that uses one of
    the model's shared transformer blocks (``models.shared``: Zamba2's hybrid layer, whose block output enters
    the mixer's input and not the stream). ``use`` (a ``SharedUse``) holds this use's own weights. The state is
    one dict holding the mixer's entries and the use's KV cache ("kv"), as a ``ParallelBlock``'s."""

    def __init__(self, cfg: ModelConfig, mixer_name: str, moe: bool, mlp: bool, shared: SharedTransformer):
        super().__init__(cfg, mixer_name, moe, mlp)
        self.use = SharedUse(shared, cfg.shared["adapter_rank"], cfg.shared["attention_adapter"])
        keys = [set(m.empty_state(1, device="meta")) for m in (self.mixer, self.use)]
        if keys[0] & keys[1]:
            raise ValueError(f"a {mixer_name} layer and a shared block's use name state entries alike: "
                             f"{keys[0] & keys[1]}")
        self.state_keys = keys

    def mixers(self) -> list:
        return [self.mixer, self.use]

    def state_parts(self) -> list:
        return [(self.use, "truncate", "")] + super().state_parts()     # the use's state: its attention's KV cache

    def empty_state(self, batch_size: int, device=None, dtype=torch.float32) -> dict:
        return {**super().empty_state(batch_size, device=device, dtype=dtype),
                **self.use.empty_state(batch_size, device=device, dtype=dtype)}

    def forward(self, h, state=None, cu_seqlens=None, carry=None):
        mine, theirs = (None, None) if state is None else ({k: state[k] for k in keys} for keys in self.state_keys)
        t, kv = self.use(h, theirs, cu_seqlens=cu_seqlens, carry=carry)
        y, new = self.mixer(self.norm1(h + t), mine, cu_seqlens=cu_seqlens, carry=carry)
        h = h + y
        new = None if new is None or kv is None else {**new, **kv}       # None: context parallelism
        if self.mlp is not None:
            y, new = self._ffn(self.norm2(h), state, cu_seqlens, new)
            h = h + y
        return h, new


class HyperBlock(Block):
    """A block of a model with hyper-connections (module doc): ``norm1`` / ``norm2`` are the branches'
    ``HyperConnection``s, ``ple`` the layer's PLE (or None); h (B, T, n d)."""

    def __init__(self, cfg, mixer_name: str, moe: bool, mlp: bool, layer: int):
        super().__init__(cfg, mixer_name, moe, mlp)
        hc, d = cfg.hyper, cfg.d_model
        self.norm1 = HyperConnection(d, hc["streams"], hc["rank"], cfg.norm_eps)
        self.norm2 = HyperConnection(d, hc["streams"], hc["rank"], cfg.norm_eps) if self.mlp is not None else None
        p = hc["ple"]
        self.ple = None if p is None or layer not in p["layers"] else PLE(
            d, hc["streams"], cfg.norm_eps, cfg.vocab_size, p, p["layers"].index(layer))

    def empty_state(self, batch_size: int, device=None, dtype=torch.float32) -> dict:
        state = super().empty_state(batch_size, device=device, dtype=dtype)
        if self.ple is not None:
            state.update({PLE_STATE + k: v for k, v in self.ple.empty_state(batch_size, device, dtype).items()})
        return state

    def state_parts(self) -> list:
        return super().state_parts() + ([] if self.ple is None else [(self.ple, "replay", PLE_STATE)])

    @staticmethod
    def _inject(h, y, g):
        return h + (g[..., None] * y[..., None, :]).flatten(-2)

    def forward(self, h, state=None, cu_seqlens=None, carry=None):
        mine = None if state is None else {k: v for k, v in state.items() if not k.startswith(PLE_STATE)}
        new_ple = None
        if self.ple is not None:
            ple = None if state is None else {k[len(PLE_STATE):]: v for k, v in state.items()
                                              if k.startswith(PLE_STATE)}
            y, new_ple = self.ple(h, ple, cu_seqlens=cu_seqlens, carry=carry)
            new_ple = {PLE_STATE + k: v for k, v in new_ple.items()}
            h = h + y
        x, g = self.norm1(h)
        y, new = self._mix(x, mine, cu_seqlens, carry)
        h = self._inject(h, y, g)
        if self.mlp is not None:
            x, g = self.norm2(h)
            y, new = self._ffn(x, mine, cu_seqlens, new)
            h = self._inject(h, y, g)
        return h, (new if new is None or new_ple is None else {**new, **new_ple})


class LanguageModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_embed = nn.Embedding(cfg.context_length, cfg.d_model) if cfg.pos_emb == "learned" else None
        self.embed_norm = make_norm(cfg) if cfg.embed_norm else None
        moe = set(cfg.moe_layers)
        dense = range(cfg.n_layers) if cfg.mlp_layers is None else set(cfg.mlp_layers)
        # the shared transformer blocks (models.shared), held here once; use j of them takes block j mod blocks
        self.shared = None if cfg.shared is None else nn.ModuleList(
            SharedTransformer(cfg) for _ in range(cfg.shared["blocks"]))
        uses = {} if cfg.shared is None else {
            i: self.shared[j % cfg.shared["blocks"]] for j, i in enumerate(cfg.shared["layers"])}
        self.blocks = nn.ModuleList(Block.build(cfg, name, i in moe, i in dense, uses.get(i), i)
                                    for i, name in enumerate(cfg.layers))
        for i, b in enumerate(self.blocks):                  # depth-dependent layer constants (lightning's slopes)
            if hasattr(b.mixer, "place"):
                b.mixer.place(i, cfg.n_layers)
        self.norm = make_norm(cfg)
        if cfg.hyper is not None:                # the streams' last mix: (B, T, n d) -> (B, T, d), no norm after
            self.norm = HyperConnection(cfg.d_model, cfg.hyper["streams"], cfg.hyper["rank"], cfg.norm_eps, False)
        self.head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(self._init)
        self._init_residual_branches()
        use_linear(self)                  # inference products through oneDNN on CPU (layers.linear)

    @staticmethod
    def _init(m):
        """GPT-style N(0, 0.02) weights and zero biases, except where a layer set its own (``keep_init``:
        Mamba's dt projection, whose bias is the inverse softplus of dt ~ logU[1e-3, 0.1])."""
        if getattr(m, "keep_init", False):
            return
        if isinstance(m, (nn.Linear, nn.Embedding)) and getattr(m, "weight", None) is not None and m.weight.dim() == 2:
            nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def _init_residual_branches(self):
        """The projections that write into the residual stream (each mixer's output projection, each MLP's
        down projection and experts) start at N(0, 0.02 / sqrt(branches)), branches = the residual
        additions of the model (GPT-2's rule: the stream's variance at init no longer grows with depth).
        In a hybrid - a model with attention layers (``attention`` in the table of mechanisms; the mixer
        of each block, not a ``ParallelBlock``'s second one) - a mixer that normalises its output before
        that projection (``normed_output``: Mamba-2, RetNet, GLA, DeltaNet, Gated DeltaNet) writes RMS ~0.2
        into the stream where attention's value path writes ~0.005 (two N(0, 0.02) projections and an
        average); its projection starts a further ``NORMED_OUTPUT_SCALE`` smaller, so the layers start
        comparable and the normed mixer's output does not swamp the token identities the attention layer
        must match. Without attention layers all branches share one scale: there, scaling a normed mixer
        down alone only slows its learning."""
        branches = self.config.n_layers * (2 if self.config.mlp else 1)
        std = 0.02 / branches ** 0.5
        hybrid = any(MIXERS[b.mixer_name].attention for b in self.blocks)
        with torch.no_grad():
            for block in self.blocks:
                for mixer in block.mixers():
                    proj = mixer.output_projection()
                    if proj is not None and not getattr(proj, "keep_init", False):
                        scale = NORMED_OUTPUT_SCALE if hybrid and mixer.normed_output else 1.0
                        proj.weight.normal_(0, std * scale)
                if isinstance(block.mlp, (SwiGLU, ReLU2MLP)):
                    block.mlp.w_down.weight.normal_(0, std)
                elif isinstance(block.mlp, ChannelMix):
                    block.mlp.value.weight.normal_(0, std)
                elif isinstance(block.mlp, MoE):
                    block.mlp.w_down.normal_(0, std)
                    if block.mlp.shared is not None:
                        block.mlp.shared.w_down.weight.normal_(0, std)

    def save_pretrained(self, path, tokenizer=None, model_type: str | None = None) -> None:
        """Write this model as a Hugging Face folder (``model_type="subquad"``: subquad's own, for a structure no
        Hugging Face type has): ``models.hf.save_pretrained(self, path, tokenizer, model_type)``."""
        from subquad.models.hf.saver import save_pretrained

        save_pretrained(self, path, tokenizer, model_type=model_type)

    def aux_loss(self) -> torch.Tensor:
        """The mixture-of-experts router's load-balancing loss of the last forward (``subquad.models.moe``),
        unscaled (the trainer adds ``config.moe["aux_loss_coef"]`` times it); 0 without MoE layers."""
        stats = [b.mlp.router_stats for b in self.blocks if isinstance(b.mlp, MoE) and b.mlp.router_stats]
        if not stats:
            return torch.zeros((), device=self.embed.weight.device)
        return load_balancing_loss(stats, self.config.moe["experts"])

    def flops_per_token(self, T: int, training: bool = True) -> float:
        """Useful FLOPs per token of a forward over T tokens (x3 with ``training``: forward and backward):
        each mixer's ``flops_per_token``, 2 per MLP weight (a mixture of experts: the router and the top-k
        experts a token uses), and the vocabulary head; embeddings and norms are not counted."""
        total = 2.0 * self.config.d_model * self.config.vocab_size
        for b in self.blocks:
            total += sum(m.flops_per_token(T) for m in b.mixers())
            if isinstance(b.mlp, MoE):
                m = b.mlp
                total += 2.0 * (m.router.weight.numel() + m.top_k * sum(getattr(m, n)[0].numel()
                                                                         for n in m.projections))
                if m.latent_in is not None:
                    total += 2.0 * (m.latent_in.weight.numel() + m.latent_out.weight.numel())
                if m.shared is not None:
                    total += 2.0 * sum(p.numel() for p in m.shared.parameters())
                    total += 0.0 if m.shared_gate is None else 2.0 * m.shared_gate.weight.numel()
            elif b.mlp is not None:
                total += 2.0 * sum(p.numel() for p in b.mlp.parameters())
        return 3.0 * total if training else total

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def _logits(self, h):
        h = self.norm(h)
        logits = linear(h, self.embed.weight) if self.head is None else self.head(h)
        cap = self.config.logit_soft_cap
        if cap is None:
            return logits
        if not torch.is_grad_enabled():              # in place: no second and third (B, T, vocab) tensor
            return logits.div_(cap).tanh_().mul_(cap)
        return torch.tanh(logits / cap) * cap

    def _check_idx(self, idx):
        if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.dtype not in (torch.long, torch.int32, torch.int64):
            raise ValueError(f"idx must be an integer tensor (B, T), got {getattr(idx, 'shape', type(idx))}")
        if not idx.numel() or not checks_on(idx):
            return
        # a decoding step's few ids as Python ints: one op, not four of cold dispatch and two syncs
        lo, hi = (min(v := idx.flatten().tolist()), max(v)) if idx.numel() <= 64 else (idx.min(), idx.max())
        if lo < 0 or hi >= self.config.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.config.vocab_size}), got [{int(lo)}, {int(hi)}]")

    def prefill(self, idx, state=None, cu_seqlens=None, logits="all"):
        """idx (B, T) -> (logits (B, T, vocab), per-layer state). Continues from ``state`` when given.

        ``cu_seqlens`` (N + 1,): idx holds N sequences packed in one row (1, T) with these cumulative lengths
        (flash-attention's convention); nothing crosses a boundary, positions restart at each sequence, and
        the state has one row per sequence - what batched decoding of the N sequences continues from.
        ``logits="last"``: only each sequence's last position, (B, vocab) (with cu_seqlens: (N, vocab)) - what
        generation samples from; the head then multiplies one row per sequence, not T (transformers'
        ``logits_to_keep=1``): at a 256K vocabulary and T = 2,048 the full logits are 2 GB and half the FLOPs."""
        if logits not in ("all", "last"):
            raise ValueError(f"logits must be 'all' or 'last', got {logits!r}")
        if state is not None and cu_seqlens is None and not torch.compiler.is_compiling() and torch.is_tensor(idx):
            check_rows(state, self, idx.shape[0])         # a wrong state named here, not deep in a layer
        h, states = self._hidden(idx, state, cu_seqlens)
        if logits == "last":
            h = h[:, -1] if cu_seqlens is None else h[0, torch.as_tensor(cu_seqlens, device=h.device)[1:] - 1]
            return self._logits(h[:, None])[:, 0], states
        return self._logits(h), states

    def _hidden(self, idx, state=None, cu_seqlens=None):
        """The residual stream after the last block (before the final norm) and the per-layer state; denormals
        flushed to zero meanwhile (``kernels.fpenv``: an Intel core's assists on them slowed a chunkwise
        prefill 3x)."""
        if torch.compiler.is_compiling():             # (no context manager in a traced graph)
            return self._blocks(idx, state, cu_seqlens)
        with flush_denormals():
            return self._blocks(idx, state, cu_seqlens)

    def _blocks(self, idx, state=None, cu_seqlens=None):
        h, end_pos = self._embed_tokens(idx, state, cu_seqlens)
        if state is not None and cu_seqlens is None and self.shared is None and self.config.hyper is None:
            out = stacked_blocks(self.blocks, h, state)     # a decoding token's runs of blocks in one call each
            if out is not None:
                return out[0], ModelState(out[1], pos=end_pos)
        states, carry = ModelState(pos=end_pos), self._carry(h, idx)  # carry: values that cross layers in this forward
        for i, block in enumerate(self.blocks):
            h, s = block(h, None if state is None else state[i], cu_seqlens=cu_seqlens, carry=carry)
            states.append(s)
        return h, states

    def _carry(self, h, idx=None) -> dict:
        """The ``carry`` a forward starts with (``layers.base``): the embedded tokens ``h`` (B, T, d_model), as the
        first block sees them, when shared blocks read them (``models.shared``); the token ids ``idx`` when
        per-layer n-gram embeddings read them (``models.hyper``); else empty."""
        carry = {} if self.shared is None else {EMBEDDINGS: h}
        if idx is not None and self.config.hyper is not None and self.config.hyper["ple"] is not None:
            carry[TOKENS] = idx
        return carry

    def _embed_tokens(self, idx, state=None, cu_seqlens=None):
        """(the embedded tokens (B, T, d_model) with their learned positions - with hyper-connections, repeated
        into the n streams (B, T, n d_model) -, the position count after them)."""
        self._check_idx(idx)
        pos = 0 if state is None else getattr(state, "pos", 0)
        seq = sequence.backend() if cu_seqlens is None else sequence.Packed(cu_seqlens)
        B, T = idx.shape
        if cu_seqlens is not None and (B != 1 or T != sum(seq.lengths)):
            raise ValueError(f"with cu_seqlens idx must be packed as (1, T={sum(seq.lengths)}), got {tuple(idx.shape)}")
        h = self.embed(idx.long())
        if self.config.embed_scale is not None:
            h = h * self.config.embed_scale
        if self.pos_embed is not None:    # context parallel: idx is this rank's shard, at its global positions
            end = seq.length(T, pos)
            if end > self.config.context_length:
                raise ValueError(f"learned positions end at context_length={self.config.context_length}; "
                                 f"this call reaches position {end} (use pos_emb='none' to decode without limit)")
            positions = seq.positions(T, pos, idx.device)
            if not isinstance(positions, torch.Tensor):
                positions = torch.arange(positions, positions + T, device=idx.device)
            h = h + self.pos_embed(positions)
        if self.embed_norm is not None:
            h = self.embed_norm(h)
        if self.config.hyper is not None:
            h = h.repeat(1, 1, self.config.hyper["streams"])
        if cu_seqlens is None and not isinstance(pos, torch.Tensor):
            return h, pos + T
        return h, seq.tokens(B, T, idx.device) + pos

    def step(self, tokens, state):
        """One decoding step: tokens (B,) or (B, 1), the state after each row's previous tokens -> (logits (B,
        vocab), new state). The same as ``prefill(tokens.view(B, 1), state)``; it takes the compiled decode step
        when one is set (``models.decode.compile_decode``), so ``generate``, ``subquad generate`` and the server
        all decode through it. Like a forward it keeps the caller's grad mode (the compiled step records no
        gradients): a decoding loop of one's own runs under ``torch.no_grad()``."""
        if not isinstance(tokens, torch.Tensor) or tokens.is_floating_point() or tokens.is_complex() \
                or tokens.dtype == torch.bool or tokens.dim() not in (1, 2) or tokens.shape[1:] not in ((), (1,)):
            got = f"{tuple(tokens.shape)} {tokens.dtype}" if isinstance(tokens, torch.Tensor) else type(tokens).__name__
            several = isinstance(tokens, torch.Tensor) and tokens.dim() == 2 and tokens.shape[1] > 1
            raise ValueError(f"step's tokens must be one integer id a row, (B,) or (B, 1), got {got}"
                             + (" (prefill(idx, state) takes several tokens a row)" if several else ""))
        tokens = tokens.reshape(-1, 1)
        fast = getattr(self, "_decode_step", None)
        with decoding():                         # int8: fbgemm's kernel at any batch (models.quant)
            return self.eager_step(tokens, state) if fast is None else fast(tokens, state)

    def eager_step(self, tokens, state):
        """``step`` without the compiled step: tokens (B, 1), the prefill of one token a row (the reference the
        compiled step is tested against, and what ``compile_decode(faster=True)`` times it against) - in its
        fewest Python steps where ``models.token_step`` applies (the same math; the final norm and head in one C
        call)."""
        out = decode_token(self, tokens, state)
        if out is not None:
            return out
        logits, state = self.prefill(tokens, state)
        return logits[:, -1], state

    def forward(self, idx, cu_seqlens=None, targets=None):
        """idx (B, T) -> logits (B, T, vocab); with ``cu_seqlens``, idx (1, T) packs several sequences.

        With ``targets`` (B, T) (-100: no target there) it returns the mean next-token cross-entropy
        instead, computed from the last hidden states in chunks (``models.loss.linear_cross_entropy``):
        the (B, T, vocab) logits are never held, which at long T is most of a step's memory traffic."""
        if targets is None:
            return self.prefill(idx, cu_seqlens=cu_seqlens)[0]
        if self.config.logit_soft_cap is not None:        # the chunked loss has no cap: the logits, materialised
            logits = self._logits(self._hidden(idx, None, cu_seqlens)[0])
            logits = logits.to(state_dtype(logits.dtype))             # float32 (float64 stays), as the chunked loss
            return F.cross_entropy(logits.flatten(0, -2), targets.to(logits.device).flatten())
        h = self.norm(self._hidden(idx, None, cu_seqlens)[0])
        weight = self.embed.weight if self.head is None else self.head.weight
        return linear_cross_entropy(h, weight, targets.to(h.device))

    def empty_state(self, batch_size: int = 1, device=None, dtype=None):
        """Every block's empty decoding state; ``dtype``: the activations' (None: the embedding's), which sets the
        states' (float32, or float64 for a float64 model: the ops refuse a state of another dtype)."""
        dtype = self.embed.weight.dtype if dtype is None else dtype
        return ModelState([b.empty_state(batch_size, device=device, dtype=dtype) for b in self.blocks])

    @staticmethod
    def state_bytes(state) -> int:
        """Bytes of every tensor the decoding state holds, measured from the tensors."""
        return tensor_bytes(list(state))

    def verify(self, tokens, state, how: str | None = None):
        """Speculative decoding's verification: tokens (B, k) after ``state`` -> (logits (B, k, vocab), an object
        whose ``accept(j)`` is the state after only the first j of them; ``how``: ``models.speculative.verify``)."""
        from subquad.models.speculative import verify

        return verify(self, tokens, state, how)

    def generate(self, prompt, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, seed: int | None = None, state=None, on_token=None, stop_ids=None,
                 speculative: str | None = None, draft_tokens: int = 4, **options):
        """``models.generate.generate(self, ...)``: up to ``max_new_tokens`` sampled after each prompt, and the
        decoding state after them. ``options``: generate's keyword-only sampling options (``min_p``, the
        penalties, ``logit_bias``, ``ignore_eos``); ``speculative="ngram"`` drafts up to ``draft_tokens`` per step
        by prompt lookup and verifies them in one forward (``models.speculative``; statistics in
        ``speculation_stats``)."""
        return generate(self, prompt, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                        state=state, on_token=on_token, stop_ids=stop_ids, speculative=speculative,
                        draft_tokens=draft_tokens, **options)
