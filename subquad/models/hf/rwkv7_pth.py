"""BlinkDL's RWKV-7 ``.pth`` checkpoints (RWKV-LM's training output, what the ``rwkv`` package's ``RWKV_x070``
loads): one torch-saved dict, no config; the sizes are read off the tensors.

    emb.weight (vocab, D)                   blocks.0.ln0.*  a LayerNorm on the embeddings
    blocks.{i}.ln1.*, ln2.*                 LayerNorms before the time mix and the channel mix
    blocks.{i}.att.x_r .. x_g (1, 1, D)     token-shift mixes              att.r_k (H, head_size)
    att.w0 (1, 1, D), w1 (D, r), w2 (r, D)  the decay's LoRA (and a0/a1/a2, v0/v1/v2; g1/g2 without a bias)
    att.receptance/key/value/output.weight  att.ln_x.* the per-head GroupNorm (eps 64e-5)    att.k_k, att.k_a
    blocks.{i}.ffn.x_k, ffn.key.weight, ffn.value.weight    ln_out.*, head.weight

The LoRA matrices are stored (in, out), transposed from a Linear's weight; the 1-D parameters as (1, 1, D).
Head size, layer count, LoRA widths and the MLP width come from r_k, the block indices, w1/a1/v1/g1 and
ffn.key. DeepEmbed checkpoints (``ffn.s_emb``, ``RWKV_DE_VERSION``) are refused as unexpected weights.
"""

from __future__ import annotations

from pathlib import Path

import torch

from subquad.models.config import ModelConfig
from subquad.models.hf.common import Format
from subquad.models.hf.rwkv7 import first_layer_v_lora, rwkv7_config

NORM_EPS = 1e-5              # F.layer_norm's default, which the package uses
GROUP_NORM_EPS = 64e-5       # the package's ln_x epsilon, whatever the head size
LORAS = {"w": True, "a": True, "v": True, "g": False}      # letter -> whether the LoRA has a bias (w0, a0, v0)
FLAT = ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g", "w0", "a0", "v0", "k_k", "k_a")


def pth_file(path) -> Path | None:
    """The ``.pth`` file ``path`` names: itself, or the one ``.pth`` in a folder without config.json; None for
    a Hugging Face folder. ValueError for a folder holding several."""
    path = Path(path)
    if path.is_file():
        return path if path.suffix == ".pth" else None
    if not path.is_dir() or (path / "config.json").exists():
        return None
    found = sorted(path.glob("*.pth"))
    if len(found) > 1:
        raise ValueError(f"{path} holds several .pth files ({', '.join(f.name for f in found)}): name one")
    return found[0] if found else None


def read_pth(path) -> dict:
    """The checkpoint's tensors, memory-mapped (only tensors are unpickled)."""
    try:
        return torch.load(str(path), map_location="cpu", mmap=True, weights_only=True)
    except Exception as e:
        raise ValueError(f"{path} is not a readable torch checkpoint: {e}") from None


class RWKV7PthFormat(Format):
    """The ``.pth`` layout (module doc): ``config_from_weights`` instead of a config.json."""
    model_type = "rwkv7 .pth"
    top = {"embed.weight": "emb.weight", "embed_norm.{p}": "blocks.0.ln0.{p}", "norm.{p}": "ln_out.{p}",
           "head.weight": "head.weight"}
    layer = "blocks.{i}."
    layers = {"*": {"norm1.{p}": "ln1.{p}", "norm2.{p}": "ln2.{p}",
                    "mixer.r_proj.weight": "att.receptance.weight", "mixer.k_proj.weight": "att.key.weight",
                    "mixer.v_proj.weight": "att.value.weight", "mixer.o_proj.weight": "att.output.weight",
                    "mixer.g_norm.{p}": "att.ln_x.{p}",
                    **{f"mixer.{n}_lora.0.weight": f"att.{n}1" for n in LORAS},
                    **{f"mixer.{n}_lora.2.weight": f"att.{n}2" for n in LORAS},
                    **{f"mixer.{n}_lora.2.bias": f"att.{n}0" for n, bias in LORAS.items() if bias},
                    "mixer.{p}": "att.{p}", "mlp.{p}": "ffn.{p}"}}

    @staticmethod
    def config_from_weights(t: dict) -> ModelConfig:
        for key in ("emb.weight", "blocks.0.att.r_k", "blocks.0.att.w1", "blocks.0.ffn.key.weight"):
            if key not in t:
                raise ValueError(f"not an RWKV-7 .pth checkpoint: it has no {key}")
        vocab, D = t["emb.weight"].shape
        H, K = t["blocks.0.att.r_k"].shape
        if H * K != D:
            raise ValueError(f"blocks.0.att.r_k has shape {(H, K)}: heads x head size must be the width {D}")
        n = 1 + max(int(k.split(".")[1]) for k in t if k.startswith("blocks."))
        v1 = next((t[f"blocks.{i}.att.v1"] for i in (1, 0) if f"blocks.{i}.att.v1" in t), None)
        ranks = {"decay_rank": t["blocks.0.att.w1"].shape[1], "a_rank": t["blocks.0.att.a1"].shape[1],
                 "v_rank": None if v1 is None else v1.shape[1], "gate_rank": t["blocks.0.att.g1"].shape[1]}
        return rwkv7_config(vocab, D, n, K, ranks, t["blocks.0.ffn.key.weight"].shape[0], NORM_EPS, GROUP_NORM_EPS)

    @classmethod
    def unpack(cls, tensors: dict, cfg: ModelConfig, dtype=None) -> dict:
        """1-D parameters flattened, LoRA matrices transposed to Linear weights, zeros for an absent layer-0
        value LoRA (the first layer has no value residual)."""
        out = {}
        for k, t in tensors.items():
            last = k.rsplit(".", 1)[-1]
            if ".att." in k and last in FLAT or k.endswith("ffn.x_k"):
                t = t.reshape(-1)
            elif ".att." in k and len(last) == 2 and last[0] in LORAS and last[1] in "12":
                t = t.t().contiguous()
            out[k] = t
        return first_layer_v_lora(out, cfg, {"down": "blocks.0.att.v1", "up": "blocks.0.att.v2",
                                             "bias": "blocks.0.att.v0"})
