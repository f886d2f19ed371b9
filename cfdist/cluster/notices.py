"""Cloud preemption notices, read from the instance metadata service of the node itself.

* ``aws``: spot's two-minute notice. ``GET /latest/meta-data/spot/instance-action`` answers 404
  until the instance is scheduled for interruption, then ``{"action": "terminate", "time":
  "2026-11-30T13:05:00Z"}``. IMDSv2 first (``PUT /latest/api/token``), IMDSv1 if that fails.
* ``gcp``: ``GET /computeMetadata/v1/instance/preempted`` (header ``Metadata-Flavor: Google``)
  answers ``FALSE``, then ``TRUE`` once the VM is being preempted (about 30 s before it stops).

A node opts in with the Ray node label ``cfdist-notices`` (``aws`` or ``gcp``), which the cloud
cluster YAMLs in ``cluster_configs/`` set on their preemptible workers; its
:class:`~cfdist.cluster.node_actor.NodeCheckpointer` then runs a :class:`NoticeWatcher`. The
driver turns a notice into the same handling as an injected one: ``ctx.preempted`` on the
node's ranks and an emergency checkpoint if the recent commit latency fits the time left.

:func:`poll_once` is the only function that does I/O (one HTTP round trip, short timeout);
:func:`parse_aws` and :func:`parse_gcp` are pure. The metadata base URL can be overridden
(a test's fake server on 127.0.0.1).
"""

from __future__ import annotations

import calendar
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Callable

from cfdist.cluster.nodes import NOTICES_LABEL as LABEL

log = logging.getLogger("cfdist.notices")

DEFAULT_URLS = {"aws": "http://169.254.169.254", "gcp": "http://metadata.google.internal"}
GCP_NOTICE_S = 30.0
"""GCP's notice: the preempted flag turns TRUE about 30 s before the VM stops."""


@dataclass(frozen=True)
class Notice:
    """The node is about to be taken: ``deadline`` (wall time) when known, else ``now + notice_s``."""

    source: str
    deadline: float
    detail: str = ""


def parse_aws(status: int, body: str, now: float) -> Notice | None:
    """The AWS instance-action answer -> a notice (None: no interruption scheduled). Pure."""
    if status == 404 or status != 200:
        return None
    try:
        doc = json.loads(body)
        action = doc.get("action", "")
        when = calendar.timegm(time.strptime(doc["time"], "%Y-%m-%dT%H:%M:%SZ"))
    except (ValueError, KeyError, TypeError, AttributeError):
        return Notice("aws", now + 120.0, f"unparsed instance-action {body[:80]!r}: assuming the 2-minute notice")
    if action not in ("terminate", "stop", "hibernate"):
        return None
    return Notice("aws", float(when), f"spot instance-action {action} at {doc['time']}")


def parse_gcp(status: int, body: str, now: float) -> Notice | None:
    """The GCP ``preempted`` answer -> a notice (None: not preempted). Pure."""
    if status == 200 and body.strip().upper() == "TRUE":
        return Notice("gcp", now + GCP_NOTICE_S, "instance/preempted is TRUE")
    return None


def _get(url: str, headers: dict, timeout: float, method: str = "GET") -> tuple[int, str]:
    req = urllib.request.Request(url, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 - metadata service URL
            return r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, ""


def poll_once(source: str, base_url: str | None = None, *, timeout_s: float = 1.0,
              now: Callable[[], float] = time.time) -> Notice | None:
    """Ask the metadata service once. Raises ``OSError`` when it cannot be reached."""
    base = (base_url or DEFAULT_URLS[source]).rstrip("/")
    if source == "aws":
        headers = {}
        try:
            status, token = _get(f"{base}/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": "300"},
                                 timeout_s, method="PUT")
            if status == 200 and token:
                headers["X-aws-ec2-metadata-token"] = token
        except OSError:
            pass   # IMDSv1 only
        status, body = _get(f"{base}/latest/meta-data/spot/instance-action", headers, timeout_s)
        return parse_aws(status, body, now())
    if source == "gcp":
        status, body = _get(f"{base}/computeMetadata/v1/instance/preempted", {"Metadata-Flavor": "Google"}, timeout_s)
        return parse_gcp(status, body, now())
    raise ValueError(f"preemption notices from {source!r} are not supported: use 'aws' or 'gcp' "
                     f"(Ray node label {LABEL})")


class NoticeWatcher:
    """A daemon thread that polls every ``every_s`` and calls ``on_notice(notice)`` once.

    Unreachable metadata is logged once and retried. ``stop()`` ends it (joins).
    """

    def __init__(self, source: str, on_notice: Callable[[Notice], None], *, base_url: str | None = None,
                 every_s: float = 1.0):
        if source not in DEFAULT_URLS:
            raise ValueError(f"node label {LABEL}={source!r}: use 'aws' or 'gcp'")
        self.source, self.base_url, self.every_s = source, base_url, every_s
        self._on_notice = on_notice
        self._stop = threading.Event()
        self._warned = False
        self.notice: Notice | None = None
        self._thread = threading.Thread(target=self._loop, name=f"cfdist-notices-{source}", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                n = poll_once(self.source, self.base_url, timeout_s=min(1.0, self.every_s))
            except OSError as e:
                if not self._warned:
                    log.warning("cannot reach the %s metadata service (%s); will keep trying", self.source, e)
                    self._warned = True
                n = None
            if n is not None:
                self.notice = n
                try:
                    self._on_notice(n)
                except Exception:  # noqa: BLE001 - a notice handler bug must not kill the watcher silently
                    log.exception("handling the %s preemption notice failed", self.source)
                return
            self._stop.wait(self.every_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
