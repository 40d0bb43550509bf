"""Mixer layers: one nn.Module per mechanism, ``forward(x, state=None) -> (y, state)``.

See ``subquad.layers.base`` for the contract (empty state, state bytes, decoding).
"""

from subquad.layers.attention import SoftmaxAttention
from subquad.layers.base import Mixer, tensor_bytes
from subquad.layers.channel_mix import ChannelMix
from subquad.layers.conv import ShortConv
from subquad.layers.deltanet import DeltaNet, GatedDeltaNet
from subquad.layers.gla import GatedLinearAttention
from subquad.layers.griffin import GriffinRecurrentBlock
from subquad.layers.kda import KimiDeltaAttention
from subquad.layers.lightning import LightningAttention
from subquad.layers.linear_attention import LinearAttention
from subquad.layers.linformer import Linformer
from subquad.layers.mamba import Mamba
from subquad.layers.mamba2 import Mamba2
from subquad.layers.mla import LatentAttention
from subquad.layers.mlstm import MLSTM
from subquad.layers.norm import GatedRMSNorm, RMSNorm
from subquad.layers.qsa import IndexedAttention
from subquad.layers.registry import MIXERS, build_mixer, register_mixer
from subquad.layers.retention import MultiScaleRetention
from subquad.layers.rwkv7 import RWKV7
from subquad.layers.short_conv import GatedShortConv

__all__ = ["Mixer", "tensor_bytes", "ShortConv", "RMSNorm", "GatedRMSNorm", "MIXERS", "build_mixer", "register_mixer",
           "SoftmaxAttention", "LinearAttention", "DeltaNet", "GatedDeltaNet", "Mamba", "Linformer",
           "MultiScaleRetention", "GatedLinearAttention", "Mamba2", "GatedShortConv", "GriffinRecurrentBlock",
           "KimiDeltaAttention", "LightningAttention", "LatentAttention", "MLSTM", "IndexedAttention", "RWKV7",
           "ChannelMix"]
