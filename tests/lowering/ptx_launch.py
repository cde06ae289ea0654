"""A compiled plugin kernel launched as TensorRT's AOT launcher launches it: its PTX loaded
through the CUDA driver (cuda-python; the test skips without it) and called with input
pointers, int32 scalars, output pointers and Triton's two scratch pointers as null."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import pytest
import torch


def launch_ptx(
    compiled: object,
    grid: Sequence[int],
    threads: int,
    inputs: Sequence[torch.Tensor],
    ints: Sequence[int],
    outputs: Sequence[torch.Tensor],
) -> None:
    """Launch ``compiled`` (a Triton ``CompiledKernel``) on CUDA tensors, in plugin order,
    with its declared dynamic shared memory, and wait for it."""
    driver = pytest.importorskip("cuda.bindings.driver")
    module = _call(driver.cuModuleLoadData(compiled.asm["ptx"].encode() + b"\0"))
    function = _call(driver.cuModuleGetFunction(module, compiled.metadata.name.encode()))
    args = [
        *(ctypes.c_void_p(t.data_ptr()) for t in inputs),
        *(ctypes.c_int32(v) for v in ints),
        *(ctypes.c_void_p(t.data_ptr()) for t in outputs),
        ctypes.c_void_p(0), ctypes.c_void_p(0),
    ]  # fmt: skip
    pointers = (ctypes.c_void_p * len(args))(*(ctypes.addressof(a) for a in args))
    _call(driver.cuLaunchKernel(function, *grid, threads, 1, 1, compiled.metadata.shared, 0,
                                pointers, 0))  # fmt: skip
    torch.cuda.synchronize()


def _call(result: tuple) -> object:
    error, *values = result
    assert int(error) == 0, error
    return values[0] if len(values) == 1 else values
