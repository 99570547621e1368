import os

import torch

# Triton reads this when a kernel is decorated, so it must be set before any kernels module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
