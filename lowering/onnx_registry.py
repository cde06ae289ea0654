"""Lazy registration of the ``kda`` ONNX translations with ``torch.onnx``'s exporter.

``import kda_ops`` calls :func:`install`, which costs nothing at import time: it imports
neither onnx, onnxscript nor ``torch.onnx``. The translations are registered on the first
``torch.onnx.export(..., dynamo=True)``, so a caller who never imports ``lowering.onnx``
exports a model holding ``kda`` ops, in the mode its opset picks (standard from opset 27,
portable below; :func:`lowering.onnx.register_default_translations`).

Mechanism (torch 2.11 to 2.14). The exporter builds a fresh registry on every export with
``torch.onnx._internal.exporter._registration.ONNXRegistry.from_torchlib``, from
torchlib's module-level list of ``OnnxDecompMeta`` entries (plus onnxscript's torchlib),
then adds the caller's ``custom_translation_table`` in front. torch offers no public hook
into that construction: ``torch.onnx.ops`` makes ONNX nodes from inside a model (a
``symbolic`` op in the traced graph), which would mean routing our ops' forward through
it, and a ``custom_translation_table`` must be passed by every caller. So :func:`install`
wraps ``from_torchlib``: it adds our entries to torchlib's list (once; a later explicit
:func:`~lowering.onnx.register_default_translations` replaces them) and then builds the
registry as before. The wrap is made when the exporter's registration module is first
imported (an import hook on ``sys.meta_path`` that watches for that one module name and
steps aside afterwards), or at once if it already is.

Limits: ``from_torchlib`` and the torchlib list are internals: if a torch release renames
them, the first export raises a ``RuntimeError`` that names what is missing and points to
``custom_translation_table=lowering.onnx.translation_table()``, which always works. The
legacy TorchScript exporter (``dynamo=False``) is not covered.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType
from typing import Optional

REGISTRATION_MODULE = "torch.onnx._internal.exporter._registration"


def _register_translations() -> None:
    if importlib.util.find_spec("onnxscript") is None:
        return  # the exporter itself needs onnxscript and will say so
    from lowering import onnx as kda_onnx

    kda_onnx.ensure_default_translations()


def _wrap_registry(module: ModuleType) -> None:
    """Make ``module.ONNXRegistry.from_torchlib`` register our translations first."""
    registry_class = getattr(module, "ONNXRegistry", None)
    original = getattr(registry_class, "from_torchlib", None)
    if original is None:
        raise RuntimeError(
            f"kda_ops: {REGISTRATION_MODULE}.ONNXRegistry.from_torchlib is gone in this torch; "
            "pass `custom_translation_table=lowering.onnx.translation_table()` to "
            "torch.onnx.export"
        )
    if getattr(original, "kda_translations", False):
        return
    build = original.__func__

    def from_torchlib(cls, *args, **kwargs):
        _register_translations()
        return build(cls, *args, **kwargs)

    from_torchlib.kda_translations = True
    from_torchlib.__doc__ = build.__doc__
    registry_class.from_torchlib = classmethod(from_torchlib)


class _Loader(importlib.abc.Loader):
    """Runs the real loader, then wraps the module's registry."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[ModuleType]:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        _wrap_registry(module)


class _Watch(importlib.abc.MetaPathFinder):
    """Finds nothing itself: hands the exporter's registration module to the other
    finders and wraps the loader they return."""

    def find_spec(self, fullname, path, target=None):
        if fullname != REGISTRATION_MODULE:
            return None
        sys.meta_path.remove(self)  # one module to watch; the finders below find it
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    """Arrange the lazy registration; idempotent."""
    module = sys.modules.get(REGISTRATION_MODULE)
    if module is not None:
        _wrap_registry(module)
    elif not any(isinstance(finder, _Watch) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Watch())
