"""The local write path's I/O modes (cfdist.storage.direct): O_DIRECT, the fallback, cache advice."""

from __future__ import annotations

import errno
import logging
import os

import numpy as np
import pytest

from cfdist.storage import direct, open_storage

SHM = "/dev/shm"


@pytest.fixture
def fresh_probe(monkeypatch):
    """Forget which filesystems were probed and logged (module caches of this process)."""
    monkeypatch.setattr(direct, "_probed", {})
    monkeypatch.setattr(direct, "_logged", {})


def _direct_ok(path) -> bool:
    return direct.unsupported_reason(str(path)) is None


def _chunks():
    """A header-like unaligned piece, page-aligned windows of an array, and an unaligned tail."""
    buf = direct.aligned_buffer(3 * direct.ALIGN * 5 + 100)
    arr = np.frombuffer(buf, dtype=np.uint8)
    arr[:] = np.random.default_rng(0).integers(0, 256, arr.size, dtype=np.uint8)
    pieces = [b"H" * 4096, memoryview(arr[:2 * direct.ALIGN]), memoryview(arr[2 * direct.ALIGN:9 * direct.ALIGN]),
              memoryview(arr[9 * direct.ALIGN:]), b"tail-bytes", memoryview(arr[:123])]
    return pieces, b"".join(bytes(p) for p in pieces), buf


@pytest.mark.parametrize("threads", [1, 3])
def test_direct_writes_exact_bytes_and_length(tmp_path, fresh_probe, threads):
    if not _direct_ok(tmp_path):
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT: covered by the fallback test")
    st = open_storage(str(tmp_path))
    pieces, want, _buf = _chunks()
    with direct.io_mode("direct", threads=threads):
        n = st.write_file("a/shard.bin", pieces)
    assert n == len(want)
    assert (tmp_path / "a" / "shard.bin").read_bytes() == want
    assert direct.last_mode.value == "direct"


def test_tmpfs_falls_back_to_buffered_with_one_log_line(fresh_probe, caplog, monkeypatch):
    """A filesystem without O_DIRECT: ``auto`` writes buffered there and says so once; ``direct``
    refuses with the fix. Real: /dev/shm (tmpfs), the writes, the log. Faked where the kernel's
    tmpfs accepts O_DIRECT (Linux >= 6.6 does): its refusal, as ``open`` failing with EINVAL,
    which is what older tmpfs and FUSE filesystems answer."""
    if not os.path.isdir(SHM):
        pytest.skip("no /dev/shm on this machine")
    if direct.unsupported_reason(SHM) is None:
        real_open = os.open

        def refusing_open(path, flags, *a, **kw):
            if flags & direct._O_DIRECT and str(path).startswith(SHM):
                raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
            return real_open(path, flags, *a, **kw)

        monkeypatch.setattr(os, "open", refusing_open)
        monkeypatch.setattr(direct, "_probed", {})
    d = os.path.join(SHM, f"cfdist-test-{os.getpid()}")
    st = open_storage(d)
    try:
        pieces, want, _buf = _chunks()
        caplog.set_level(logging.INFO, logger="cfdist.storage")
        with direct.io_mode("auto"):
            for i in range(3):
                assert st.write_file(f"f{i}", pieces) == len(want)
        assert all(open(os.path.join(d, f"f{i}"), "rb").read() == want for i in range(3))
        assert direct.last_mode.value == "buffered"
        lines = [r.getMessage() for r in caplog.records if "O_DIRECT" in r.getMessage()]
        assert len(lines) == 1 and d in lines[0], lines
        with pytest.raises(OSError, match="refuses O_DIRECT.*io=.auto."), direct.io_mode("direct"):
            st.write_file("g", pieces)
    finally:
        st.remove("")


def test_buffered_mode_drops_the_pages_after_fsync(tmp_path, monkeypatch):
    calls = []
    real_fsync, real_fadvise = os.fsync, os.posix_fadvise
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(os, "posix_fadvise",
                        lambda fd, off, n, adv: (calls.append(("fadvise", off, n, adv)), real_fadvise(fd, off, n, adv))[1])
    st = open_storage(str(tmp_path))
    with direct.io_mode("buffered"):
        st.write_file("x", [b"abc" * 1000])
    assert calls == ["fsync", ("fadvise", 0, 0, os.POSIX_FADV_DONTNEED)]
    calls.clear()
    st.write_file("y", [b"abc"])          # outside io_mode: the plain write, no advice
    assert calls == ["fsync"]


def test_io_mode_refuses_unknown_modes():
    with pytest.raises(ValueError, match="'auto', 'direct', 'buffered'"), direct.io_mode("fast"):
        pass
