"""Reversible attribute swaps: the mechanism behind ``enable()`` / ``disable()``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Patch:
    """One attribute swap: ``setattr(owner, name, replacement)``, undone by :meth:`undo`."""

    owner: Any
    name: str
    replacement: Any
    original: Any = field(init=False)

    def apply(self) -> None:
        try:
            # The owner's own attribute (a class's raw function, not an inherited one).
            self.original = vars(self.owner)[self.name]
        except KeyError:
            raise AttributeError(
                f"kda_ops.integrations: {self.owner!r} has no attribute {self.name!r} to patch; "
                "this library version is not supported"
            ) from None
        setattr(self.owner, self.name, self.replacement)

    def undo(self) -> None:
        setattr(self.owner, self.name, self.original)


class PatchSet:
    """The swaps of one integration target; applying twice is a no-op, so is undoing twice."""

    def __init__(self) -> None:
        self._applied: list[Patch] = []

    @property
    def active(self) -> bool:
        return bool(self._applied)

    @property
    def patches(self) -> tuple[Patch, ...]:
        """The swaps in force, in the order they were applied."""
        return tuple(self._applied)

    def apply(self, patches: list[Patch]) -> None:
        if self.active:
            return
        try:
            for patch in patches:
                patch.apply()
                self._applied.append(patch)
        except BaseException:
            self.undo()
            raise

    def undo(self) -> None:
        while self._applied:
            self._applied.pop().undo()

    def originals(self) -> dict[tuple[int, str], Any]:
        """``{(id(owner), name): original}`` of the swaps in force."""
        return {(id(p.owner), p.name): p.original for p in self._applied}
