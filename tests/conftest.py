import os

import pytest
import torch

if not torch.cuda.is_available():
    # Without a GPU, the Triton kernels run on CPU tensors through Triton's interpreter
    # (set before kda_ops imports them; fp32 only: its bf16 tl.dot is broken).
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; run on the GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
