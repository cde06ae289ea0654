"""Argument checks run by the public functions before any kernel.

Every failure is a ``TypeError`` (wrong kind or dtype) or ``ValueError`` (wrong shape,
device or flag combination) whose message names the function, the argument and what was
expected. Checks read shapes, dtypes and devices, and tensor values only where reading
them costs no device sync: the offsets in ``cu_seqlens`` are checked when they are on the
host (a CPU ``cu_seqlens``, or FLA's ``cu_seqlens_cpu``), and on the device only in the
debug mode :data:`CHECK_SEQLENS_ENV`. Under ``torch.compile`` / ``torch.export`` (fake
tensors) no value is read, so the checks trace unchanged.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from itertools import pairwise

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)
MAX_HEAD_DIM = 256

CHECK_SEQLENS_ENV = "KDA_CHECK_CU_SEQLENS"
"""Set to ``1`` to check the offsets of a device ``cu_seqlens`` too (start at 0,
non-decreasing, end at T): a device-to-host copy and a sync per call, for debugging.
Off by default: then only offsets already on the host are checked."""


def check_device_seqlens() -> bool:
    """Whether the :data:`CHECK_SEQLENS_ENV` debug mode is on."""
    return os.environ.get(CHECK_SEQLENS_ENV, "0") not in ("", "0")


def _values_on_host(offsets: Tensor) -> bool:
    """Whether ``offsets`` holds real values readable without a device sync."""
    if torch.compiler.is_compiling() or is_fake(offsets):
        return False
    return offsets.device.type == "cpu"


def _values_on_device(offsets: Tensor) -> bool:
    """Whether ``offsets`` holds real values on an accelerator (readable with a sync)."""
    if torch.compiler.is_compiling() or is_fake(offsets):
        return False
    return offsets.device.type not in ("cpu", "meta")


class ArgumentChecker:
    """Checks the arguments of one public function; messages start with its name."""

    def __init__(self, function: str) -> None:
        self.function = function

    def fail(self, error: type[Exception], message: str) -> None:
        raise error(f"{self.function}: {message}")

    def tensor(
        self,
        name: str,
        x: object,
        *,
        dims: int | Sequence[int] | None = None,
        dtypes: Sequence[torch.dtype] = FLOAT_DTYPES,
    ) -> Tensor:
        if not isinstance(x, Tensor):
            self.fail(TypeError, f"`{name}` must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in dtypes:
            names = ", ".join(str(d) for d in dtypes)
            self.fail(TypeError, f"`{name}` must have dtype in ({names}), got {x.dtype}")
        allowed = (dims,) if isinstance(dims, int) else dims
        if allowed is not None and x.dim() not in allowed:
            expected = " or ".join(str(d) for d in allowed)
            self.fail(ValueError, f"`{name}` must be {expected}-D, got shape {tuple(x.shape)}")
        return x

    def shape(self, name: str, x: Tensor, expected: Sequence[object], layout: str) -> None:
        if tuple(x.shape) != tuple(expected):
            self.fail(
                ValueError,
                f"`{name}` must have shape {layout} = {tuple(expected)}, got {tuple(x.shape)}",
            )

    def same_device(self, **tensors: Tensor | None) -> None:
        present = {name: t for name, t in tensors.items() if t is not None}
        first_name, first = next(iter(present.items()))
        for name, t in present.items():
            if t.device != first.device:
                self.fail(
                    ValueError,
                    f"all tensors must be on one device: `{first_name}` is on {first.device} "
                    f"but `{name}` is on {t.device}",
                )

    def same_dtype(self, **tensors: Tensor) -> None:
        (first_name, first), *rest = tensors.items()
        for name, t in rest:
            if t.dtype != first.dtype:
                self.fail(
                    TypeError,
                    f"`{name}` must have the dtype of `{first_name}` ({first.dtype}), "
                    f"got {t.dtype}",
                )

    def state(
        self,
        name: str,
        x: object,
        expected: Sequence[object],
        inputs: Tensor,
        allow_bf16: bool = False,
    ) -> Tensor:
        """A recurrent state: float32 (float64 when the inputs are float64; bfloat16 too
        where ``allow_bf16``: a serving pool that trades precision for memory)."""
        if inputs.dtype == torch.float64:
            dtypes = (torch.float64,)
        else:
            dtypes = (torch.float32, torch.bfloat16) if allow_bf16 else (torch.float32,)
        state = self.tensor(name, x, dims=4, dtypes=dtypes)
        self.shape(name, state, expected, "(N, HV, K, V)")
        return state

    def cu_seqlens(self, cu_seqlens: object, batch: int, length: int | None = None) -> Tensor:
        """int32 / int64 offsets ``[N + 1]`` of packed sequences (``B == 1``). With
        ``length`` (T), the offsets themselves too (:meth:`offsets`) where that costs no
        sync: on the host always, on the device in the debug mode. Without it the caller
        checks them (context parallelism's global offsets, against every rank's T)."""
        seqlens = self.tensor("cu_seqlens", cu_seqlens, dims=1, dtypes=INDEX_DTYPES)
        if batch != 1:
            self.fail(
                ValueError,
                f"with `cu_seqlens` the batch size must be 1 (sequences are packed along T), "
                f"got B = {batch}",
            )
        if seqlens.shape[0] < 2:
            self.fail(ValueError, "`cu_seqlens` must hold at least 2 offsets [0, ..., T]")
        if length is None:
            return seqlens
        if _values_on_host(seqlens):
            self.offsets("cu_seqlens", seqlens, length)
        elif check_device_seqlens() and _values_on_device(seqlens):
            self.offsets("cu_seqlens", seqlens.cpu(), length)  # the debug mode's sync
        return seqlens

    def offsets(self, name: str, offsets: Tensor, length: int | None) -> None:
        """Host offsets ``[0, ..., T]``: first 0, non-decreasing (an empty sequence is
        allowed), last ``length`` (T, the packed length) where given."""
        values = offsets.tolist()
        if values[0] != 0:
            self.fail(ValueError, f"`{name}` must start at 0, got {values[0]}")
        for i, (start, stop) in enumerate(pairwise(values)):
            if stop < start:
                self.fail(
                    ValueError,
                    f"`{name}` must be non-decreasing, got {name}[{i}] = {start} > "
                    f"{name}[{i + 1}] = {stop}",
                )
        if length is not None and values[-1] != length:
            self.fail(
                ValueError,
                f"`{name}` must end at the packed length T = {length}, got {values[-1]}",
            )

    def state_indices(self, state_indices: object, n_seqs: int) -> Tensor:
        indices = self.tensor("state_indices", state_indices, dims=1, dtypes=INDEX_DTYPES)
        self.shape("state_indices", indices, (n_seqs,), "(N,)")
        return indices

    def state_pool(
        self,
        state_pool: object,
        state_indices: object,
        n_seqs: int,
        q: Tensor,
        v: Tensor,
        allow_bf16: bool = False,
    ) -> Tensor:
        """A pool ``[P, HV, K, V]`` addressed by ``state_indices`` ``[N]`` (``P == N``
        without indices), on q's device; dtypes as :meth:`state`."""
        pool_size = state_pool.shape[0] if isinstance(state_pool, Tensor) else 0
        if state_indices is None:
            pool_size = n_seqs
        else:
            self.state_indices(state_indices, n_seqs)
        expected = (pool_size, v.shape[2], q.shape[3], v.shape[3])
        pool = self.state("state_pool", state_pool, expected, q, allow_bf16)
        self.same_device(q=q, state_pool=pool, state_indices=state_indices)
        return pool


def check_delta_rule(
    function: str,
    q: object,
    k: object,
    v: object,
    g: object,
    beta: object,
    *,
    A_log: object,
    dt_bias: object,
    lower_bound: float | None,
    use_gate_in_kernel: bool,
    cu_seqlens: object,
    initial_state: object = None,
    global_offsets: bool = False,
) -> int:
    """Checks the inputs shared by chunk and recurrent KDA / GDN; returns N, the number
    of sequences (B, or ``len(cu_seqlens) - 1``). ``cu_seqlens``'s offsets end at T, q's
    length, unless ``global_offsets`` (context parallelism: the offsets of the whole packed
    batch, of which q holds one rank's share, checked by the caller against all ranks)."""
    check = ArgumentChecker(function)
    q = check.tensor("q", q, dims=4)
    k = check.tensor("k", k, dims=4)
    v = check.tensor("v", v, dims=4)
    g = check.tensor("g", g, dims=(3, 4))
    beta = check.tensor("beta", beta, dims=3)
    check.same_dtype(q=q, k=k, v=v)
    batch, length, heads, head_k = q.shape
    value_heads, head_v = v.shape[2], v.shape[3]
    check.shape("k", k, q.shape, "(B, T, H, K) like `q`")
    check.shape("v", v, (batch, length, value_heads, head_v), "(B, T, HV, V)")
    if value_heads % heads != 0:
        check.fail(
            ValueError,
            f"the value heads of `v` (HV = {value_heads}) must be a multiple of the q/k "
            f"heads (H = {heads})",
        )
    for name, size in (("K", head_k), ("V", head_v)):
        if size > MAX_HEAD_DIM:
            check.fail(ValueError, f"head dim {name} = {size} exceeds {MAX_HEAD_DIM}")
    if g.dim() == 4:
        check.shape("g", g, (batch, length, value_heads, head_k), "(B, T, HV, K)")
    else:
        check.shape("g", g, (batch, length, value_heads), "(B, T, HV) (Gated DeltaNet)")
    check.shape("beta", beta, (batch, length, value_heads), "(B, T, HV)")
    if use_gate_in_kernel:
        if A_log is None:
            check.fail(ValueError, "`use_gate_in_kernel=True` needs `A_log` of shape (HV,)")
        A_log = check.tensor("A_log", A_log, dims=1)
        check.shape("A_log", A_log, (value_heads,), "(HV,)")
        if dt_bias is not None:
            channels = value_heads * (head_k if g.dim() == 4 else 1)
            dt_bias = check.tensor("dt_bias", dt_bias, dims=1)
            layout = "(HV * K,)" if g.dim() == 4 else "(HV,)"
            check.shape("dt_bias", dt_bias, (channels,), layout)
        if lower_bound is not None and not lower_bound < 0:
            check.fail(ValueError, f"`lower_bound` must be negative, got {lower_bound}")
    n_seqs = batch
    if cu_seqlens is not None:
        end = None if global_offsets else length
        n_seqs = check.cu_seqlens(cu_seqlens, batch, end).shape[0] - 1
    if initial_state is not None:
        check.state("initial_state", initial_state, (n_seqs, value_heads, head_k, head_v), q)
    check.same_device(
        q=q,
        k=k,
        v=v,
        g=g,
        beta=beta,
        A_log=A_log if use_gate_in_kernel else None,
        dt_bias=dt_bias if use_gate_in_kernel else None,
        cu_seqlens=cu_seqlens,
        initial_state=initial_state,
    )
    return n_seqs
