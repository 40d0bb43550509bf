"""The checkpoint formats subquad reads and writes, by Hugging Face ``model_type``."""

from __future__ import annotations

from subquad.models.hf.bailing_hybrid import BailingHybridFormat
from subquad.models.hf.bamba import BambaFormat
from subquad.models.hf.falcon_h1 import FalconH1Format
from subquad.models.hf.granitemoehybrid import GraniteMoeHybridFormat
from subquad.models.hf.jamba import JambaFormat
from subquad.models.hf.kimi_linear import KimiLinearFormat
from subquad.models.hf.lfm2 import Lfm2Format, Lfm2MoeFormat
from subquad.models.hf.lfm3 import Lfm3Format
from subquad.models.hf.mamba import FalconMambaFormat, MambaFormat
from subquad.models.hf.mamba2 import Mamba2Format
from subquad.models.hf.minimax import MiniMaxFormat
from subquad.models.hf.nemotron_h import NemotronHFormat
from subquad.models.hf.olmo_hybrid import OlmoHybridFormat
from subquad.models.hf.qwen3_5 import Qwen3_5Format, Qwen3_5MoeFormat, Qwen3_5MoeTextFormat, Qwen3_5TextFormat
from subquad.models.hf.qwen3_next import Qwen3NextFormat
from subquad.models.hf.qwen4_exp import Qwen4ExpFormat, Qwen4ExpTextFormat
from subquad.models.hf.recurrent_gemma import RecurrentGemmaFormat
from subquad.models.hf.rwkv7 import RWKV7Format
from subquad.models.hf.xlstm import XLSTMFormat
from subquad.models.hf.zamba import ZambaFormat
from subquad.models.hf.zamba2 import Zamba2Format

MAPPINGS = {f.model_type: f for f in (MambaFormat, FalconMambaFormat, Mamba2Format, BambaFormat, JambaFormat,
                                      Qwen3NextFormat, OlmoHybridFormat, KimiLinearFormat, MiniMaxFormat)}
# after the types above: save_pretrained writes the first type that holds a model's structure
MAPPINGS.update({f.model_type: f for f in (Qwen3_5TextFormat, Qwen3_5MoeTextFormat, Qwen3_5Format, Qwen3_5MoeFormat,
                                          GraniteMoeHybridFormat, NemotronHFormat)})
MAPPINGS.update({f.model_type: f for f in (Lfm2Format, Lfm2MoeFormat, FalconH1Format)})
MAPPINGS.update({f.model_type: f for f in (RecurrentGemmaFormat, RWKV7Format, Zamba2Format, XLSTMFormat, ZambaFormat,
                                           Lfm3Format, BailingHybridFormat)})
MAPPINGS.update({f.model_type: f for f in (Qwen4ExpTextFormat, Qwen4ExpFormat)})
