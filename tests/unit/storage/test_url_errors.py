"""open_storage's errors name the value, the reason and the fix.

Real: local directories, the moto S3 server from tests/conftest.py, a closed local port for the
wrong endpoint. Faked: the missing fsspec package (every package is installed here), by pointing
fsspec's registry at a module that does not exist.
"""

from __future__ import annotations

import errno
import importlib
import os
import socket

import pytest

from cfdist.storage import StorageError, open_storage, open_storages

# the module (``fsspec.registry`` as an attribute is the read-only mapping of the same name)
fsspec_registry = importlib.import_module("fsspec.registry")


def test_unknown_scheme_is_named():
    with pytest.raises(ValueError, match=r"unknown scheme 'nosuchfs'.*fsspec.available_protocols"):
        open_storage("nosuchfs://bucket/x")


def test_missing_implementation_names_the_pip_package(monkeypatch):
    # Faked: s3fs is installed here, so make fsspec believe its class lives in a missing module.
    monkeypatch.delitem(fsspec_registry._registry, "s3", raising=False)
    monkeypatch.setitem(fsspec_registry.known_implementations, "s3",
                        {"class": "cfdist_no_such_module.S3FileSystem", "err": "Install s3fs to access S3"})
    with pytest.raises(ImportError, match=r"'s3://bucket/x' needs the package 's3fs'.*pip install s3fs"):
        open_storage("s3://bucket/x")


def test_missing_implementation_of_an_unlisted_scheme_uses_fsspecs_hint(monkeypatch):
    monkeypatch.setitem(fsspec_registry.known_implementations, "cfdistfake",
                        {"class": "cfdist_no_such_module.FakeFS", "err": "Install cfdistfake-fs please"})
    with pytest.raises(ImportError, match=r"implementation for 'cfdistfake'.*: Install cfdistfake-fs please"):
        open_storage("cfdistfake://x")


@pytest.mark.parametrize("url", ["ckpt/run1", "./ckpt", "../ckpt", "file://ckpt/run1"])
def test_relative_local_paths_are_refused(url):
    with pytest.raises(ValueError, match="relative") as ei:
        open_storage(url)
    assert repr(url) in str(ei.value) and "absolute" in str(ei.value)


def test_non_string_url_is_a_type_error(tmp_path):
    with pytest.raises(TypeError, match="PosixPath"):
        open_storage(tmp_path)


def test_local_forms_are_canonical_and_duplicates_are_caught(tmp_path):
    st = open_storage(str(tmp_path / "a"))
    assert st.url == f"file://{tmp_path}/a" and os.path.isdir(tmp_path / "a")
    assert open_storage(f"file://{tmp_path}/a/").url == st.url
    with pytest.raises(ValueError, match="listed twice"):
        open_storages([f"file://{tmp_path}/a/", str(tmp_path / "x" / ".." / "a")])
    assert [s.url for s in open_storages([str(tmp_path / "a"), str(tmp_path / "b")])] == [
        f"file://{tmp_path}/a", f"file://{tmp_path}/b"]
    with pytest.raises(ValueError, match="at least one"):
        open_storages([])


def test_root_under_a_regular_file_is_a_clear_storage_error(tmp_path):
    # Works as root too (permission bits do not stop root; a file in the path does).
    blocker = tmp_path / "blocker"
    blocker.write_text("I am a file")
    url = f"file://{blocker}/ckpt"
    with pytest.raises(StorageError, match="cannot be used: its root cannot be created") as ei:
        open_storage(url)
    assert ei.value.errno in (errno.ENOTDIR, errno.EEXIST)
    assert url in str(ei.value) and "regular file is in the way" in str(ei.value)


def test_write_into_a_blocked_path_names_url_errno_and_fix(tmp_path):
    st = open_storage(f"file://{tmp_path}/root")
    st.write_file("step-1", [b"a file where a directory will be wanted"])
    with pytest.raises(StorageError) as ei:
        st.write_file("step-1/shard.bin", [b"x"])
    assert ei.value.errno in (errno.ENOTDIR, errno.EEXIST)
    assert f"writing {st.url}/step-1/shard.bin failed" in str(ei.value)


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root ignores permission bits")
def test_read_only_directory_is_a_clear_storage_error(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(StorageError, match="permissions") as ei:
            open_storage(f"file://{ro}/ckpt")
        assert ei.value.errno == errno.EACCES
    finally:
        ro.chmod(0o755)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_s3_wrong_endpoint_fails_on_first_use_with_the_url(s3_storage_options):
    opts = dict(s3_storage_options, skip_instance_cache=True,
                client_kwargs={"endpoint_url": f"http://127.0.0.1:{_closed_port()}"},
                config_kwargs={"retries": {"max_attempts": 1}, "connect_timeout": 1})
    st = open_storage("s3://some-bucket/run", **opts)  # lazy: opening touches no network
    with pytest.raises(StorageError, match=r"storage s3://some-bucket/run is unreachable.*endpoint_url"):
        st.listdir("")


def test_s3_missing_bucket_fails_on_first_use_not_as_an_empty_listing(s3_storage_options):
    st = open_storage("s3://cfdist-no-such-bucket/run", **s3_storage_options)
    with pytest.raises(StorageError, match="bucket 'cfdist-no-such-bucket' does not exist") as ei:
        st.listdir("")
    assert ei.value.errno == errno.ENOENT and "s3://cfdist-no-such-bucket/run" in str(ei.value)
    with pytest.raises(StorageError, match="does not exist"):
        st.write_file("x", [b"x"])
    with pytest.raises(StorageError, match="does not exist"):
        st.exists("x")
