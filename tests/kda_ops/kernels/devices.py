"""Where the kernel tests run: CUDA when present, else CPU through Triton's interpreter."""

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter's low-precision support is incomplete; it checks fp32 only.
DTYPES = [torch.float32, torch.bfloat16, torch.float16] if DEVICE == "cuda" else [torch.float32]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """FLA's metric: ||expected - got|| / ||expected||, in float64."""
    expected = expected.double()
    return ((got.double() - expected).norm() / expected.norm().clamp_min(1e-30)).item()
