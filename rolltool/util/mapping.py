"""The one `Mapper` type: how a pure stage is handed parallelism without knowing an engine.

A stage with independent work items (batches to plan, row groups to scan, pieces to count) takes
``mapper(fn, items)``, which returns ``[fn(x) for x in items]`` (an iterable, in order) computed
anywhere: here (`serial`), in forked processes (`rolltool.engine.local.local_mapper`) or as Ray
tasks (`rolltool.engine.ray.RayEngine.map_in_order`). The stage never imports an engine; the job
chooses one and hands its mapper down. Example::

    >>> list(serial(lambda x: x * x, [1, 2, 3]))
    [1, 4, 9]
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")

Mapper = Callable[[Callable[[Any], Any], Sequence[Any]], Iterable[Any]]
"""``mapper(fn, items)`` gives ``fn(x)`` for every x of `items`, in order, computed anywhere.
A result may be a list (all at once) or an iterator (each as soon as it and those before it are
done, so a caller that folds them never holds them all)."""


def serial(fn: Callable[[T], R], items: Sequence[T]) -> Iterator[R]:
    """The mapper that runs here: each ``fn(x)`` computed when asked for."""
    return (fn(x) for x in items)
