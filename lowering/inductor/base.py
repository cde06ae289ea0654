"""The pass interface shared by every kda Inductor pass: a name, a match counter, optional
logging, and a ``uuid`` that hashes the pass's source file (the FX graph cache keys on it)."""

from __future__ import annotations

import hashlib
import inspect
import logging
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch._inductor.pattern_matcher import Match, PatternMatcherPass, register_replacement

from lowering.inductor import canonical

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
        log.log(_level(), "kda pass %s: matched %s at %s", self.name, formulation, _location(nodes))

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
    patterns takes a moment, so importing the package stays cheap). Patterns are traced
    with :func:`~lowering.inductor.canonical.canonical_fwd_only` and matched on the graph
    after :func:`~lowering.inductor.canonical.canonicalize`, so each matches every
    spelling that canonicalizes to it."""

    def __init__(self) -> None:
        super().__init__()
        self._patterns: PatternMatcherPass | None = None
        self._registered = False

    @abstractmethod
    def register(self, patterns: PatternMatcherPass) -> None:
        """Add this pass's replacements to ``patterns``."""

    def register_for(self, patterns: PatternMatcherPass, targets: set[object]) -> None:
        """Add the replacements that could match a graph calling ``targets`` (before each
        graph; each replacement is added once). By default all of :meth:`register`, on
        the first graph; passes with many patterns add only those a graph can match, so
        a model pays the tracing for its own spellings only."""
        if not self._registered:
            self.register(patterns)
            self._registered = True

    def logged(self, formulation: str, check: Callable[[Match], bool]) -> Callable[[Match], bool]:
        """``check`` as a ``register_replacement`` extra_check that logs each accepted match
        as ``formulation`` (the extra check is the last one before the rewrite)."""

        def extra_check(match: Match) -> bool:
            if not check(match):
                return False
            self.log_match(formulation, list(match.nodes))
            return True

        return extra_check

    def uuid(self) -> str:
        """Hash of the pass's file, the canonical form and the base."""
        return source_hash(type(self), canonical, KDAInductorPass)

    def apply(self, graph: torch.fx.Graph) -> int:
        if self._patterns is None:
            self._patterns = PatternMatcherPass(pass_name=f"kda_{self.name}")
        canonical.canonicalize(graph)
        targets = {node.target for node in graph.nodes if node.op == "call_function"}
        self.register_for(self._patterns, targets)
        return self._patterns.apply(graph)


class Replacement(NamedTuple):
    """One ``register_replacement`` of a pattern pass: the log's words, the search and
    replacement functions, example inputs, and the call targets a graph must hold for the
    pattern to match (checked before the pattern is traced)."""

    words: str
    search: Callable[..., Any]
    replace: Callable[..., Any]
    example: list[Any]
    needs: frozenset[object]


class ReplacementPass(PatternPass):
    """A pattern pass made of :class:`Replacement` s (from :meth:`replacements`), each
    traced with the canonical trace and registered the first time a graph holds what it
    needs. Subclasses give :meth:`replacements` and :meth:`check` (the extra check)."""

    scalar_workaround: dict[str, float] | None = None

    def __init__(self) -> None:
        super().__init__()
        self._pending: list[Replacement] | None = None

    def replacements(self) -> Iterator[Replacement]:
        raise NotImplementedError

    def check(self, match: Match) -> bool:
        raise NotImplementedError

    def uuid(self) -> str:
        """Hash of the pass's file, the canonical form and the base."""
        return source_hash(type(self), canonical, KDAInductorPass)

    def register(self, patterns: PatternMatcherPass) -> None:
        self.register_for(patterns, None)

    def register_for(self, patterns: PatternMatcherPass, targets: set[object] | None) -> None:
        """Every pending replacement whose ``needs`` are among ``targets`` (all: None)."""
        if self._pending is None:
            self._pending = list(self.replacements())
        pending = []
        for item in self._pending:
            if targets is not None and not item.needs <= targets:
                pending.append(item)
                continue
            register_replacement(
                search_fn=item.search,
                replace_fn=item.replace,
                example_inputs=item.example,
                trace_fn=canonical.canonical_fwd_only,
                pass_dicts=patterns,
                extra_check=self.logged(item.words, self.check),
                scalar_workaround=self.scalar_workaround,
                skip_duplicates=True,
            )
        self._pending = pending
