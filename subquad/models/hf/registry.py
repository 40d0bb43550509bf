"""The checkpoint formats subquad reads and writes, by Hugging Face ``model_type``."""

from __future__ import annotations

from subquad.models.hf.bamba import BambaFormat
from subquad.models.hf.jamba import JambaFormat
from subquad.models.hf.kimi_linear import KimiLinearFormat
from subquad.models.hf.mamba import FalconMambaFormat, MambaFormat
from subquad.models.hf.mamba2 import Mamba2Format
from subquad.models.hf.minimax import MiniMaxFormat
from subquad.models.hf.olmo_hybrid import OlmoHybridFormat
from subquad.models.hf.qwen3_next import Qwen3NextFormat
from subquad.models.hf.rwkv7 import RWKV7Format

MAPPINGS = {f.model_type: f for f in (MambaFormat, FalconMambaFormat, Mamba2Format, BambaFormat, JambaFormat,
                                      Qwen3NextFormat, OlmoHybridFormat, KimiLinearFormat, MiniMaxFormat,
                                      RWKV7Format)}
