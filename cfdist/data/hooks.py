"""``register_before_next_hook``: the instant "between iterations" that checkpoints capture."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from torch.utils.hooks import RemovableHandle


class BeforeNextHooks:
    """Mixin: callables run at the very start of every ``__next__``, in registration order."""

    def __init__(self) -> None:
        self._before_next: OrderedDict[int, Callable[[], None]] = OrderedDict()

    def register_before_next_hook(self, fn: Callable[[], None]) -> RemovableHandle:
        """Call ``fn()`` at the very start of each ``__next__``, before any RNG is touched or
        the position advances; that includes the ``__next__`` that ends an epoch with
        ``StopIteration`` (so between an epoch's last step and the next epoch's first batch it
        runs twice). Runs in the thread that iterates. ``handle.remove()`` unregisters it; an
        exception from ``fn`` propagates out of ``__next__`` with the position unchanged."""
        if not callable(fn):
            raise TypeError(f"before-next hook must be callable, got {type(fn).__name__}")
        handle = RemovableHandle(self._before_next)
        self._before_next[handle.id] = fn
        return handle

    def _run_before_next(self) -> None:
        for fn in list(self._before_next.values()):
            fn()
