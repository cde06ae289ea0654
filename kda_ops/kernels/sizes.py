"""Block sizes and grid extents the launchers compute on the host, and the device limits
they size against.

``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr functions, callable from
kernels too, and each host call pays for unwrapping its arguments as constexprs, many
times the integer arithmetic itself; a prefill of the hybrid model makes dozens of such
calls from our launchers. These are the same arithmetic for host ints.
"""

import functools

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
