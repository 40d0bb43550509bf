"""Beyond one process: exact ring attention, state passing for the recurrent mixers, and context
parallelism of a whole model (torch.distributed).

Model code stays single-device; these functions take each rank's shard of the
sequence and a process group (gloo on CPU, NCCL on GPUs; launched by torchrun).
"""

from subquad.distributed.context import ContextParallel, context_parallel
from subquad.distributed.ring import ring_attention, zigzag_shard, zigzag_unshard
from subquad.distributed.seqpar import fold_states, sequence_parallel

__all__ = ["ring_attention", "zigzag_shard", "zigzag_unshard", "sequence_parallel", "fold_states",
           "context_parallel", "ContextParallel"]
