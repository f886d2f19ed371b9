"""The chunk pool and shard streams of a host-memory budget (:mod:`cfdist.checkpoint.chunks`)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from cfdist.checkpoint import chunks
from cfdist.checkpoint.persist import _stream_chunks
from cfdist.checkpoint.snapshot import plan_layout
from cfdist.storage.direct import ALIGN


def _state():
    g = torch.Generator().manual_seed(0)
    # sizes that straddle windows: 3 pages + 12 bytes, 1 byte of bool, an empty tensor, a large one
    return {"a": torch.randn(3 * ALIGN // 4 + 3, generator=g), "b": torch.tensor([True]),
            "c": torch.empty(0), "d": torch.randint(0, 2**31, (5000,), generator=g, dtype=torch.int64),
            "e": torch.randn(7, 9, generator=g).t()}   # not contiguous


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_windows_reassemble_every_tensor_byte_for_byte_and_the_pool_never_exceeds_its_count():
    state = _state()
    layout = plan_layout(state, 2)
    pool = chunks.ChunkPool(chunks.minimum_budget(2), least=chunks.min_chunks(2))
    assert pool.chunk_bytes == ALIGN and pool.count == chunks.min_chunks(2)
    streams = [chunks.ShardStream(sum(e.nbytes for e in es), pool) for es in layout]
    got = [bytearray() for _ in streams]

    def drain(i):   # a writer: takes the windows in order, gives each back once "written"
        s = streams[i]
        for w in range(s.windows):
            got[i] += bytes(s.get(w))
            s.written(w)

    copier = threading.Thread(target=chunks.copy_windows, args=(streams, layout, state))
    copier.start()
    deadline = time.monotonic() + 10   # the copy fills the pool, then waits for the writers
    while pool.held < pool.count:
        assert time.monotonic() < deadline, f"the copy filled {pool.held} of {pool.count} chunks in 10 s"
        time.sleep(0.001)
    assert sum(s.windows for s in streams) > pool.count and copier.is_alive()
    threads = [threading.Thread(target=drain, args=(i,)) for i in range(len(streams))]
    for t in threads:
        t.start()
    for t in threads + [copier]:
        t.join(10)
        assert not t.is_alive(), "a writer waited for a window that was never copied"
    assert pool.peak == pool.count and pool.waits > 0   # the budget was the limit
    for es, data in zip(layout, got):
        for e in es:
            assert bytes(data[e.offset:e.offset + e.nbytes]) == _bytes(state[e.name]), e.name


def test_the_writers_generator_hashes_across_windows_and_gives_chunks_back_behind_the_writes_in_flight():
    import xxhash

    state = _state()
    (entries,) = plan_layout(state, 1)
    pool = chunks.ChunkPool(16 * ALIGN, least=16)   # one page per window, all of them ready
    stream = chunks.ShardStream(sum(e.nbytes for e in entries), pool)
    chunks.copy_windows([stream], [entries], state)   # 16 chunks: room for every window
    sums = {}
    gen = _stream_chunks(b"HDR", stream, entries, sums, lag=2, check=lambda: None)
    assert next(gen) == b"HDR"
    held = []
    for w in range(stream.windows):
        next(gen)
        held.append(pool.held)
    # asking for window w gives window w - 3 back: the consumer may still write the two before w
    n = stream.windows
    assert n >= 5 and held == [n - max(0, w - 2) for w in range(n)], held
    with pytest.raises(StopIteration):
        next(gen)
    stream.release_taken()
    assert pool.held == 0
    assert sums == {e.name: xxhash.xxh3_64(_bytes(state[e.name])).hexdigest() for e in entries}


def test_closing_a_stream_gives_ready_chunks_back_and_retires_the_ones_a_hung_writer_holds():
    pool = chunks.ChunkPool(chunks.minimum_budget())
    s = chunks.ShardStream(4 * ALIGN, pool)
    for w in range(3):
        assert s.put(w, pool.acquire())
    s.get(0)   # a writer took window 0 and hangs in its write
    s.close(hung=True)
    assert pool.retired == 1 and pool.held == 0
    assert not s.put(3, pool.acquire()) and pool.held == 0   # nothing reads a closed stream
    with pytest.raises(chunks.Cancelled):
        s.get(1)
    # the pool replaces the retired chunk: four can be held again
    got = [pool.acquire() for _ in range(pool.count)]
    assert len(got) == 4


def test_a_copy_waiting_for_a_chunk_stops_when_cancelled():
    pool = chunks.ChunkPool(chunks.minimum_budget())
    held = [pool.acquire() for _ in range(pool.count)]
    stop = threading.Event()
    threading.Timer(0.1, stop.set).start()
    with pytest.raises(chunks.Cancelled):
        pool.acquire(stop.is_set)
    assert len(held) == pool.count


@pytest.mark.parametrize("value,error,match", [
    (4095, ValueError, "the minimum is 16384 bytes"),
    (0.0, ValueError, r"fraction of the state's bytes, in \(0, 1\]"),
    (2.0, ValueError, "fraction"),
    (True, TypeError, "host_memory must be"),
    ("50%", TypeError, "host_memory must be"),
])
def test_budgets_that_cannot_work_are_refused_naming_what_would(value, error, match):
    with pytest.raises(error, match=match):
        chunks.check_budget(value)


def test_budgets_resolve_to_pages_and_a_fraction_of_a_tiny_state_to_the_least_that_works():
    assert chunks.resolve_budget(0.25, 400 << 20) == 100 << 20
    assert chunks.resolve_budget(0.25, 1000, roots=1, whole_bytes=100) == chunks.minimum_budget() + 100
    assert chunks.chunk_size(100 << 20) == chunks.CHUNK_MAX
    assert chunks.chunk_size(10 << 20) == (10 << 20) // 4 // ALIGN * ALIGN
    assert chunks.min_chunks(roots=3) == 7


def test_a_shared_pool_hands_each_chunk_back_once_through_its_mailbox(tmp_path):
    """The writer-process side (``RemoteStream``, here in this process over the same files):
    it takes READY windows, marks them DONE; the pool takes DONE chunks back when it needs one,
    and a chunk closed and marked DONE late (a writer that lived on) is not handed out twice."""
    import pickle

    pool = chunks.ChunkPool(chunks.minimum_budget(), shared=True, shm_dir=str(tmp_path))
    s = chunks.ShardStream(6 * ALIGN, pool)
    remote = pickle.loads(pickle.dumps(s.handle()))   # what the writer process receives
    got = [pool.acquire() for _ in range(pool.count)]
    for w, c in enumerate(got):
        c.fill_(w + 1)
        assert s.put(w, c)
    assert bytes(remote.get(0))[:3] == b"\x01\x01\x01"
    remote.written(0)                                     # DONE: the pool may take it back
    again = pool.acquire()                                # reclaimed from the mailbox, no wait
    assert again.data_ptr() == got[0].data_ptr()
    remote.get(1)                                         # taken, then the stream is closed
    s.close()
    remote.written(1)                                     # a late DONE after the close
    free = [pool.acquire() for _ in range(pool.count - 1)]
    assert len({c.data_ptr() for c in free + [again]}) == pool.count   # every chunk once
    with pytest.raises(chunks.Cancelled):   # all held: the late DONE does not free chunk 1 twice
        pool.acquire(cancelled=lambda: True)
    with pytest.raises(chunks.Cancelled):
        remote.get(4)                                     # the writer learns the stream closed
    pool.close()
    assert not list(tmp_path.iterdir())                   # the pool's files are gone


def test_closing_a_stream_never_frees_a_chunk_the_pool_reclaimed_and_posted_for_another_stream(tmp_path):
    """The race behind a deadlocked ``buffers=2`` run with a writer process (one CI run in
    several): a stream's ``close`` lists its chunks, the copy thread meanwhile reclaims one the
    writer marked DONE and posts the *next* snapshot's window in it, and the close then freed
    that chunk a second time -- the copy overwrote the unread window, and its writer waited
    for it for ever. Here the copy's reclaim is run at the first release of the close."""
    class Racing(chunks.ChunkPool):
        hook = None

        def release(self, chunk, **kw):
            hook, self.hook = self.hook, None
            if hook is not None:
                hook()
            super().release(chunk, **kw)

    pool = Racing(chunks.minimum_budget(), shared=True, shm_dir=str(tmp_path))
    a, b = chunks.ShardStream(pool.count * ALIGN, pool), chunks.ShardStream(ALIGN, pool)
    ra, rb = a.handle(), b.handle()
    for w in range(pool.count):
        c = pool.acquire()
        c.fill_(w + 1)
        a.put(w, c)
    for w in (0, 1):   # the writer wrote two windows and ended (the persist is done)
        ra.get(w)
        ra.written(w)
    posted = []

    def next_snapshot_copies():   # the copy thread of the next snapshot, inside a's close
        c = pool.acquire()        # no chunk free: reclaims the two DONE ones
        c.fill_(0xB)
        b.put(0, c)
        posted.append(c)
    pool.hook = next_snapshot_copies
    a.close()
    assert posted, "the copy's reclaim did not run inside the close"
    deadline = time.monotonic() + 10

    def lost():
        if time.monotonic() > deadline:
            raise AssertionError("the next snapshot's window 0 never became readable: it was freed and lost")
    assert bytes(rb.get(0, lost))[:2] == b"\x0b\x0b"
    rest = [pool.acquire() for _ in range(pool.count - 1)]
    assert posted[0].data_ptr() not in {c.data_ptr() for c in rest}, "a posted chunk was handed out again"
    with pytest.raises(chunks.Cancelled):
        pool.acquire(cancelled=lambda: True)   # every chunk is held exactly once
    pool.close()


def test_a_writer_process_never_takes_a_window_from_a_mailbox_row_being_rewritten(tmp_path):
    """The other race behind the deadlocked ``buffers=2`` writer-process runs: a writer read a
    row's token, window and state in three passes while the pool rewrote it for another
    stream, saw its own token beside the other stream's window number, took that chunk as its
    own window (wrong bytes), and the other stream's writer waited for it for ever. Here the
    pool is stopped half way through a post (sequence lock odd, token new, window old)."""
    pool = chunks.ChunkPool(chunks.minimum_budget(), shared=True, shm_dir=str(tmp_path))
    a, b = chunks.ShardStream(4 * ALIGN, pool), chunks.ShardStream(4 * ALIGN, pool)
    ra = a.handle()
    c = pool.acquire()
    c.fill_(0xB)
    b.put(2, c)                       # stream b's window 2, READY
    slot = pool.slot(c)
    row = pool._rows[slot]
    row[chunks.SEQ] += 1              # the pool begins to rewrite the row for a's window 3 ...
    row[chunks.TOKEN] = a.token       # ... and has written the token, not yet the window
    assert ra._find(pool._rows, 2) is None, "a's writer took b's window 2 as its own window 2"
    row[chunks.WINDOW] = 3
    row[chunks.STATE] = chunks.READY
    row[chunks.SEQ] += 1              # the post is complete
    assert ra._find(pool._rows, 2) is None
    assert ra._find(pool._rows, 3) == slot
    pool.close()
