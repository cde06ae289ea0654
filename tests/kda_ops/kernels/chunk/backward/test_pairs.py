"""Launch choices of the backward's pairs kernel (``chunk/backward/pairs.py``)."""

import torch

from kda_ops.kernels.chunk.backward.pairs import DIAGONAL_PRECISION, diagonal_precision


def test_diagonal_blocks_split_products_only_for_low_precision_inputs_on_cuda():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert diagonal_precision("tf32", cuda) == DIAGONAL_PRECISION  # bf16 / fp16 inputs
    assert diagonal_precision("ieee", cuda) == "ieee"  # fp32 inputs stay exact
    assert diagonal_precision("tf32", cpu) == "ieee"  # the interpreter has no bf16x3
