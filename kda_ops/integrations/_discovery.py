"""Finding the transformers model files kda_ops integrates, loaded now or imported later.

**Which modules.** A transformers modeling module (``transformers.models.<model>.modeling_*``)
is a candidate when it holds a delta rule (a chunked or recurrent Gated DeltaNet or KDA
function, :mod:`kda_ops.integrations._conventions`). In a candidate, every attribute with a
role's name (the delta rules, ``causal_conv1d_fn`` / ``causal_conv1d_update``, every
``*RMSNormGated`` class) must follow that role's convention; then all of them are swapped,
otherwise none is and the module is named in an :class:`UnrecognisedModuleWarning`. Modules
without a delta rule (the Mamba family shares the conv names, with packed ``seq_idx`` and
grouped gated norms) are not candidates and are not touched.

**Modules imported later.** :class:`ModelingFinder` sits first on ``sys.meta_path``. Every
import of a module goes through the meta path, whatever triggers it (``import``,
``importlib.import_module``, transformers' lazy ``_LazyModule``, ``AutoModel``); the
finder asks the finders behind it for the spec of a name that looks like a modeling module
and wraps its loader so that the candidate is swapped right after its body ran, before the
importer gets the module back: no model can be built from an unswapped module. It needs no
transformers internals, costs other imports one regular-expression match, and leaves the
spec's file, source and loader methods as they were (the wrapper forwards them). Polling
``sys.modules`` would run after models were built; patching transformers' lazy-module class
would tie us to its internals. Modules placed in ``sys.modules`` without an import are found
by the next ``enable()`` call, which scans ``sys.modules``.
"""

from __future__ import annotations

import importlib.machinery
import re
import sys
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any, Optional

from kda_ops.integrations import _conventions, _transformers
from kda_ops.integrations._patch import Patch

_MODELING = re.compile(r"^transformers\.models\.(?P<model>\w+)\.modeling_\w+$")


class UnrecognisedModuleWarning(UserWarning):
    """A transformers model file holds a function or class that kda_ops replaces, but with a
    signature or convention kda_ops does not recognise: the whole file is left alone."""


class UnrecognisedModule(Exception):
    """Raised by :func:`module_patches`; ``str()`` names the attribute and the reason."""


def model_of(module_name: str) -> Optional[str]:
    """``"qwen3_5"`` for ``transformers.models.qwen3_5.modeling_qwen3_5``; ``None`` for a
    name that is not a transformers modeling module."""
    match = _MODELING.match(module_name)
    return match["model"] if match else None


def is_candidate(module: ModuleType) -> bool:
    """Whether ``module`` holds a delta rule by one of the names model files give it."""
    names = vars(module)
    return any(
        name in names for role in _conventions.FUNCTION_ROLES if role.anchor
        for name in role.attribute_names
    )  # fmt: skip


def _is_replacement(value: Any) -> bool:
    return getattr(value, "__module__", None) == _transformers.__name__


def module_patches(module: ModuleType) -> list[Patch]:
    """Every swap for a candidate module, or :class:`UnrecognisedModule` naming the first
    attribute whose convention is not recognised (then nothing may be swapped)."""
    patches = []
    for name, value in vars(module).items():
        role = _conventions.role_of(name)
        if role is not None:
            if _is_replacement(value):
                continue
            try:
                _conventions.check_function(role, value)
            except _conventions.ConventionMismatch as reason:
                raise UnrecognisedModule(f"`{name}` {reason}") from None
            patches.append(Patch(module, name, role.replacement))
        elif name.endswith(_conventions.GATED_NORM_SUFFIX) and isinstance(value, type):
            if _is_replacement(vars(value).get("forward")):
                continue  # the same class, imported from a model file already swapped
            try:
                _conventions.check_gated_norm(value)
            except _conventions.ConventionMismatch as reason:
                raise UnrecognisedModule(f"`{name}` {reason}") from None
            patches.append(_transformers.gated_norm_patch(value))
    return patches


def warn_unrecognised(module_name: str, reason: str) -> None:
    warnings.warn(
        f"kda_ops.integrations left {module_name} alone: {reason}. Its model runs "
        "transformers' own functions; nothing in it was swapped.",
        UnrecognisedModuleWarning,
        stacklevel=3,
    )


class _SwappingLoader:
    """A module's own loader, plus a call of ``on_load(module)`` after the body ran.
    Every other attribute (``get_source``, ``get_filename``, ``is_package``, ...) is the
    wrapped loader's."""

    def __init__(self, loader: Any, on_load: Callable[[ModuleType], None]) -> None:
        self._loader = loader
        self._on_load = on_load

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[ModuleType]:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._on_load(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class ModelingFinder:
    """A ``sys.meta_path`` finder that has ``on_load`` run on every transformers modeling
    module right after it is imported (see the module docstring)."""

    def __init__(self, on_load: Callable[[ModuleType], None]) -> None:
        self._on_load = on_load

    def find_spec(
        self, fullname: str, path: Any = None, target: Optional[ModuleType] = None
    ) -> Optional[importlib.machinery.ModuleSpec]:
        if model_of(fullname) is None:
            return None
        for finder in sys.meta_path:
            find_spec = getattr(finder, "find_spec", None)
            if finder is self or find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _SwappingLoader(spec.loader, self._on_load)
        return spec

    def install(self) -> None:
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def uninstall(self) -> None:
        while self in sys.meta_path:
            sys.meta_path.remove(self)
