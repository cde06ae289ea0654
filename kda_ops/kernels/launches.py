"""A Triton kernel launch as data: the kernel, its grid, its arguments by name and the
tensors it writes; and an op's launches in order with the tensors that hold its results
(:class:`LaunchPlan`). The launch planning that builds them serves both the eager op,
which runs them, and Inductor, which gets each launch as its own functional Triton-kernel
node (:meth:`KernelLaunch.functional`, see ``lowering/inductor/triton_kernels.py``) and
then compiles and launches the kernels from the generated code itself."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Optional

from torch import Tensor

# Launch options that are not kernel parameters; Inductor takes them as a kernel config.
LAUNCH_OPTIONS = ("num_warps", "num_stages", "maxnreg")


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
        # The graph holds tensors and numbers; the rest (None pointers, string constexprs)
        # goes to the side table.
        constants = {k: v for k, v in arguments.items() if v is None or isinstance(v, str)}
        traced = {k: v for k, v in arguments.items() if k not in constants}
        outputs = triton_kernel_wrapper_functional(
            kernel_idx=kernel_side_table.add_kernel(_with_options(self.kernel, options)),
            constant_args_idx=kernel_side_table.add_constant_args(constants),
            grid=[(*self.grid, *(1,) * (3 - len(self.grid)))],  # Inductor's launchers take 3
            tma_descriptor_metadata={},
            kwargs=traced,
            tensors_to_clone=list(self.writes),
        )
        return {name: outputs[name] for name in self.writes}

    def plan(self) -> LaunchPlan:
        """This launch alone, its results the tensors it writes."""
        return LaunchPlan((self,), {name: self.args[name] for name in self.writes})


@dataclass(frozen=True)
class LaunchPlan:
    """Launches that run in order, each reading what the earlier ones wrote, and the
    tensors (allocated by the planning) that hold the op's results once they ran, by name
    (``None`` for a result the op does not make)."""

    launches: tuple[KernelLaunch, ...]
    results: dict[str, Optional[Tensor]]

    def run(self) -> dict[str, Optional[Tensor]]:
        """Launch now; returns :attr:`results`."""
        for launch in self.launches:
            launch.run()
        return self.results

    def functional(self) -> dict[str, Optional[Tensor]]:
        """The launches as functional kernel nodes, traced in order (as
        :meth:`KernelLaunch.functional`): a tensor an earlier launch wrote reaches the later
        ones as the value that node returned. Returns the results' final values by name."""
        latest: dict[int, Tensor] = {}  # by id of the planned tensor: its value so far
        for launch in self.launches:
            args = {
                name: latest.get(id(value), value) if isinstance(value, Tensor) else value
                for name, value in launch.args.items()
            }
            written = dataclasses.replace(launch, args=args).functional()
            for name, value in written.items():
                latest[id(launch.args[name])] = value
        return {
            name: None if tensor is None else latest.get(id(tensor), tensor)
            for name, tensor in self.results.items()
        }


@functools.cache
def _with_options(kernel: Any, options: tuple[tuple[str, Any], ...]) -> Any:
    """``kernel`` as a one-config autotuner carrying the launch options, the form in which
    Inductor takes ``num_warps`` / ``num_stages`` / ``maxnreg`` for a user kernel."""
    if not options:
        return kernel
    import triton

    return triton.autotune(configs=[triton.Config({}, **dict(options))], key=[])(kernel)
