"""Cloud preemption notices: a real HTTP server on 127.0.0.1 plays the AWS and GCP metadata
services (faked: the clouds; real: the HTTP round trips, IMDSv2 tokens, the watcher thread), and
the controller turns a notice into ``ctx.preempted`` plus an emergency checkpoint when it fits."""

from __future__ import annotations

import http.server
import json
import threading
import time

import pytest

from cfdist.cluster.notices import NoticeWatcher, parse_aws, parse_gcp, poll_once


class Metadata(http.server.BaseHTTPRequestHandler):
    """AWS IMDSv2 (token required) and GCP (header required); ``state`` flips the notice on."""

    state = {"aws": None, "gcp": False}
    token = "tok-123"

    def log_message(self, *args):
        pass

    def _send(self, code, body=""):
        self.send_response(code)
        self.end_headers()
        self.wfile.write(body.encode())

    def do_PUT(self):
        if self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
            return self._send(200, self.token)
        return self._send(400)

    def do_GET(self):
        if self.path == "/latest/meta-data/spot/instance-action":
            if self.headers.get("X-aws-ec2-metadata-token") != self.token:
                return self._send(401)
            action = self.state["aws"]
            return self._send(404) if action is None else self._send(200, json.dumps(action))
        if self.path == "/computeMetadata/v1/instance/preempted":
            if self.headers.get("Metadata-Flavor") != "Google":
                return self._send(403)
            return self._send(200, "TRUE" if self.state["gcp"] else "FALSE")
        return self._send(404)


@pytest.fixture
def metadata():
    Metadata.state = {"aws": None, "gcp": False}
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metadata)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_aws_notice_appears_when_the_instance_action_is_scheduled(metadata):
    assert poll_once("aws", metadata) is None
    Metadata.state["aws"] = {"action": "terminate", "time": "2026-11-30T13:05:00Z"}
    n = poll_once("aws", metadata)
    assert n.source == "aws" and n.deadline == 1796043900.0 and "terminate" in n.detail


def test_gcp_notice_appears_when_preempted_turns_true(metadata):
    assert poll_once("gcp", metadata, now=lambda: 100.0) is None
    Metadata.state["gcp"] = True
    n = poll_once("gcp", metadata, now=lambda: 100.0)
    assert n.source == "gcp" and n.deadline == 130.0


def test_the_watcher_reports_one_notice_then_stops(metadata):
    seen = []
    w = NoticeWatcher("gcp", seen.append, base_url=metadata, every_s=0.05)
    time.sleep(0.2)
    assert seen == []
    Metadata.state["gcp"] = True
    deadline = time.time() + 10
    while not seen and time.time() < deadline:
        time.sleep(0.02)
    w.stop()
    assert len(seen) == 1 and seen[0].source == "gcp"


def test_unreachable_metadata_is_an_oserror_and_a_bad_cloud_is_refused():
    with pytest.raises(OSError):
        poll_once("gcp", "http://127.0.0.1:9", timeout_s=0.5)
    with pytest.raises(ValueError, match="use 'aws' or 'gcp'"):
        NoticeWatcher("azure", print)


@pytest.mark.parametrize("status, body, want", [
    (404, "", None),
    (200, '{"action": "terminate", "time": "2026-11-30T13:05:00Z"}', 1796043900.0),
    (200, '{"action": "stop", "time": "2026-11-30T13:05:00Z"}', 1796043900.0),
    (200, "garbage", 1120.0),   # unparsed: assume the two-minute notice
])
def test_parse_aws(status, body, want):
    n = parse_aws(status, body, now=1000.0)
    assert (n.deadline if n else None) == want


def test_parse_gcp():
    assert parse_gcp(200, "FALSE\n", 5.0) is None and parse_gcp(200, "TRUE", 5.0).deadline == 35.0
