"""A checkpoint's multi-token-prediction (MTP) head: a next-next-token predictor that drafts for speculative
decoding (``models.speculative.MTPDrafter``).

Qwen3-Next and Qwen3.5 ship one MTP layer (``mtp_num_hidden_layers``, tensors ``mtp.*``; transformers loads
none of them); Nemotron-H's spans two of its layers (``mtp.layers.0-1``: attention, then the MoE); Ling 3's
(``bailing_hybrid``) is the layer after its decoder layers (``model.layers.{num_hidden_layers}``), one MLA layer
with the MoE (``hf/bailing_hybrid.py``'s doc: SGLang's reading). The format says where (``Format.mtp_prefix``),
under which names (``mtp_own``) and with which attention (``mtp_mixer``). Pair i joins the model's hidden state at
position i with the token at i + 1 and predicts the token at i + 2 (the layout vLLM and SGLang run, written out
here; the reference in the tests is transformers' own decoder layer with these weights):

    e_i = norm_e(embed(x_{i+1}))                  (B, T, d)   the model's embedding, shared
    g_i = norm_h(h_i)                              (B, T, d)   h: the model's hidden state after its final norm
    z   = block(fc([e ; g]))                       (B, T, d)   fc: (d, 2 d); block: one attention layer of the
                                                              model's kind or the format's ``mtp_mixer`` (its
                                                              own KV cache over the pairs, pair i at
                                                              position i), MoE or dense MLP
    u_i = norm(z_i);  logits_i = head(u_i)                     the model's head, shared

To draft more than one token the head runs on its own output: the pair (u_i, x_{i+2}) at position i + 1.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from subquad.models.config import ModelConfig
from subquad.models.hf.mtp_names import _from_mtp, _own_norms, _to_mtp, _zero_centred, mtp_names


def mtp_config(cfg: ModelConfig, moe: bool, mixer: str = "softmax") -> ModelConfig:
    """The one-layer config of the head's block: the model's attention layer (``mixer``, "softmax" or Ling's
    "mla", with the model's options for it), with the model's MoE (``moe``) or its dense MLP."""
    if moe and cfg.moe is None:
        raise ValueError("the MTP layer holds experts, the model has no mixture of experts to take their "
                         "configuration from")
    m = None if not moe else {**cfg.moe, "every": 1, "offset": 0, **({"layers": [0]} if "layers" in cfg.moe else {})}
    return dataclasses.replace(cfg, n_layers=1, pattern=mixer, moe=m, mlp_layers=None, parallel={},
                               post_norm=[], shared=None)


class MTPHead(nn.Module):
    """One MTP layer (module doc): ``norm_embed``, ``norm_hidden``, ``fc``, ``block``, ``norm``; the embedding and
    the head are the model's, passed to ``forward``."""

    def __init__(self, cfg: ModelConfig, moe: bool, mixer: str = "softmax"):
        from subquad.models.lm import Block, make_norm

        super().__init__()
        self.config = mtp_config(cfg, moe, mixer)
        d = cfg.d_model
        self.norm_embed, self.norm_hidden, self.norm = make_norm(cfg), make_norm(cfg), make_norm(cfg)
        self.fc = nn.Linear(2 * d, d, bias=False)
        self.block = Block.build(self.config, mixer, moe, True)

    def empty_state(self, batch_size: int = 1, device=None, dtype=None) -> dict:
        dtype = self.fc.weight.dtype if dtype is None else dtype
        return self.block.empty_state(batch_size, device=device, dtype=dtype)

    def forward(self, model, hidden, tokens, state=None, cu_seqlens=None):
        """hidden (B, T, d): the model's states after its final norm (or the head's own ``u``), tokens (B, T): the
        token after each -> (logits (B, T, vocab), u (B, T, d), the block's new state). ``state``: the block's
        state after the earlier pairs (None: none); ``cu_seqlens`` packs rows as ``LanguageModel.prefill``."""
        e = model.embed(tokens.long())
        if model.config.embed_scale is not None:
            e = e * model.config.embed_scale
        z = self.fc(torch.cat([self.norm_embed(e), self.norm_hidden(hidden)], -1))
        z, new = self.block(z, state, cu_seqlens=cu_seqlens, carry={})
        u = self.norm(z)
        logits = u @ model.embed.weight.T if model.head is None else model.head(u)
        return logits, u, new




MTP_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "nemotron_h", "bailing_hybrid")   # the types whose head loads


def load_mtp(fmt, cfg: ModelConfig, tensors: dict, dtype=None) -> MTPHead:
    """The ``MTPHead`` of a checkpoint's MTP tensors (``tensors``: all of them, checkpoint names: "mtp.*", or
    Ling's layer after the decoder layers - the format's ``mtp_prefix``). One block (``mtp_num_hidden_layers`` /
    ``num_nextn_predict_layers`` 1, as every released checkpoint), spread over the format's ``mtp_layers`` layers,
    its attention the format's ``mtp_mixer``; MoE when it holds experts. The format's ``unpack`` treats the
    block's tensors as any layer's (fused projections, zero-centred norms, reordered rotary rows); the head's own
    norms are zero-centred where the format's are. Refusals name the checkpoint's tensors."""
    src, dst = fmt.mtp_prefix(cfg)
    tensors = {dst + k[len(src):] if k.startswith(src) else k: v for k, v in tensors.items()}

    def named(n: str) -> str:                       # the checkpoint's name of a tensor read as ``n``
        return src + n[len(dst):] if n.startswith(dst) else n

    layers = {k.split(".")[2] for k in tensors if k.startswith("mtp.layers.")}
    want = {str(j) for j in range(fmt.mtp_layers)}
    if layers != want:
        raise ValueError(f"{fmt.model_type}: an MTP head of one block (layers {sorted(want)}) is supported, the "
                         f"checkpoint has layers {sorted(layers)}")
    moe = any(".experts." in k for k in tensors)
    with torch.device("meta"):
        head = MTPHead(cfg, moe, fmt.mtp_mixer)
    names = mtp_names(fmt, head)
    inner = fmt.unpack({_from_mtp(fmt, k): v for k, v in tensors.items()}, head.config, dtype)
    inner = {_to_mtp(fmt, k): v for k, v in inner.items()}
    centred = _zero_centred(fmt, cfg)
    state, used = {}, set()
    own = head.state_dict()
    for ours, theirs in names.items():
        parts = theirs if isinstance(theirs, tuple) else (theirs,)
        missing = [named(t) for t in parts if t not in inner]
        if missing:
            raise ValueError(f"{fmt.model_type}: MTP weights missing from the checkpoint: {', '.join(missing[:5])}")
        key = ours.removeprefix("mtp.")
        shape = own[key].shape[1:] if isinstance(theirs, tuple) else own[key].shape   # stacked experts: each
        for p in parts:
            if inner[p].shape != shape:
                raise ValueError(f"{fmt.model_type}: MTP weight {named(p)} has shape {tuple(inner[p].shape)}, the "
                                 f"config implies {tuple(shape)}")
        t = torch.stack([inner[p] for p in parts]) if isinstance(theirs, tuple) else inner[theirs]
        if centred and theirs in _own_norms(fmt):
            t = t.float() + 1
        state[key] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
        used.update(parts)
    extra = set(inner) - used
    if extra:
        raise ValueError(f"{fmt.model_type}: unexpected MTP weights: {', '.join(sorted(map(named, extra))[:5])}")
    head.load_state_dict(state, strict=True, assign=True)
    return head.eval()
