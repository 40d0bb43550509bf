"""The GGUF architectures subquad reads and writes: ``ARCHS`` by ``general.architecture`` (the loader's), and
``HF_TYPES``, the one each Hugging Face ``model_type``'s file is written as (the writer's). The tables of each
are in ``arch.py`` (mamba, mamba2, lfm2), ``qwen.py``, ``qwen4.py``, ``more.py``, ``hybrid.py`` and ``minimax.py``,
which import ``arch``'s shared pieces; this module imports them all, so none of them imports it."""

from __future__ import annotations

from subquad.models.gguf.arch import Lfm2Arch, Mamba2Arch, MambaArch
from subquad.models.gguf.hybrid import FalconH1Arch, GraniteHybridArch, JambaArch, NemotronHArch, NemotronHMoeArch
from subquad.models.gguf.minimax import MINIMAX_ARCHS, MINIMAX_HF_TYPES
from subquad.models.gguf.more import MORE_ARCHS, MORE_HF_TYPES
from subquad.models.gguf.qwen import QWEN_ARCHS, QWEN_HF_TYPES
from subquad.models.gguf.qwen4 import Qwen4ExpArch

ARCHS = {a.arch: a for a in (MambaArch, Mamba2Arch, Lfm2Arch, *QWEN_ARCHS, Qwen4ExpArch, *MORE_ARCHS,
                             GraniteHybridArch, NemotronHArch, NemotronHMoeArch, FalconH1Arch, JambaArch,
                             *MINIMAX_ARCHS)}
HF_TYPES = {"mamba": MambaArch, "falcon_mamba": MambaArch, "mamba2": Mamba2Arch, "lfm2": Lfm2Arch, **QWEN_HF_TYPES,
            "qwen4_exp_text": Qwen4ExpArch,
            **MORE_HF_TYPES, "granitemoehybrid": GraniteHybridArch, "bamba": GraniteHybridArch,
            "nemotron_h": NemotronHArch, "falcon_h1": FalconH1Arch, "jamba": JambaArch, **MINIMAX_HF_TYPES}
