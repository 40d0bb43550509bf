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

import os

# Large CPU tensors on transparent huge pages: PyTorch's CPU allocator (c10 ``alloc_cpu``) madvises allocations
# of 2 MB and more as huge pages when THP_MEM_ALLOC_ENABLE=1, read at its first such allocation. Without it
# every fresh large tensor is faulted in 4 KB at a time, and at long sequences that is most of an elementwise
# op's time (exp over 64 MB: 59 ms -> 25 ms; the RG-LRU at T = 16K: 2.5x; benchmarks/RESULTS.md, "Page
# faults"). A value the user set is kept (THP_MEM_ALLOC_ENABLE=0 turns it off); it takes effect when subquad
# is imported before the process's first large CPU tensor.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from subquad import heap  # noqa: E402

heap.keep_freed()          # freed CPU memory kept for the next tensor (subquad/heap.py; SUBQUAD_KEEP_FREED=0: not)

from subquad import layers, models, ops  # noqa: E402
from subquad.layers import build_mixer  # noqa: E402
from subquad.models import LanguageModel, ModelConfig, from_pretrained, preset  # noqa: E402

__all__ = ["__version__", "ops", "layers", "models", "build_mixer", "ModelConfig", "LanguageModel", "preset",
           "from_pretrained"]
