"""Drop-in routing of existing model code to ``torch.ops.kda``.

``enable()`` swaps the kernel functions that transformers' hybrid models and
flash-linear-attention (FLA) callers use for ``kda_ops`` functions with the same call
conventions, so models compile with ``torch.compile(fullgraph=True)`` and export with
``torch.export`` without edits; ``disable()`` puts the originals back; ``patched()`` lists
what is swapped. Neither transformers nor FLA is imported until ``enable()`` runs.

transformers targets follow the functions, not the model names: every modeling module
(``transformers.models.<model>.modeling_*``) that holds a chunked or recurrent Gated
DeltaNet / KDA delta rule is found, whether it is loaded already or imported later, and its
delta rules, causal conv functions and gated RMSNorm classes are swapped when each follows
the convention kda_ops implements (checked by signature and a probe call; see
``docs/integrations.md``). A target is the model's directory name (``"qwen3_5"``,
``"kimi_linear"``, ...); ``"fla"`` is FLA (:mod:`kda_ops.integrations.fla`).
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Optional

from kda_ops.integrations._patch import Patch, PatchSet

# The transformers models kda-ops is tested with (any model whose file holds a delta rule is
# found; these are the ones its CI checks end to end).
TRANSFORMERS_MODELS = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "olmo_hybrid", "kimi_linear",
                       "glm5_next")  # fmt: skip
TARGETS = (*TRANSFORMERS_MODELS, "fla")


@dataclass(frozen=True)
class Swap:
    """One swap in force: ``module.attribute`` (a function, or ``Class.forward``) now runs
    ``replacement`` (the dotted name of the kda_ops function)."""

    target: str
    module: str
    attribute: str
    replacement: str


class _State:
    """What ``enable()`` has done: the swaps per module, the modules left alone (with the
    reason), and the import finder while every model is enabled."""

    def __init__(self) -> None:
        self.modules: dict[str, tuple[str, PatchSet]] = {}  # module name -> (target, swaps)
        self.fla = PatchSet()
        self.unrecognised: dict[str, str] = {}
        self.finder = None  # a _discovery.ModelingFinder while enable() covers every model
        self.all_models = False


_STATE = _State()


def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def _check_names(targets: Iterable[str]) -> list[str]:
    if isinstance(targets, str):
        raise TypeError("`targets` must be an iterable of target names, not a string")
    names = list(targets)
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"`targets` must hold target names (str), got {name!r}")
        if name == "fla":
            continue
        if (
            not name.isidentifier()
            or not _installed("transformers")
            or not _installed(f"transformers.models.{name}")
        ):
            raise ValueError(
                f"unknown integration target {name!r}: not 'fla' and not a transformers model "
                f"(known and tested: {list(TARGETS)})"
            )
    return names


def _swap_module(module: ModuleType, only: Optional[set[str]] = None) -> bool:
    """Swap a candidate modeling module's functions (all or nothing). Returns whether it is
    swapped now. An unrecognised convention leaves it alone with a warning."""
    from kda_ops.integrations import _discovery

    name = module.__name__
    model = _discovery.model_of(name)
    if model is None or (only is not None and model not in only):
        return False
    if name in _STATE.modules:
        return True
    if not _discovery.is_candidate(module):
        return False
    try:
        patches = _discovery.module_patches(module)
    except _discovery.UnrecognisedModule as reason:
        if _STATE.unrecognised.get(name) != str(reason):
            _STATE.unrecognised[name] = str(reason)
            _discovery.warn_unrecognised(name, str(reason))
        return False
    swaps = PatchSet()
    swaps.apply(patches)
    _STATE.modules[name] = (model, swaps)
    _STATE.unrecognised.pop(name, None)
    return True


def _on_import(module: ModuleType) -> None:
    """The finder's callback: swap a freshly imported model file while every model is
    enabled. A failure here must not break the user's import; it becomes a warning."""
    from kda_ops.integrations import _discovery

    if not _STATE.all_models:
        return
    # A module executed again (importlib.reload) holds its original functions again: the
    # swaps recorded for it are stale.
    _STATE.modules.pop(module.__name__, None)
    try:
        _swap_module(module)
    except Exception as error:  # reported, never raised into the user's import
        _discovery.warn_unrecognised(module.__name__, f"{type(error).__name__}: {error}")


def _model_modules(model: str) -> list[ModuleType]:
    """Import the modeling modules of transformers model ``model``."""
    package = importlib.import_module(f"transformers.models.{model}")
    names = sorted(
        info.name for info in pkgutil.iter_modules(package.__path__)
        if info.name.startswith("modeling_")
    )  # fmt: skip
    return [importlib.import_module(f"{package.__name__}.{name}") for name in names]


def _loaded_modeling_modules() -> list[ModuleType]:
    from kda_ops.integrations import _discovery

    return [
        module for name, module in list(sys.modules.items())
        if isinstance(module, ModuleType) and _discovery.model_of(name) is not None
    ]  # fmt: skip


def enable(targets: Optional[Iterable[str]] = None) -> tuple[str, ...]:
    """Route model code to ``torch.ops.kda``. Idempotent. Returns :func:`enabled`.

    ``targets=None``: FLA where installed, and every transformers model file that holds a
    delta rule, loaded now (``sys.modules`` is scanned on every call) or imported while
    enabled (an import finder swaps it as it loads). A list names transformers models
    (``["qwen3_5"]``, their modeling files are imported now) and/or ``"fla"``.

    A model file whose delta rule, conv or gated norm has a convention kda_ops does not
    recognise is left alone with an
    :class:`~kda_ops.integrations._discovery.UnrecognisedModuleWarning`.

    Raises ``ValueError`` for a name that is neither ``"fla"`` nor a transformers model, or
    a model none of whose files holds a delta rule; ``TypeError`` for a bare string;
    ``ImportError`` when ``"fla"`` is named and FLA is not installed.
    """
    if targets is None:
        names, every_model = (["fla"] if _installed("fla") else []), _installed("transformers")
    else:
        names, every_model = _check_names(targets), False
    if "fla" in names:
        if not _installed("fla"):
            raise ImportError("kda_ops.integrations: target 'fla' needs `fla` installed")
        if not _STATE.fla.active:
            from kda_ops.integrations import fla

            _STATE.fla.apply(fla.patches())
    if every_model:
        from kda_ops.integrations import _discovery

        _STATE.all_models = True
        if _STATE.finder is None:
            _STATE.finder = _discovery.ModelingFinder(_on_import)
        _STATE.finder.install()
        for module in _loaded_modeling_modules():
            _swap_module(module)
    for model in (n for n in names if n != "fla"):
        from kda_ops.integrations import _discovery

        modules = _model_modules(model)
        if not any(_discovery.is_candidate(m) for m in modules):
            raise ValueError(
                f"integration target {model!r}: transformers' {model} defines none of the "
                "delta-rule functions kda_ops replaces"
            )
        for module in modules:
            _swap_module(module, only={model})
    if _installed("onnxscript"):
        # The patched models now hold kda ops: any torch.onnx.export of them (transformers'
        # OnnxExporter included) finds their translations without naming our table.
        importlib.import_module("lowering.onnx")
    return enabled()


def disable(targets: Optional[Iterable[str]] = None) -> None:
    """Restore the original functions of the given targets (default: all, and stop swapping
    model files imported from now on). Idempotent."""
    names = None if targets is None else set(_check_names(targets))
    if names is None:
        _STATE.all_models = False
        if _STATE.finder is not None:
            _STATE.finder.uninstall()
    if names is None or "fla" in names:
        _STATE.fla.undo()
    for module_name, (model, swaps) in list(_STATE.modules.items()):
        if names is None or model in names:
            swaps.undo()
            del _STATE.modules[module_name]


def enabled() -> tuple[str, ...]:
    """The targets currently routed to ``torch.ops.kda`` (models with a swapped file, and
    ``"fla"``), sorted."""
    models = {model for model, _ in _STATE.modules.values()}
    return tuple(sorted(models | ({"fla"} if _STATE.fla.active else set())))


def _describe(target: str, patch: Patch) -> Swap:
    owner = patch.owner
    if isinstance(owner, type):
        module, attribute = owner.__module__, f"{owner.__qualname__}.{patch.name}"
    else:
        module, attribute = owner.__name__, patch.name
    replacement = patch.replacement
    dotted = f"{replacement.__module__}.{getattr(replacement, '__qualname__', patch.name)}"
    return Swap(target=target, module=module, attribute=attribute, replacement=dotted)


def patched() -> list[Swap]:
    """Every swap in force, ordered by target, module and attribute: which function (or
    ``Class.forward``) of which module runs which kda_ops function."""
    swaps = [
        _describe(model, patch)
        for model, patch_set in _STATE.modules.values()
        for patch in patch_set.patches
    ]
    swaps += [_describe("fla", patch) for patch in _STATE.fla.patches]
    return sorted(swaps, key=lambda s: (s.target, s.module, s.attribute))


def unrecognised() -> dict[str, str]:
    """Model files left alone since the last ``enable()``: module name -> the reason (the
    attribute whose signature or convention kda_ops does not recognise)."""
    return dict(_STATE.unrecognised)


__all__ = ["TARGETS", "Swap", "disable", "enable", "enabled", "patched", "unrecognised"]
