"""The pass interface shared by every kda Inductor pass: a name, a match counter, optional
logging, and a ``uuid`` that hashes the pass's source file (the FX graph cache keys on it)."""

from __future__ import annotations

import hashlib
import inspect
import logging
import os
from abc import ABC, abstractmethod

import torch
from torch._inductor.pattern_matcher import PatternMatcherPass

log = logging.getLogger("lowering.inductor")

LOG_ENV = "KDA_LOG_PASSES"
"""Set to ``1`` to log every pass's match count per compiled graph (at WARNING level, so it
shows without logging set-up); otherwise the counts go to DEBUG."""


def source_hash(*objects: object) -> str:
    """sha256 over the source files that define ``objects`` (classes, functions, modules)."""
    hasher = hashlib.sha256()
    for obj in objects:
        with open(inspect.getfile(obj), "rb") as f:  # type: ignore[arg-type]
            hasher.update(f.read())
    return hasher.hexdigest()


class KDAInductorPass(ABC):
    """One fusion over a post-grad FX graph. Subclasses implement :meth:`apply`, which
    rewrites the graph and returns how many sites it rewrote."""

    name: str = "kda_pass"

    def __init__(self) -> None:
        self.matches = 0

    @abstractmethod
    def apply(self, graph: torch.fx.Graph) -> int:
        """Rewrite ``graph`` in place; return the number of sites rewritten."""

    def __call__(self, graph: torch.fx.Graph) -> int:
        count = self.apply(graph)
        self.matches += count
        level = logging.WARNING if os.environ.get(LOG_ENV, "0") not in ("", "0") else logging.DEBUG
        log.log(level, "kda pass %s: %d match(es)", self.name, count)
        return count

    def uuid(self) -> str:
        """Hash of the file that defines this pass (and its base)."""
        return source_hash(type(self), KDAInductorPass)


class PatternPass(KDAInductorPass):
    """A pass made of ``register_replacement`` patterns, registered on first use (tracing the
    patterns takes a moment, so importing the package stays cheap)."""

    def __init__(self) -> None:
        super().__init__()
        self._patterns: PatternMatcherPass | None = None

    @abstractmethod
    def register(self, patterns: PatternMatcherPass) -> None:
        """Add this pass's replacements to ``patterns``."""

    def apply(self, graph: torch.fx.Graph) -> int:
        if self._patterns is None:
            self._patterns = PatternMatcherPass(pass_name=f"kda_{self.name}")
            self.register(self._patterns)
        return self._patterns.apply(graph)
