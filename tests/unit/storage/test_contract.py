"""The Storage contract, one suite run against file://, memory:// and s3:// (s3fs on a real local
moto server, see tests/conftest.py). Nothing is faked except, in the fsync test, ``os.fsync``
(recorded, then really called)."""

from __future__ import annotations

import os
import pickle
import posixpath
import subprocess
import sys
import threading

import fsspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from cfdist.storage import Storage, StorageError, open_storage


@pytest.fixture
def st(storage_url) -> Storage:
    return open_storage(storage_url)


def test_write_file_returns_count_and_reads_back_ranges(st):
    n = st.write_file("a.bin", [b"hello ", memoryview(b"world"), bytearray(b"!")])
    assert n == 12
    assert st.read_bytes("a.bin") == b"hello world!"
    assert st.read_bytes("a.bin", 0, 5) == b"hello"
    assert st.read_bytes("a.bin", 6) == b"world!"
    assert st.read_bytes("a.bin", 6, 11) == b"world"
    assert st.read_bytes("a.bin", 10, 100) == b"d!"  # clamped like a slice
    assert st.read_bytes("a.bin", 12) == b""
    assert st.read_bytes("a.bin", 100, 200) == b""
    assert st.read_bytes("a.bin", 7, 3) == b""
    with st.open_read("a.bin") as f:
        f.seek(6)
        assert f.read(5) == b"world"
    with pytest.raises(ValueError, match="start=-1"):
        st.read_bytes("a.bin", -1)


def test_read_private_is_the_file_and_stays_apart_from_it(st):
    """``read_private`` (restore's read) returns the whole file as a writable buffer of the
    process's own: writing into it never changes the file, and the file written over in place
    or shortened afterwards (a retired file reused by the next persist) never changes it."""
    st.write_file("m.bin", [b"0123456789"])
    buf = st.read_private("m.bin")
    assert bytes(buf) == b"0123456789" and not buf.readonly
    buf[0:3] = b"abc"
    assert st.read_bytes("m.bin") == b"0123456789"
    keep = st.read_private("m.bin")
    if st.is_local:
        with open(st.path("m.bin"), "r+b") as f:   # what a persist writing over a retired file does
            f.write(b"XY")
            f.truncate(4)
    else:
        st.write_file("m.bin", [b"XY"])
    assert bytes(keep) == b"0123456789"
    st.write_file("empty.bin", [])
    assert bytes(st.read_private("empty.bin")) == b""
    with pytest.raises(FileNotFoundError):
        st.read_private("missing.bin")


def test_write_file_creates_parents_and_truncates_on_rewrite(st):
    st.write_file("x/y/z.bin", [b"0123456789"])
    st.write_file("x/y/z.bin", [b"abc"])
    assert st.read_bytes("x/y/z.bin") == b"abc"
    assert st.size("x/y/z.bin") == 3
    assert st.write_file("x/empty", []) == 0
    assert st.read_bytes("x/empty") == b""


def test_write_atomic_replaces_content_and_leaves_no_tmp(st):
    st.write_atomic("d/MANIFEST.json", b'{"v": 1, "padding": "xxxxxxxx"}')
    st.write_atomic("d/MANIFEST.json", b'{"v": 2}')
    assert st.read_bytes("d/MANIFEST.json") == b'{"v": 2}'
    assert st.listdir("d") == ["MANIFEST.json"]


def test_listdir_gives_sorted_names_of_direct_children(st):
    for rel in ["top.txt", "d1/x", "d1/sub/y", "d1x/w", "d2/z", "step-1/a", "step-10/a"]:
        st.write_file(rel, [b"."])
    assert st.listdir("") == ["d1", "d1x", "d2", "step-1", "step-10", "top.txt"]
    assert st.listdir("d1") == ["sub", "x"]
    assert st.listdir("d1/") == ["sub", "x"]
    assert st.listdir("d1/sub") == ["y"]
    assert st.listdir("step-1") == ["a"]
    assert st.listdir("missing") == []
    assert st.listdir("missing/deeper") == []
    assert st.listdir("top.txt") == []  # a file has no children


def test_exists_and_size(st):
    st.write_file("d/f.bin", [b"x" * 1000])
    assert st.exists("d/f.bin") and st.exists("d")
    assert not st.exists("d/nope") and not st.exists("nope/deeper")
    assert st.size("d/f.bin") == 1000
    with pytest.raises(FileNotFoundError):
        st.size("d/nope")
    with pytest.raises(FileNotFoundError):
        st.read_bytes("d/nope")
    with pytest.raises(FileNotFoundError):
        st.open_read("d/nope")


def test_remove_is_recursive_tolerant_and_precise(st):
    for rel in ["run/step-1/a", "run/step-1/sub/b", "run/step-10/a", "run/keep.txt"]:
        st.write_file(rel, [b"."])
    st.remove("run/step-1")
    assert not st.exists("run/step-1/a") and not st.exists("run/step-1")
    assert st.listdir("run") == ["keep.txt", "step-10"]  # the sibling sharing a prefix survives
    st.remove("run/keep.txt")
    assert st.listdir("run") == ["step-10"]
    st.remove("run/step-1")  # missing: no error
    st.remove("never/was")


def test_staging_then_publish(st):
    final = "run/step-000000001"
    staging = st.staging_dir(final)
    if st.atomic_rename:
        assert staging != final and posixpath.dirname(staging) == "run"
    else:  # object stores write in place; the manifest written last is the commit marker
        assert staging == final
    st.write_file(f"{staging}/shard0.bin", [b"tensor bytes"])
    st.write_file(f"{staging}/MANIFEST.json", [b"{}"])
    if st.atomic_rename:
        assert not st.exists(final)
        assert st.listdir("run") == [posixpath.basename(staging)]
    st.publish(staging, final)
    assert st.listdir("run") == ["step-000000001"]  # staging name gone
    assert st.listdir(final) == ["MANIFEST.json", "shard0.bin"]
    assert st.read_bytes(f"{final}/shard0.bin") == b"tensor bytes"


def test_publish_refuses_an_existing_final(st):
    if not st.atomic_rename:
        # Object stores publish in place: staging is the final prefix and publish is a no-op
        # that leaves every object where it was written (the manifest PUT is the commit).
        assert st.staging_dir("run/step-2") == "run/step-2"
        st.write_file("run/step-2/old", [b"old"])
        st.publish("run/step-2", "run/step-2")
        assert st.read_bytes("run/step-2/old") == b"old"
        return
    st.write_file("run/step-2/old", [b"old"])
    staging = st.staging_dir("run/step-2")
    st.write_file(f"{staging}/new", [b"new"])
    with pytest.raises(StorageError, match="already exists") as ei:
        st.publish(staging, "run/step-2")
    assert "run/step-2" in str(ei.value)
    assert st.listdir("run/step-2") == ["old"]


@pytest.mark.parametrize("bad", ["../x", "a/../../x", "..", "a/b/../../../etc"])
def test_paths_escaping_the_root_raise(st, bad):
    with pytest.raises(ValueError, match="escapes"):
        st.write_file(bad, [b"x"])
    for call in (st.read_bytes, st.exists, st.listdir, st.remove, st.size, st.open_read):
        with pytest.raises(ValueError, match="escapes"):
            call(bad)
    with pytest.raises(ValueError, match="escapes"):
        st.publish(st.staging_dir("ok"), bad)


def test_dotdot_inside_the_root_is_fine(st):
    st.write_file("a/../b.bin", [b"b"])
    assert st.listdir("") == ["b.bin"]


def test_partial_write_leaves_what_the_backend_leaves(st):
    """A chunk iterator that breaks midway: object stores get no object at all (the upload is
    aborted), local and memory files keep the bytes written so far."""

    def chunks():
        yield b"first"
        raise RuntimeError("serializer broke")

    with pytest.raises(RuntimeError, match="serializer broke"):
        st.write_file("p.bin", chunks())
    if st.atomic_rename:
        assert st.read_bytes("p.bin") == b"first"
    else:
        assert not st.exists("p.bin")


def test_concurrent_writers_from_threads(st):
    errors = []

    def write(i):
        try:
            st.write_file(f"t/{i}.bin", [bytes([i]) * 1000] * 3)
        except Exception as e:  # noqa: BLE001 - collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert st.listdir("t") == [f"{i}.bin" for i in range(6)]
    assert all(st.read_bytes(f"t/{i}.bin") == bytes([i]) * 3000 for i in range(6))


def test_storage_pickles_for_writer_processes(st):
    st.write_file("k", [b"v"])
    copy = pickle.loads(pickle.dumps(st))
    assert copy.url == st.url and copy.read_bytes("k") == b"v"


def test_local_fsync_covers_files_and_directory_entries(tmp_path, monkeypatch):
    st = open_storage(f"file://{tmp_path}/root")
    synced = []  # (st_dev, st_ino) of every fsynced descriptor
    real_fsync = os.fsync

    def recording_fsync(fd):
        s = os.fstat(fd)
        synced.append((s.st_dev, s.st_ino))
        real_fsync(fd)

    def ino(rel):
        s = os.stat(st.path(rel))
        return (s.st_dev, s.st_ino)

    monkeypatch.setattr(os, "fsync", recording_fsync)

    st.write_file("f.bin", [b"x"])
    assert synced == [ino("f.bin")]
    synced.clear()
    st.write_file("g.bin", [b"x"], fsync=False)
    assert synced == []

    st.write_file("run/keep", [b"."])
    synced.clear()
    st.write_atomic("run/MANIFEST.json", b"{}")
    assert synced == [ino("run/MANIFEST.json"), ino("run")]  # the file, then its directory

    staging = st.staging_dir("run/step-1")
    st.write_file(f"{staging}/shard", [b"s"])
    staging_ino = ino(staging)
    synced.clear()
    st.publish(staging, "run/step-1")
    assert synced == [staging_ino, ino("run")]  # the staged entries, then the rename
    assert ino("run/step-1") == staging_ino


def test_s3_sees_writes_from_another_client_after_listing(s3_url, s3_storage_options):
    """s3fs caches listings per instance; a Storage must not answer from a stale cache when
    another process (here: a second, uncached filesystem instance) has written since."""
    st = open_storage(s3_url, **s3_storage_options)
    other = open_storage(s3_url, skip_instance_cache=True, **s3_storage_options)
    assert other.fs is not st.fs
    st.write_file("run/a", [b"1"])
    assert st.listdir("run") == ["a"]
    other.write_file("run/b", [b"22"])
    assert st.exists("run/b")
    assert st.size("run/b") == 2
    assert st.listdir("run") == ["a", "b"]


@settings(max_examples=200, deadline=None)
@given(hs.lists(hs.sampled_from(["a", "b", "..", ".", ""]), max_size=6))
def test_path_stays_under_the_root_or_raises(segments):
    st = Storage("memory://root", fs=fsspec.filesystem("memory"), root="/root", protocol="memory")
    rel = "/".join(segments)
    depth = 0
    for s in segments:  # where a shell would end up, never climbing above the root
        depth = depth - 1 if s == ".." else depth + (s not in (".", ""))
        if depth < 0:
            break
    try:
        p = st.path(rel)
    except ValueError:
        assert depth < 0, rel
        return
    assert depth >= 0, rel
    assert p == "/root" or p.startswith("/root/")
    assert ".." not in p.split("/")


def test_s3_fixture_reaches_the_server_from_a_child_process_with_dummy_credentials(s3_url):
    """The fixture's environment is what a writer process or a Ray worker inherits: plain s3fs,
    no options, finds the local server and resolves only the dummy credentials."""
    st = open_storage(s3_url)
    st.write_file("k", [b"from the parent"])
    child = (
        "import sys, s3fs\n"
        "fs = s3fs.S3FileSystem()\n"
        "print(fs.cat_file(sys.argv[1]).decode())\n"
        "import botocore.session\n"
        "print(botocore.session.get_session().get_credentials().access_key)\n"
    )
    out = subprocess.run([sys.executable, "-c", child, st.path("k")], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["from", "the", "parent", "testing"]
