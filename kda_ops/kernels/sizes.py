"""Block sizes and grid extents the launchers compute on the host, and the device limits
they size against.

``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr functions, callable from
kernels too, and each host call pays for unwrapping its arguments as constexprs, many
times the integer arithmetic itself; a prefill of the hybrid model makes dozens of such
calls from our launchers. These are the same arithmetic for host ints.
"""

import dataclasses
import functools
from typing import Optional

import torch
import triton


def cdiv(numerator: int, denominator: int) -> int:
    """``ceil(numerator / denominator)`` (numerator >= 0, denominator >= 1)."""
    return -(-numerator // denominator)


def next_power_of_2(n: int) -> int:
    """The smallest power of two at least ``n`` (``n >= 1``)."""
    return 1 << (n - 1).bit_length()


@functools.cache
def processors(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (queried once per device); 1 elsewhere
    (Triton's interpreter)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


SM90_SHARED_MEMORY = 227 * 1024  # bytes a block may take on Hopper


@functools.cache
def shared_memory(device: torch.device) -> int:
    """Bytes of shared memory a block may take on a CUDA device (the limit Triton checks a
    launch against; queried once per device); 0 elsewhere (Triton's interpreter)."""
    if device.type != "cuda":
        return 0
    index = torch.cuda.current_device() if device.index is None else device.index
    return triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]


@dataclasses.dataclass(frozen=True)
class DeviceSizes:
    """What launch planning reads of a device: its streaming multiprocessors (``None`` off
    CUDA, Triton's interpreter, which plans as for no GPU) and the bytes of shared memory a
    block may take. A launcher plans for its tensors' device (:func:`device_sizes`) unless
    given another: an ahead-of-time build plans for the device it compiles for
    (:data:`HOPPER`)."""

    processors: Optional[int]
    shared_memory: int


# The sm_90 GPUs the TensorRT plugins are compiled for (``lowering/tensorrt.py``): 132 SMs
# (H100 SXM, H200) and 227 KB a block.
HOPPER = DeviceSizes(processors=132, shared_memory=SM90_SHARED_MEMORY)


@functools.cache
def device_sizes(device: torch.device) -> DeviceSizes:
    """:func:`processors` and :func:`shared_memory` of ``device``; no SMs off CUDA."""
    if device.type != "cuda":
        return DeviceSizes(processors=None, shared_memory=shared_memory(device))
    return DeviceSizes(processors=processors(device), shared_memory=shared_memory(device))
