"""The names of a multi-token-prediction head's tensors in a checkpoint (``models.mtp``), and packing them back for
``save_pretrained`` - apart from ``models.mtp`` so that the saver does not import the model's layers."""

from __future__ import annotations

import torch


def mtp_names(fmt, head) -> dict:
    """subquad name (under "mtp.") -> the checkpoint's, for every tensor of ``head``: its block named as the
    format names an attention layer, under "mtp.layers.0."; the rest "mtp.fc", "mtp.norm",
    "mtp.pre_fc_norm_embedding", "mtp.pre_fc_norm_hidden"."""
    shapes = {"blocks.0." + k: v.shape for k, v in head.block.state_dict().items()}
    inner = fmt.names(head.config, shapes)
    out = {"mtp." + k.replace("blocks.0.", "block.", 1):
           (tuple(t.replace(fmt.layer.format(i=0), "mtp.layers.0.", 1) for t in v) if isinstance(v, tuple)
            else v.replace(fmt.layer.format(i=0), "mtp.layers.0.", 1)) for k, v in inner.items()}
    out.update({"mtp.fc.weight": "mtp.fc.weight", "mtp.norm.weight": "mtp.norm.weight",
                "mtp.norm_embed.weight": "mtp.pre_fc_norm_embedding.weight",
                "mtp.norm_hidden.weight": "mtp.pre_fc_norm_hidden.weight"})
    return out


def _zero_centred(fmt, cfg) -> bool:
    """Whether the format stores its final norm zero-centred (x (1 + w)): the head's own norms are stored so too."""
    name = fmt.top["norm.weight"]
    return bool(fmt.unpack({name: torch.zeros(1)}, cfg)[name].item() == 1)


def pack_mtp(fmt, head, own: dict) -> dict:
    """``load_mtp``'s inverse: the head's tensors (``own``: "mtp."-prefixed, from the model's state dict) under
    the checkpoint's names, packed by the format as any layer's."""
    prefix = fmt.layer.format(i=0)
    centred = _zero_centred(fmt, head.config)
    flat = {}
    for ours, theirs in mtp_names(fmt, head).items():
        t = own[ours].detach().cpu()
        if isinstance(theirs, tuple):
            flat.update({n: p.contiguous() for n, p in zip(theirs, t.unbind(0), strict=True)})
            continue
        if centred and theirs in ("mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight",
                                  "mtp.pre_fc_norm_hidden.weight"):
            t = (t.float() - 1).to(t.dtype)
        flat[theirs] = t
    inner = {k.replace("mtp.layers.0.", prefix, 1) if k.startswith("mtp.layers.0.") else k: v
             for k, v in flat.items()}
    packed = fmt.pack(inner, head.config)
    return {k.replace(prefix, "mtp.layers.0.", 1) if k.startswith(prefix) else k: v.contiguous()
            for k, v in packed.items()}
