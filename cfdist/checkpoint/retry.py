"""Transient is not corrupt (invariant 8): storage errors are retried, then raised; never a fallback.

Reading a checkpoint can fail in two different ways, and restore treats them differently:

* a **content error** (:class:`~cfdist.checkpoint.format.CheckpointError`: a checksum that does
  not match, a truncated shard, a malformed manifest) means that checkpoint is unusable: restore
  falls back to an older one and says why;
* a **storage error** (``OSError``: EIO from a flaky NFS mount, an object store's 503, a timeout)
  says nothing about the checkpoint, which may be intact. It is retried with a bounded backoff
  (:class:`RetryPolicy`); if the storage still fails, :class:`StorageUnavailable` (an ``OSError``)
  is raised naming the URL and the step, and nothing is rolled back past.

The default policy makes 4 tries over about 1.75 s of waiting (0.25 s, 0.5 s, 1 s). Pass another
one as ``Checkpointer(..., read_retry=RetryPolicy(tries=8, max_delay_s=10))`` or
``cfdist.load(url, read_retry=...)``; ``RetryPolicy(tries=1)`` never retries.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

log = logging.getLogger("cfdist.retry")

T = TypeVar("T")


class StorageUnavailable(OSError):
    """Storage kept failing while reading a checkpoint that may be intact; nothing was rolled back."""


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How often and how patiently a failing storage read is retried."""

    tries: int = 4
    """Attempts in all (1 = no retry)."""
    first_delay_s: float = 0.25
    """Wait before the second attempt; each later wait doubles."""
    max_delay_s: float = 2.0
    """Cap on one wait."""

    def __post_init__(self):
        if not isinstance(self.tries, int) or isinstance(self.tries, bool) or self.tries < 1:
            raise ValueError(f"RetryPolicy(tries={self.tries!r}): must be an int >= 1 (1 = no retry)")
        for name in ("first_delay_s", "max_delay_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
                raise ValueError(f"RetryPolicy({name}={v!r}): must be a finite number of seconds >= 0")

    def delays(self) -> list[float]:
        """The waits between attempts (``tries - 1`` of them)."""
        return [min(self.first_delay_s * 2 ** i, self.max_delay_s) for i in range(self.tries - 1)]


DEFAULT = RetryPolicy()


def retrying(fn: Callable[[], T], *, what: str, policy: RetryPolicy | None = None,
             sleep: Callable[[float], None] = time.sleep) -> T:
    """``fn()``, retried on ``OSError`` per ``policy``; then :class:`StorageUnavailable`.

    ``what`` completes "... failed N times": e.g. ``"reading step 40 from file:///ckpt"``.
    Content errors (anything not an ``OSError``) and ``FileNotFoundError`` (an absent file is an
    answer, not a failure) propagate at once. Blocks for the waits.
    """
    policy = policy or DEFAULT
    delays = policy.delays()
    for attempt in range(policy.tries):
        try:
            return fn()
        except FileNotFoundError:
            raise
        except OSError as e:
            if attempt == len(delays):
                waited = sum(delays)
                code = getattr(e, "errno", None)
                raise StorageUnavailable(
                    *([code] if isinstance(code, int) else []),
                    f"{what} failed {policy.tries} time(s) over {waited:.2f}s with a storage error "
                    f"({type(e).__name__}: {e}); the checkpoint may be intact, so nothing was rolled "
                    f"back past it. Fix the storage and retry, give a RetryPolicy with more tries, or "
                    f"choose an older step explicitly (restore(step=...))") from e
            log.warning("%s failed (%s: %s); retry %d of %d in %.2fs", what, type(e).__name__, e,
                        attempt + 1, policy.tries - 1, delays[attempt])
            sleep(delays[attempt])
    raise AssertionError("unreachable")  # pragma: no cover
