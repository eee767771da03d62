"""What a model is being built with: the values its layers capture once, at construction, for good.

An engine builds its model inside `scope.building_with(value)`, and every layer constructed there reads
`scope.current()` in its `__init__` and keeps what it got; nothing reads the scope again after construction. So two
engines built with different values (parallel state, op table and platform) live side by side in one process, each
layer holding its own engine's. Outside any `building_with`, `current()` is the scope's default (a world of one, the
platform's own ops), for layers built alone in tests and tools.

    PARALLEL = BuildScope("parallel state", ParallelState)    (distributed/parallel_state.py)
    OPS = BuildScope("op table", op_table)                    (kernels/ops.py)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

Value = TypeVar("Value")


class BuildScope(Generic[Value]):
    """One value that what is being built now captures at construction (`current`), set for the duration of a build
    by `building_with`, innermost first; `default()` outside every build."""

    def __init__(self, what: str, default: Callable[[], Value]) -> None:
        self.what = what
        self._default = default
        self._building: list[Value] = []  # the values of the builds under way, innermost last

    def current(self) -> Value:
        """The value of the build under way (the innermost), else the default."""
        return self._building[-1] if self._building else self._default()

    @contextmanager
    def building_with(self, value: Value) -> Iterator[Value]:
        """Build with value: everything constructed within the block captures it."""
        self._building.append(value)
        try:
            yield value
        finally:
            self._building.pop()

    def __repr__(self) -> str:
        return f"BuildScope({self.what})"
