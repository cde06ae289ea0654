"""Which transformers functions and classes kda_ops replaces, and how one is recognised.

A *role* is one kind of function a model file defines: the chunked or recurrent Gated
DeltaNet / KDA delta rule, the prefill or decode causal conv, the gated RMSNorm. A module
attribute plays a role when its name is the role's name (that is how the model code calls
it: through its module's globals) **and** its convention is ours:

1. its parameters start with the role's parameters, in that order, and every parameter it
   has is one the replacement accepts (a model that renamed ``initial_state`` or reordered
   ``g`` and ``beta`` is not ours);
2. a probe call on small random float32 inputs (fixed seed, its own generator, CPU) gives
   what the replacement gives: same output layout, same state layout, same gate, beta and
   l2norm conventions, GQA head grouping included. The probe runs the module's own PyTorch
   function (the ``__wrapped__`` fallback when transformers bound an external kernel).

Recognition never looks at which model the module belongs to, so a model file added to
transformers later that copies one of these functions is recognised as it is.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from kda_ops.integrations import _transformers

_TOLERANCE = dict(rtol=1e-4, atol=1e-5)


class ConventionMismatch(Exception):
    """An attribute has a role's name but not its convention (the message says why)."""


@dataclass(frozen=True)
class Role:
    """A function kda_ops replaces: the names model files give it, the leading parameters of
    its convention, the replacement, and the probe that compares the two."""

    name: str
    attribute_names: tuple[str, ...]
    parameters: tuple[str, ...]
    replacement: Callable[..., Any]
    probe: Callable[[Callable[..., Any], Callable[..., Any]], None]
    # Whether a module that defines this role is one kda_ops integrates (the delta rules);
    # the conv and norm roles are swapped alongside a delta rule, never alone (Mamba-family
    # files share the conv names but not the rest of the layer).
    anchor: bool


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _randn(*shape: int, generator: torch.Generator) -> Tensor:
    return torch.randn(*shape, generator=generator, dtype=torch.float32, device="cpu")


def _same(name: str, actual: Any, expected: Any) -> None:
    """Raise :class:`ConventionMismatch` unless two probe results agree."""
    if isinstance(expected, (tuple, list)):
        if not isinstance(actual, (tuple, list)) or len(actual) != len(expected):
            raise ConventionMismatch(f"{name}: returns {type(expected).__name__} of another arity")
        for index, (got, want) in enumerate(zip(actual, expected)):
            _same(f"{name}[{index}]", got, want)
        return
    if expected is None or actual is None:
        if expected is not actual:
            raise ConventionMismatch(f"{name}: returns None where kda_ops returns a tensor")
        return
    if not isinstance(expected, Tensor) or expected.shape != actual.shape:
        shape = getattr(expected, "shape", type(expected).__name__)
        raise ConventionMismatch(f"{name}: returns shape {shape}, kda_ops {tuple(actual.shape)}")
    try:
        torch.testing.assert_close(actual.float(), expected.float(), **_TOLERANCE)
    except AssertionError as error:
        first = str(error).splitlines()[0]
        raise ConventionMismatch(f"{name}: computes something else ({first})") from None


def _delta_rule_probe(per_channel_gate: bool, chunked: bool) -> Callable[..., None]:
    def probe(original: Callable[..., Any], replacement: Callable[..., Any]) -> None:
        # K != V, T not a chunk multiple; for Gated DeltaNet one q/k head shared by two value
        # heads (the GVA head repeat its functions do inside), KDA callers pass H == HV.
        generator = _generator()
        batch, length, value_heads, key_dim, value_dim = 2, 5, 2, 8, 4
        heads = 2 if per_channel_gate else 1
        query = _randn(batch, length, heads, key_dim, generator=generator)
        key = _randn(batch, length, heads, key_dim, generator=generator)
        value = _randn(batch, length, value_heads, value_dim, generator=generator)
        gate_shape = (batch, length, value_heads) + ((key_dim,) if per_channel_gate else ())
        g = -torch.nn.functional.softplus(_randn(*gate_shape, generator=generator))
        beta = torch.sigmoid(_randn(batch, length, value_heads, generator=generator))
        state = _randn(batch, value_heads, key_dim, value_dim, generator=generator)
        if not chunked:
            length = 1
            query, key, value, g, beta = (t[:, :1] for t in (query, key, value, g, beta))
        arguments = dict(g=g, beta=beta, initial_state=state, output_final_state=True,
                         use_qk_l2norm_in_kernel=True)  # fmt: skip
        expected = original(query, key, value, **arguments)
        actual = replacement(query, key, value, **arguments)
        _same("(output, final_state)", actual, expected)

    return probe


def _conv_fn_probe(original: Callable[..., Any], replacement: Callable[..., Any]) -> None:
    generator = _generator()
    x, weight, bias = (_randn(2, 6, 7, generator=generator), _randn(6, 4, generator=generator),
                       _randn(6, generator=generator))  # fmt: skip
    _same("output", replacement(x, weight, bias, activation="silu"),
          original(x, weight, bias, activation="silu"))  # fmt: skip


def _conv_update_probe(original: Callable[..., Any], replacement: Callable[..., Any]) -> None:
    generator = _generator()
    x, weight, bias = (_randn(2, 6, 1, generator=generator), _randn(6, 4, generator=generator),
                       _randn(6, generator=generator))  # fmt: skip
    state = _randn(2, 6, 4, generator=generator)
    expected_state, actual_state = state.clone(), state.clone()
    expected = original(x, expected_state, weight, bias, "silu")
    actual = replacement(x, actual_state, weight, bias, "silu")
    _same("output", actual, expected)
    _same("conv_state (updated in place)", actual_state, expected_state)


CHUNK_GATED_DELTA_RULE = Role(
    name="chunk_gated_delta_rule",
    attribute_names=("torch_chunk_gated_delta_rule",),
    parameters=(
        "query",
        "key",
        "value",
        "g",
        "beta",
        "chunk_size",
        "initial_state",
        "output_final_state",
        "use_qk_l2norm_in_kernel",
    ),
    replacement=_transformers.chunk_delta_rule,
    probe=_delta_rule_probe(per_channel_gate=False, chunked=True),
    anchor=True,
)
RECURRENT_GATED_DELTA_RULE = Role(
    name="recurrent_gated_delta_rule",
    attribute_names=("torch_recurrent_gated_delta_rule",),
    # The chunked form's, but for its chunk size.
    parameters=tuple(p for p in CHUNK_GATED_DELTA_RULE.parameters if p != "chunk_size"),
    replacement=_transformers.recurrent_delta_rule,
    probe=_delta_rule_probe(per_channel_gate=False, chunked=False),
    anchor=True,
)
CHUNK_KDA = Role(
    name="chunk_kda",
    attribute_names=("chunk_kimi_delta_attention",),
    parameters=CHUNK_GATED_DELTA_RULE.parameters,
    replacement=_transformers.chunk_delta_rule,
    probe=_delta_rule_probe(per_channel_gate=True, chunked=True),
    anchor=True,
)
RECURRENT_KDA = Role(
    name="recurrent_kda",
    attribute_names=("recurrent_kimi_delta_attention",),
    parameters=RECURRENT_GATED_DELTA_RULE.parameters,
    replacement=_transformers.recurrent_delta_rule,
    probe=_delta_rule_probe(per_channel_gate=True, chunked=False),
    anchor=True,
)
CAUSAL_CONV1D = Role(
    name="causal_conv1d",
    attribute_names=("causal_conv1d_fn",),
    parameters=("hidden_states", "weight", "bias", "activation"),
    replacement=_transformers.causal_conv1d_fn,
    probe=_conv_fn_probe,
    anchor=False,
)
CAUSAL_CONV1D_UPDATE = Role(
    name="causal_conv1d_update",
    attribute_names=("causal_conv1d_update",),
    parameters=("hidden_states", "conv_state", "weight", "bias", "activation"),
    replacement=_transformers.causal_conv1d_update,
    probe=_conv_update_probe,
    anchor=False,
)
FUNCTION_ROLES = (CHUNK_GATED_DELTA_RULE, RECURRENT_GATED_DELTA_RULE, CHUNK_KDA, RECURRENT_KDA,
                  CAUSAL_CONV1D, CAUSAL_CONV1D_UPDATE)  # fmt: skip
GATED_NORM_SUFFIX = "RMSNormGated"


def torch_function(function: Callable[..., Any]) -> Callable[..., Any]:
    """The PyTorch implementation behind a transformers kernel wrapper: transformers binds
    FLA / causal-conv1d kernels when they are importable and keeps the PyTorch function it
    falls back to as ``__wrapped__``."""
    return getattr(function, "__wrapped__", function)


def _check_parameters(
    role: Role, function: Callable[..., Any], replacement: Callable[..., Any]
) -> None:
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        raise ConventionMismatch("has no inspectable signature") from None
    named = [
        name for name, p in parameters.items()
        if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]  # fmt: skip
    leading = tuple(named[: len(role.parameters)])
    if leading != role.parameters:
        raise ConventionMismatch(
            f"parameters ({', '.join(named)}) do not start with ({', '.join(role.parameters)})"
        )
    accepted = inspect.signature(replacement).parameters
    takes_any = any(p.kind == p.VAR_KEYWORD for p in accepted.values())
    extra = [name for name in named if name not in accepted and not takes_any]
    if extra:
        raise ConventionMismatch(f"has parameters kda_ops does not take: {extra}")


def check_function(role: Role, function: Any) -> None:
    """Raise :class:`ConventionMismatch` unless ``function`` follows ``role``'s convention."""
    if not callable(function) or isinstance(function, type):
        raise ConventionMismatch(f"is a {type(function).__name__}, not a function")
    original = torch_function(function)
    _check_parameters(role, original, role.replacement)
    _run_probe(lambda: role.probe(original, role.replacement))


def _run_probe(probe: Callable[[], None]) -> None:
    # The probe builds its tensors on the CPU even under a default-device context (a model
    # file may be imported inside `with torch.device("meta")`), records no autograd graph,
    # and leaves the global RNG alone (its own generator).
    try:
        with torch.device("cpu"), torch.no_grad():
            probe()
    except ConventionMismatch:
        raise
    except Exception as error:  # the original's own error on our probe inputs
        raise ConventionMismatch(
            f"fails on a probe call: {type(error).__name__}: {error}"
        ) from None


def check_gated_norm(cls: Any) -> None:
    """Raise :class:`ConventionMismatch` unless the class is a gated RMSNorm with
    ``__init__(hidden_size, eps)``, ``forward(hidden_states, gate)``, the ``weight``,
    ``variance_epsilon`` and ``activation`` attributes, computing
    ``rmsnorm(x) · weight · act(gate)``."""
    if not isinstance(cls, type) or not issubclass(cls, torch.nn.Module):
        raise ConventionMismatch("is not a torch.nn.Module class")
    forward = vars(cls).get("forward")
    if forward is None:
        raise ConventionMismatch("defines no forward of its own")
    named = [n for n in inspect.signature(forward).parameters if n != "self"]
    if named[:2] != ["hidden_states", "gate"] or len(named) != 2:
        raise ConventionMismatch(f"forward takes ({', '.join(named)}), not (hidden_states, gate)")

    def probe() -> None:
        generator = _generator()
        try:
            module = cls(8, eps=1e-5)
        except TypeError as error:
            raise ConventionMismatch(
                f"is not built as cls(hidden_size, eps=...): {error}"
            ) from None
        attributes = ("weight", "variance_epsilon", "activation")
        missing = [a for a in attributes if not hasattr(module, a)]
        if missing:
            raise ConventionMismatch(f"has no {missing}")
        module.weight.copy_(_randn(8, generator=generator))
        x, gate = _randn(3, 8, generator=generator), _randn(3, 8, generator=generator)
        expected = forward(module, x, gate)
        _same("output", _transformers.gated_rms_norm_forward(module, x, gate), expected)

    _run_probe(probe)


def role_of(name: str) -> Optional[Role]:
    """The function role whose attribute names include ``name``."""
    return next((role for role in FUNCTION_ROLES if name in role.attribute_names), None)
