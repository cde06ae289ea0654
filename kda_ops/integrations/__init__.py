"""Drop-in routing of existing model code to ``torch.ops.kda``.

``enable()`` swaps the kernel functions that transformers' hybrid models and
flash-linear-attention (FLA) callers use for ``kda_ops`` functions with the same call
conventions, so models compile with ``torch.compile(fullgraph=True)`` and export with
``torch.export`` without edits; ``disable()`` puts the originals back. Neither transformers
nor FLA is imported until ``enable()`` runs.

Targets:

- ``"kimi_linear"``, ``"glm5_next"``: transformers' KDA model files,
- ``"qwen3_next"``: transformers' Gated DeltaNet model file,
- ``"fla"``: ``fla.ops.kda``, ``fla.ops.gated_delta_rule``, ``fla.modules`` (see
  :mod:`kda_ops.integrations.fla`).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterable
from typing import Optional

from kda_ops.integrations._patch import Patch, PatchSet


def _kimi(model: str) -> Callable[[], list[Patch]]:
    def patches() -> list[Patch]:
        from kda_ops.integrations import kimi_linear

        return kimi_linear.patches(model)

    return patches


def _qwen3_next() -> list[Patch]:
    from kda_ops.integrations import qwen3_next

    return qwen3_next.patches()


def _fla() -> list[Patch]:
    from kda_ops.integrations import fla

    return fla.patches()


# target -> (package it needs, factory of its swaps)
_TARGETS: dict[str, tuple[str, Callable[[], list[Patch]]]] = {
    "kimi_linear": ("transformers", _kimi("kimi_linear")),
    "glm5_next": ("transformers", _kimi("glm5_next")),
    "qwen3_next": ("transformers", _qwen3_next),
    "fla": ("fla", _fla),
}
_ACTIVE: dict[str, PatchSet] = {name: PatchSet() for name in _TARGETS}

TARGETS = tuple(_TARGETS)


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def _resolve(targets: Optional[Iterable[str]], only_installed: bool) -> list[str]:
    if targets is None:
        names = list(_TARGETS)
        return [n for n in names if _installed(_TARGETS[n][0])] if only_installed else names
    if isinstance(targets, str):
        raise TypeError("`targets` must be an iterable of target names, not a string")
    names = list(targets)
    unknown = [n for n in names if n not in _TARGETS]
    if unknown:
        raise ValueError(f"unknown integration target(s) {unknown}; known: {list(_TARGETS)}")
    return names


def enable(targets: Optional[Iterable[str]] = None) -> tuple[str, ...]:
    """Route the given targets (default: every target whose library is installed) to
    ``torch.ops.kda``. Idempotent. Returns the targets now enabled.

    Raises ``ValueError`` for an unknown target and ``ImportError`` when a named target's
    library (or model file) cannot be imported.
    """
    for name in _resolve(targets, only_installed=True):
        package, factory = _TARGETS[name]
        if not _installed(package):
            raise ImportError(f"kda_ops.integrations: target {name!r} needs `{package}`")
        if not _ACTIVE[name].active:
            _ACTIVE[name].apply(factory())
    if _installed("onnxscript"):
        # The patched models now hold kda ops: any torch.onnx.export of them (transformers'
        # OnnxExporter included) finds their translations without naming our table.
        importlib.import_module("lowering.onnx")
    return enabled()


def disable(targets: Optional[Iterable[str]] = None) -> None:
    """Restore the original functions of the given targets (default: all). Idempotent."""
    for name in _resolve(targets, only_installed=False):
        _ACTIVE[name].undo()


def enabled() -> tuple[str, ...]:
    """The targets currently routed to ``torch.ops.kda``."""
    return tuple(name for name, patch_set in _ACTIVE.items() if patch_set.active)


__all__ = ["TARGETS", "disable", "enable", "enabled"]
