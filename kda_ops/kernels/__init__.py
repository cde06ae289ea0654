"""Triton kernels for Hopper: the CUDA implementations of the ``kda`` ops.

Each module holds one kernel family and its launcher; the chunked forward (``chunk/``),
its backward (``chunk/backward/``) and the causal conv (``conv/``) are packages of such
modules. The launchers take already validated, contiguous inputs (the op registrations
call them); they also run on CPU tensors under ``TRITON_INTERPRET=1``, which is how CI
tests them.
"""

import importlib.util

AVAILABLE = importlib.util.find_spec("triton") is not None
