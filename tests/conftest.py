"""Shared fixtures: a fresh storage root on every backend, and a real local S3 server.

    def test_roundtrip(storage_url):              # runs three times: file, memory, s3
        st = open_storage(storage_url)            # no options needed, even for s3 (see below)

    def test_s3_only(s3_url, s3_storage_options):
        st = open_storage(s3_url, **s3_storage_options)

* ``file_url`` - ``file://<tmp_path>/root`` (created on open).
* ``memory_url`` - a unique ``memory://`` root, deleted after the test. In-process only.
* ``s3_server`` (session) - a moto S3 server in a subprocess on 127.0.0.1 (a real HTTP server,
  started once, terminated at the end); yields its endpoint URL. While it runs, the ``AWS_*``
  environment holds dummy credentials and ``AWS_ENDPOINT_URL_S3`` points at it, so s3fs in this
  process and in child processes (writer processes, local Ray workers) reaches it with no
  options and can never reach real AWS (no config files, no instance metadata).
* ``s3_storage_options`` - the same settings as explicit ``open_storage`` keyword arguments.
* ``s3_url`` - ``s3://<fresh bucket>/prefix`` for one test; the bucket is emptied afterwards.
* ``storage_url`` - parametrized over file / memory / s3 (ids ``file``, ``memory``, ``s3``);
  the s3 case is skipped when s3fs or moto is not installed. Select one with ``-k memory``.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid

import os

import pytest

# Every gloo process the tests start (spawned children, Ray workers inherit it) talks over the
# loopback interface only, whatever the machine's hostname resolves to.
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

_DUMMY_KEY = "testing"
# Variables through which botocore could pick up real credentials, profiles or endpoints.
_AWS_UNSET = (
    "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
    "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_CONTAINER_AUTHORIZATION_TOKEN", "AWS_ENDPOINT_URL",
    "AWS_CA_BUNDLE", "HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY",
    "all_proxy",
)


# ``python -m moto.server`` that also dies with its parent on Linux (PR_SET_PDEATHSIG), so a
# killed pytest leaves no server behind on a shared machine.
_SERVER_MAIN = """
import runpy, sys
if sys.platform.startswith("linux"):
    import ctypes, signal
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
sys.argv[0] = "moto.server"
runpy.run_module("moto.server", run_name="__main__", alter_sys=True)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(proc: subprocess.Popen, endpoint: str, timeout: float) -> bool:
    """Poll until the server answers HTTP (any status) or the process dies or time runs out."""
    deadline = time.monotonic() + timeout
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            opener.open(f"{endpoint}/moto-api/", timeout=1).close()
            return True
        except urllib.error.HTTPError:
            return True
        except OSError:
            time.sleep(0.1)
    return False


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """Endpoint URL (``http://127.0.0.1:<port>``) of a moto S3 server subprocess.

    Session-scoped: started on first use (about a second), terminated at the end of the run.
    Sets dummy ``AWS_*`` variables for the whole session (restored afterwards).
    """
    pytest.importorskip("moto.server", reason="moto[server] is not installed")
    tmp = tmp_path_factory.mktemp("s3-server")
    mp = pytest.MonkeyPatch()
    for name in _AWS_UNSET:
        mp.delenv(name, raising=False)
    mp.setenv("AWS_ACCESS_KEY_ID", _DUMMY_KEY)
    mp.setenv("AWS_SECRET_ACCESS_KEY", _DUMMY_KEY)
    mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
    mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
    mp.setenv("AWS_CONFIG_FILE", str(tmp / "no-aws-config"))
    mp.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp / "no-aws-credentials"))
    mp.setenv("NO_PROXY", "127.0.0.1,localhost")
    mp.setenv("no_proxy", "127.0.0.1,localhost")

    proc = None
    for _ in range(3):  # the free port may be taken between probing and binding
        port = _free_port()
        endpoint = f"http://127.0.0.1:{port}"
        log_path = tmp / f"moto-{port}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-c", _SERVER_MAIN, "-H", "127.0.0.1", "-p", str(port)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )
        if _answers(proc, endpoint, timeout=30):
            break
        _stop(proc)
        proc = None
    if proc is None:
        mp.undo()
        tail = log_path.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"the moto S3 server did not start (3 tries); last log:\n{tail}")

    mp.setenv("AWS_ENDPOINT_URL_S3", endpoint)
    try:
        yield endpoint
    finally:
        _stop(proc)
        mp.undo()


@pytest.fixture(scope="session")
def s3_storage_options(s3_server) -> dict:
    """Keyword arguments for ``open_storage(s3_url, **opts)`` / ``s3fs.S3FileSystem(**opts)``."""
    return {
        "key": _DUMMY_KEY,
        "secret": _DUMMY_KEY,
        "client_kwargs": {"endpoint_url": s3_server},
    }


@pytest.fixture
def s3_url(s3_storage_options):
    """``s3://<fresh bucket>/prefix`` on the local server; the bucket is emptied after the test."""
    s3fs = pytest.importorskip("s3fs")
    fs = s3fs.S3FileSystem(**s3_storage_options)
    bucket = f"cfdist-{uuid.uuid4().hex[:16]}"
    fs.mkdir(bucket)
    yield f"s3://{bucket}/prefix"
    try:
        fs.rm(bucket, recursive=True)
    except Exception:  # noqa: BLE001 - the server and its buckets go away with the session
        pass


@pytest.fixture
def file_url(tmp_path) -> str:
    """``file://`` URL of a not-yet-created directory under this test's tmp_path."""
    return f"file://{tmp_path.as_posix()}/root"


@pytest.fixture
def memory_url():
    """A unique ``memory://`` root (fsspec's process-global store), removed after the test."""
    import fsspec

    name = f"cfdist-test-{uuid.uuid4().hex[:12]}"
    yield f"memory://{name}"
    fs = fsspec.filesystem("memory")
    if fs.exists(f"/{name}"):
        fs.rm(f"/{name}", recursive=True)


@pytest.fixture(params=["file", "memory", "s3"])
def storage_url(request) -> str:
    """A fresh root URL on each backend in turn; ``open_storage(storage_url)`` needs no options."""
    if request.param == "s3":
        pytest.importorskip("s3fs", reason="s3fs is not installed")
        return request.getfixturevalue("s3_url")
    return request.getfixturevalue(f"{request.param}_url")


# ---- heavy variants ------------------------------------------------------------------------------
# ``@pytest.mark.heavy`` tests (long kill loops, big states, many ranks) run only with
# ``--heavy`` (or CFDIST_HEAVY=1). Without it they are deselected, not skipped, so CI's count of
# tests that ran is honest: ``./run tests --heavy`` runs everything.

def pytest_addoption(parser):
    parser.addoption("--heavy", action="store_true", default=False,
                     help="also run @pytest.mark.heavy tests (long kill loops, big states)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--heavy") or os.environ.get("CFDIST_HEAVY") == "1":
        return
    heavy = [it for it in items if it.get_closest_marker("heavy") is not None]
    if heavy:
        config.hook.pytest_deselected(items=heavy)
        items[:] = [it for it in items if it.get_closest_marker("heavy") is None]
