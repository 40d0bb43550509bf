"""The names of a multi-token-prediction head's tensors in a checkpoint (``models.mtp``), and packing them back for
``save_pretrained`` - apart from ``models.mtp`` so that the saver does not import the model's layers."""

from __future__ import annotations

import torch


def _to_mtp(fmt, name: str) -> str:
    """A name of the format's first ``mtp_layers`` layers -> under "mtp.layers.{j}."."""
    for j in range(fmt.mtp_layers):
        prefix = fmt.layer.format(i=j)
        if name.startswith(prefix):
            return f"mtp.layers.{j}." + name[len(prefix):]
    return name


def _from_mtp(fmt, name: str) -> str:
    """``_to_mtp``'s inverse: "mtp.layers.{j}." -> the format's layer j."""
    for j in range(fmt.mtp_layers):
        if name.startswith(f"mtp.layers.{j}."):
            return fmt.layer.format(i=j) + name[len(f"mtp.layers.{j}."):]
    return name


def mtp_names(fmt, head) -> dict:
    """subquad name (under "mtp.") -> the checkpoint's, for every tensor of ``head``: its block named as the
    format names a block of that structure, its layers under "mtp.layers.0." (and 1. ... where the format spreads
    a block over ``mtp_layers`` layers); its own tensors as the format's ``mtp_own`` names them."""
    shapes = {"blocks.0." + k: v.shape for k, v in head.block.state_dict().items()}
    inner = fmt.names(head.config, shapes)
    out = {"mtp." + k.replace("blocks.0.", "block.", 1):
           (tuple(_to_mtp(fmt, t) for t in v) if isinstance(v, tuple) else _to_mtp(fmt, v)) for k, v in inner.items()}
    out.update(fmt.mtp_own)
    return out


def _own_norms(fmt) -> set:
    """The checkpoint names of the head's own norms (the fc is the one matrix among its own tensors)."""
    return {v for k, v in fmt.mtp_own.items() if k != "mtp.fc.weight"}


def _zero_centred(fmt, cfg) -> bool:
    """Whether the format stores its final norm zero-centred (x (1 + w)): the head's own norms are stored so too."""
    name = fmt.top["norm.weight"]
    return bool(fmt.unpack({name: torch.zeros(1)}, cfg)[name].item() == 1)


def pack_mtp(fmt, head, own: dict, cfg) -> dict:
    """``load_mtp``'s inverse: the head's tensors (``own``: "mtp."-prefixed, from the model's state dict) under
    the checkpoint's names (``cfg`` the model's config: the format's ``mtp_prefix``), packed by the format as any
    layer's."""
    centred = _zero_centred(fmt, head.config)
    flat = {}
    for ours, theirs in mtp_names(fmt, head).items():
        t = own[ours].detach().cpu()
        if isinstance(theirs, tuple):
            flat.update({n: p.contiguous() for n, p in zip(theirs, t.unbind(0), strict=True)})
            continue
        if centred and theirs in _own_norms(fmt):
            t = (t.float() - 1).to(t.dtype)
        flat[theirs] = t
    packed = fmt.pack({_from_mtp(fmt, k): v for k, v in flat.items()}, head.config)
    src, dst = fmt.mtp_prefix(cfg)
    out = {_to_mtp(fmt, k): v.contiguous() for k, v in packed.items()}
    return {src + k[len(dst):] if k.startswith(dst) else k: v for k, v in out.items()}
