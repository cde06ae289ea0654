"""A Triton kernel launch as data: the kernel, its grid, its arguments by name and the
tensors it writes. The launch planning that builds one serves both the eager op, which
:meth:`KernelLaunch.run` s it, and Inductor, which gets it as its own functional
Triton-kernel node (:meth:`KernelLaunch.functional`, see ``lowering/inductor/triton_kernels.py``)
and then compiles and launches the kernel from the generated code itself."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from torch import Tensor

# Launch options that are not kernel parameters; Inductor takes them as a kernel config.
LAUNCH_OPTIONS = ("num_warps", "num_stages")


@dataclass(frozen=True)
class KernelLaunch:
    """``kernel[grid](**args)``, where ``args`` names every kernel parameter (constexprs
    too) and may hold the :data:`LAUNCH_OPTIONS`; ``writes`` names the tensor arguments
    the kernel stores to (the others it only reads)."""

    kernel: Any  # a triton JITFunction
    grid: tuple[Any, ...]
    args: dict[str, Any]
    writes: tuple[str, ...]

    def run(self) -> None:
        """Launch now."""
        self.kernel[self.grid](**self.args)

    def functional(self) -> dict[str, Tensor]:
        """The launch as Inductor's ``triton_kernel_wrapper_functional`` node, traced (call
        it under ``make_fx``): returns the written tensors by name, new values that
        Inductor's re-inplacing pass writes into the arguments themselves where nothing
        else reads those afterwards."""
        from torch._higher_order_ops.triton_kernel_wrap import (
            kernel_side_table,
            triton_kernel_wrapper_functional,
        )

        options = tuple((k, self.args[k]) for k in LAUNCH_OPTIONS if k in self.args)
        arguments = {k: v for k, v in self.args.items() if k not in LAUNCH_OPTIONS}
        # The graph holds tensors and scalars; the rest (None pointers) goes to the side table.
        constants = {k: v for k, v in arguments.items() if v is None}
        traced = {k: v for k, v in arguments.items() if v is not None}
        outputs = triton_kernel_wrapper_functional(
            kernel_idx=kernel_side_table.add_kernel(_with_options(self.kernel, options)),
            constant_args_idx=kernel_side_table.add_constant_args(constants),
            grid=[(*self.grid, *(1,) * (3 - len(self.grid)))],  # Inductor's launchers take 3
            tma_descriptor_metadata={},
            kwargs=traced,
            tensors_to_clone=list(self.writes),
        )
        return {name: outputs[name] for name in self.writes}


@functools.cache
def _with_options(kernel: Any, options: tuple[tuple[str, Any], ...]) -> Any:
    """``kernel`` as a one-config autotuner carrying the launch options, the form in which
    Inductor takes ``num_warps`` / ``num_stages`` for a user kernel."""
    if not options:
        return kernel
    import triton

    return triton.autotune(configs=[triton.Config({}, **dict(options))], key=[])(kernel)
