from __future__ import annotations

import os

# Triton kernels run on the CPU through the interpreter when no GPU is present.  The
# variable is read when a kernel is decorated, so it must be set before kernel modules load.
try:
    import torch

    _has_cuda = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _has_cuda = False
if not _has_cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")
