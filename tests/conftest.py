import os

import torch
from hypothesis import settings

# Bounded property tests: the whole suite must stay well under 10 minutes on 2 cores.
settings.register_profile("subquad", max_examples=int(os.environ.get("SUBQUAD_HYPOTHESIS_EXAMPLES", 12)),
                          deadline=None, derandomize=False)
settings.load_profile("subquad")
torch.set_num_threads(min(2, torch.get_num_threads()))
