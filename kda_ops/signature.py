"""The delta-rule ops' arguments as two Python types, and the ops' registration from them.

Every delta-rule op (``kda::chunk``, ``kda::recurrent``, their training, backward and
chunk-state flavours, ``kda::recurrent_``, ``kda::verify``) takes the same seven tensors
first (:class:`DeltaRuleInputs`) and the same four scalars last (:class:`DeltaRuleOptions`);
only what lies between differs (the initial state and ``cu_seqlens``, a state pool,
cotangents, kept tensors). A custom op's schema takes tensors and scalars only, so it
spells them out; the Python side passes them grouped. :func:`define_op` infers an op's
schema from a reference kernel written with these types, each spread into its fields (the
schema of writing every argument out), and :func:`fake_kernel` / :func:`cuda_kernel`
register the other kernels of ops that share a signature, grouped the same way.
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Optional, TypeVar

import torch
from torch import Tensor
from torch.library import CustomOpDef

Kernel = TypeVar("Kernel", bound=Callable[..., Any])


class DeltaRuleInputs(NamedTuple):
    """The tensors every delta-rule op takes first (FLA's layouts).

    q, k ``[B, T, H, K]``; v ``[B, T, HV, V]`` with ``HV % H == 0``; g ``[B, T, HV, K]``
    (KDA) or ``[B, T, HV]`` (Gated DeltaNet); beta ``[B, T, HV]``; q, k, v in one float
    dtype. A_log ``[HV]`` and dt_bias ``[HV * K]`` (``[HV]`` for GDN), float32 (float64
    for float64 inputs): the gate computed from a raw g, or both ``None`` when g is the
    log-decay itself.
    """

    q: Tensor
    k: Tensor
    v: Tensor
    g: Tensor
    beta: Tensor
    A_log: Optional[Tensor]
    dt_bias: Optional[Tensor]

    def map_tokens(self, fn: Callable[[Tensor], Tensor]) -> DeltaRuleInputs:
        """``fn`` applied to the per-token tensors q, k, v, g, beta (``[B, T, ...]``);
        A_log and dt_bias, per head, stay as they are."""
        return DeltaRuleInputs(*(fn(x) for x in self[:5]), self.A_log, self.dt_bias)


class DeltaRuleOptions(NamedTuple):
    """The delta-rule ops' scalar arguments, last in every schema, in this order:
    ``*options`` fills the trailing arguments of an op or a Triton launcher.

    scale: the query scale (``K ** -0.5`` when the caller gave none).
    lower_bound: the safe gate's negative bound (with A_log); ``None``: the softplus gate.
    use_qk_l2norm: q and k are divided by their norms first.
    use_beta_sigmoid: beta is a pre-activation (the ops apply the sigmoid).

    A tuple, not a dataclass: Dynamo unpacks a named tuple on every torch this package
    supports, a user-defined ``__iter__`` not (torch 2.11 cannot trace ``*options`` then).
    A_log and dt_bias are no options but tensor inputs of the ops (:class:`DeltaRuleInputs`):
    they have gradients, so autograd must save them and export must trace them.
    """

    scale: float
    lower_bound: Optional[float]
    use_qk_l2norm: bool
    use_beta_sigmoid: bool


# The parameter types a kernel takes grouped; the schema takes their fields one by one.
_GROUPED_TYPES = (DeltaRuleInputs, DeltaRuleOptions)


class _Grouping:
    """How the flat arguments of an op group into its reference kernel's parameters: one
    annotated with a type of ``_GROUPED_TYPES`` takes as many as the type has fields, any
    other parameter one."""

    def __init__(self, reference: Callable[..., object]) -> None:
        hints = typing.get_type_hints(reference)
        self._parts: list[tuple[Optional[type], int]] = []
        flat = []
        for name in inspect.signature(reference).parameters:
            kind = hints[name]
            grouped = kind in _GROUPED_TYPES
            fields = typing.get_type_hints(kind) if grouped else {name: kind}
            self._parts.append((kind if grouped else None, len(fields)))
            flat += [
                inspect.Parameter(field, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=hint)
                for field, hint in fields.items()
            ]
        self.signature = inspect.Signature(flat, return_annotation=hints["return"])

    def group(self, args: Sequence[object]) -> list[object]:
        """``args`` grouped; any past the reference's parameters follow as they are."""
        grouped, start = [], 0
        for kind, size in self._parts:
            grouped.append(args[start] if kind is None else kind(*args[start : start + size]))
            start += size
        return [*grouped, *args[start:]]

    def flat(self, kernel: Callable[..., object]) -> Callable[..., object]:
        """``kernel``, which takes grouped arguments, as the dispatcher calls it (with the
        flat ones, positionally: the schemas have no keyword-only arguments)."""

        @functools.wraps(kernel)
        def flat_kernel(*args: object) -> object:
            return kernel(*self.group(args))

        flat_kernel.__signature__ = self.signature  # what torch infers the schema from
        return flat_kernel


# Each op's grouping and reference kernel, for the kernels registered after it.
_DEFINED: dict[CustomOpDef, tuple[_Grouping, Callable[..., object]]] = {}


def define_op(
    name: str, reference: Callable[..., object], mutates_args: tuple[str, ...] = ()
) -> CustomOpDef:
    """The custom op ``name`` with ``reference`` as its kernel on every device.

    Its schema is inferred from ``reference``'s annotations with each
    :class:`DeltaRuleInputs` and :class:`DeltaRuleOptions` parameter spread into its fields
    (names and types), and ``reference`` is called with them grouped again.
    """
    grouping = _Grouping(reference)
    op = torch.library.custom_op(name, grouping.flat(reference), mutates_args=mutates_args)
    _DEFINED[op] = (grouping, reference)
    return op


def group_arguments(op: CustomOpDef, args: Sequence[object]) -> list[object]:
    """The flat arguments ``args`` of ``op`` (an autograd ``setup_context``'s inputs)
    grouped as its reference takes them; any past those follow as they are."""
    return _DEFINED[op][0].group(args)


def flat_kernel(op: CustomOpDef, kernel: Callable[..., object]) -> Callable[..., object]:
    """``kernel``, which takes ``op``'s arguments grouped as its reference does, as a
    function of the op's flat arguments (what the dispatcher or a decomposition calls)."""
    return _DEFINED[op][0].flat(kernel)


def fake_kernel(*ops: CustomOpDef) -> Callable[[Kernel], Kernel]:
    """Decorator: the function is the fake kernel of every op in ``ops`` (called with each
    op's arguments grouped as its reference takes them)."""

    def register(fake: Kernel) -> Kernel:
        for op in ops:
            op.register_fake(flat_kernel(op, fake))
        return fake

    return register


def cuda_kernel(
    *ops: CustomOpDef, runs: Callable[[DeltaRuleInputs], bool]
) -> Callable[[Kernel], Kernel]:
    """Decorator: the function is the CUDA kernel of every op in ``ops`` (called with
    grouped arguments, DeltaRuleInputs first) for the inputs ``runs`` accepts; the others
    run the op's reference."""

    def register(kernel: Kernel) -> Kernel:
        for op in ops:
            grouping, reference = _DEFINED[op]
            op.register_kernel("cuda")(grouping.flat(_either(kernel, reference, runs)))
        return kernel

    return register


def _either(
    kernel: Callable[..., object],
    reference: Callable[..., object],
    runs: Callable[[DeltaRuleInputs], bool],
) -> Callable[..., object]:
    @functools.wraps(kernel)
    def either(inputs: DeltaRuleInputs, *rest: object) -> object:
        return (kernel if runs(inputs) else reference)(inputs, *rest)

    return either
