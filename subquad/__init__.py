"""subquad: sequence mixers that escape attention's quadratic cost, in plain PyTorch.

Every mechanism is one function computed in three forms that agree - ``parallel`` (T x T),
``recurrent`` (token by token, fixed state) and ``chunk`` (chunkwise parallel, the fast path).

    subquad.ops        the ops: linear_attention, retention, simple_gla, gla, ssd, delta_rule,
                       gated_delta_rule, selective_scan, softmax_attention (and their forms)
    subquad.layers     one nn.Module per mechanism, forward(x, state) -> (y, state); build_mixer
    subquad.models     ModelConfig, LanguageModel (any pattern of mixers), presets, saved states
    subquad.train      the trainer; subquad.distributed: ring attention, context parallelism
"""

__version__ = "0.1.0"

from subquad import layers, models, ops  # noqa: E402
from subquad.layers import build_mixer  # noqa: E402
from subquad.models import LanguageModel, ModelConfig, from_pretrained, preset  # noqa: E402

__all__ = ["__version__", "ops", "layers", "models", "build_mixer", "ModelConfig", "LanguageModel", "preset",
           "from_pretrained"]
