"""The pass interface shared by every kda Inductor pass: a name, a match counter, optional
logging, and a ``uuid`` that hashes the pass's source file (the FX graph cache keys on it)."""

from __future__ import annotations

import hashlib
import inspect
import logging
import os
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
from torch._inductor.pattern_matcher import Match, PatternMatcherPass

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
        log.log(_level(), "kda pass %s: %d match(es)", self.name, count)
        return count

    def log_match(self, formulation: str, nodes: list[torch.fx.Node]) -> None:
        """Log (at the :data:`LOG_ENV` level) that ``formulation`` matched at ``nodes``:
        the model source line of the first node that has one, else the node's name."""
        log.log(_level(), "kda pass %s: matched %s at %s", self.name, formulation,
                _location(nodes))  # fmt: skip

    def uuid(self) -> str:
        """Hash of the file that defines this pass (and its base)."""
        return source_hash(type(self), KDAInductorPass)


def _level() -> int:
    return logging.WARNING if os.environ.get(LOG_ENV, "0") not in ("", "0") else logging.DEBUG


def _location(nodes: list[torch.fx.Node]) -> str:
    """``file:line (function)`` of the innermost frame in the first node's stack trace."""
    for node in nodes:
        frames = [line.strip() for line in node.meta.get("stack_trace", "").splitlines()]
        frames = [line for line in frames if line.startswith("File ")]
        if frames:  # 'File "/path/x.py", line 12, in fn'
            path, line, function = frames[-1].split(", ", 2)
            return f"{os.path.basename(path[6:-1])}:{line[5:]} ({function[3:]})"
    return f"node {nodes[0].name}" if nodes else "?"


class PatternPass(KDAInductorPass):
    """A pass made of ``register_replacement`` patterns, registered on first use (tracing the
    patterns takes a moment, so importing the package stays cheap)."""

    def __init__(self) -> None:
        super().__init__()
        self._patterns: PatternMatcherPass | None = None

    @abstractmethod
    def register(self, patterns: PatternMatcherPass) -> None:
        """Add this pass's replacements to ``patterns``."""

    def logged(self, formulation: str, check: Callable[[Match], bool]) -> Callable[[Match], bool]:
        """``check`` as a ``register_replacement`` extra_check that logs each accepted match
        as ``formulation`` (the extra check is the last one before the rewrite)."""

        def extra_check(match: Match) -> bool:
            if not check(match):
                return False
            self.log_match(formulation, list(match.nodes))
            return True

        return extra_check

    def apply(self, graph: torch.fx.Graph) -> int:
        if self._patterns is None:
            self._patterns = PatternMatcherPass(pass_name=f"kda_{self.name}")
            self.register(self._patterns)
        return self._patterns.apply(graph)
