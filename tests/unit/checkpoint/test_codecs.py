"""cfdist.codecs: round trips through the real persist and read path (``memory://``), error
bounds of the lossy codecs, Huffman coding, the auto bit width, chains and retention."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as hs

import cfdist
from cfdist.checkpoint import discovery
from cfdist.checkpoint.codecs import Incremental, LCDelta, Quantize, Zstd, chain, huffman
from cfdist.checkpoint.codecs.lcdelta import dequantize, error_bound, exp_quantize
from cfdist.checkpoint.codecs.quantize import auto_bits, per_row_bound
from cfdist.checkpoint.format import CheckpointError
from cfdist.checkpoint.persist import PersistJob, ShardJob, write_checkpoint
from cfdist.checkpoint.retention import choose_deletions
from cfdist.checkpoint.snapshot import plan_layout
from cfdist.storage import open_storages

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool]


def persist(url: str, step: int, tensors: dict[str, torch.Tensor], codecs, *, session="s", keep=100, n_shards=1):
    """Write ``tensors`` as checkpoint ``step`` through write_checkpoint (what every backend runs)."""
    sts = open_storages(url)
    layout = plan_layout(tensors, n_shards)
    arenas = []
    for es in layout:
        buf = torch.empty(max(sum(e.nbytes for e in es), 1), dtype=torch.uint8)
        for e in es:
            buf[e.offset:e.offset + e.nbytes].view(e.dtype).view(e.shape).copy_(tensors[e.name])
        arenas.append(buf)
    shards = [ShardJob(index=i, count=len(layout), root=0, nbytes=sum(e.nbytes for e in es), entries=es)
              for i, es in enumerate(layout)]
    job = PersistJob(step=step, manifest={"skeleton": {k: {"__t__": k} for k in tensors}}, shards=shards,
                     keep=keep, arenas=arenas, codecs=tuple(codecs), codec_session=session)
    return write_checkpoint(sts, job)


def read(url: str, step: int) -> dict[str, torch.Tensor]:
    return discovery.load_verified(open_storages(url), step)[1]


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def random_tensor(rng: np.random.Generator, dtype, shape) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.from_numpy(rng.integers(0, 2, shape).astype(bool))
    if dtype.is_floating_point:
        return torch.from_numpy(rng.standard_normal(shape)).to(dtype)
    info = torch.iinfo(dtype)
    return torch.from_numpy(rng.integers(max(info.min, -1000), min(info.max, 1000), shape)).to(dtype)


@pytest.fixture
def url():
    import fsspec

    name = f"cfdist-codecs-{uuid.uuid4().hex[:12]}"
    yield f"memory://{name}"
    chain.forget(f"memory://{name}")
    fs = fsspec.filesystem("memory")
    if fs.exists(f"/{name}"):
        fs.rm(f"/{name}", recursive=True)


LOSSLESS = {
    "zstd": lambda: [Zstd(level=1)],
    "incremental": lambda: [Incremental(full_every=3)],
    "one-shot": lambda: [Incremental(full_every=None)],
    "consecutive+zstd": lambda: [Incremental(full_every=3, variant="consecutive"), Zstd()],
}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dtype=hs.sampled_from(DTYPES), rows=hs.integers(0, 40), cols=hs.integers(0, 9),
       combo=hs.sampled_from(sorted(LOSSLESS)), seed=hs.integers(0, 2 ** 16), n_ckpt=hs.integers(1, 5))
def test_lossless_codecs_round_trip_every_checkpoint_of_a_chain_bit_exact(url, dtype, rows, cols, combo, seed, n_ckpt):
    rng = np.random.default_rng(seed)
    u = f"{url}/{uuid.uuid4().hex[:8]}"
    t = {"emb": random_tensor(rng, dtype, (rows, cols)), "vec": random_tensor(rng, dtype, (cols,)),
         "empty": random_tensor(rng, dtype, (0,))}
    if dtype.is_floating_point and t["emb"].numel():
        t["emb"].view(-1)[0] = -0.0          # bits, not values: -0.0 vs 0.0 and NaN must survive
        t["emb"].view(-1)[-1] = float("nan")
    codecs = LOSSLESS[combo]()
    written = {}
    for step in range(1, n_ckpt + 1):
        if rows:
            touched = rng.choice(rows, size=min(rows, 3), replace=False)
            t["emb"][touched] = random_tensor(rng, dtype, (len(touched), cols))
        persist(u, step, t, codecs)
        written[step] = {k: bits(v) for k, v in t.items()}
    for step, want in written.items():
        got = read(u, step)
        assert {k: bits(v) for k, v in got.items()} == want
        assert {k: (v.dtype, tuple(v.shape)) for k, v in got.items()} == {k: (v.dtype, tuple(v.shape)) for k, v in t.items()}
    chain.forget(u)


def test_increments_write_only_changed_rows_and_a_full_checkpoint_every_n(url):
    emb = torch.randn(1000, 32)
    sizes = []
    for step in range(1, 8):
        emb[step * 10:step * 10 + 5] += 1.0                 # 5 rows change per step
        sizes.append(persist(url, step, {"emb": emb}, [Incremental(full_every=3)]).bytes)
    m = [discovery.read_manifest(open_storages(url), s) for s in range(1, 8)]
    assert [bool(x["depends_on"]) for x in m] == [False, True, True, False, True, True, False]
    assert m[2]["depends_on"][0][0] == 1 and m[5]["depends_on"][0][0] == 4      # intermittent: the full one
    inc = m[2]["tensors"]["emb"]
    assert inc["codecs"][0]["name"] == "incremental"
    # step 3 holds the rows changed since step 1: 10 rows of 128 bytes + their int32 indices
    assert dict((p[0], p[2]) for p in inc["parts"]) == {"rows": [10], "data": [10, 32]}
    assert sizes[2] < 2000 < 128_000 <= sizes[0]
    assert torch.equal(read(url, 7)["emb"], emb)


def test_consecutive_increments_hold_rows_changed_since_the_previous_checkpoint(url):
    emb = torch.zeros(100, 4)
    for step in range(1, 5):
        emb[step] = step
        persist(url, step, {"emb": emb}, [Incremental(full_every=None, variant="consecutive")])
    m = discovery.read_manifest(open_storages(url), 4)
    assert [d[0] for d in m["depends_on"]] == [1, 2, 3]
    assert dict((p[0], p[2]) for p in m["tensors"]["emb"]["parts"])["rows"] == [1]
    assert torch.equal(read(url, 4)["emb"], emb)


def test_a_missing_or_corrupt_increment_breaks_only_the_checkpoints_that_need_it(url, caplog):
    emb = torch.zeros(50, 4)
    for step in range(1, 6):
        emb[step] = step
        persist(url, step, {"emb": emb}, [Incremental(full_every=None, variant="consecutive")])
    sts = open_storages(url)
    sts[0].remove("step-000000003/shard-00000-of-00001.safetensors")
    for s in (3, 4, 5):
        with pytest.raises(CheckpointError, match="needs step 3" if s > 3 else "missing"):
            read(url, s)
    assert read(url, 2)["emb"][2].eq(2).all()
    assert cfdist.load(url)["step"] == 2      # walks back to the newest whole chain
    assert "step 5 in" in caplog.text and "needs step 3 (through step 4)" in caplog.text
    assert "steps from 3 to 5 of this chain are lost" in caplog.text


def test_a_base_replaced_by_another_run_is_not_mistaken_for_the_reference(url):
    emb = torch.zeros(20, 4)
    persist(url, 1, {"emb": emb}, [Incremental()], session="a")
    emb[3] = 1
    persist(url, 2, {"emb": emb}, [Incremental()], session="a")
    other = f"{url}-other"
    persist(other, 1, {"emb": torch.ones(20, 4)}, [Incremental()], session="b")
    open_storages(url)[0].remove("step-000000001")           # step 1 replaced by another run's step 1
    discovery.copy_checkpoint(open_storages(other), 1, open_storages(url))
    with pytest.raises(CheckpointError, match="another run replaced it"):
        read(url, 2)
    chain.forget(other)
    open_storages(other)[0].remove("step-000000001")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("nbits", [8, 4, 2])
def test_uniform_quantization_stays_within_half_a_step_per_row(url, dtype, nbits):
    rng = np.random.default_rng(nbits)
    x = torch.from_numpy(rng.standard_normal((64, 33)) * rng.uniform(0.01, 10, (64, 1))).to(dtype)
    x[5] = 0.25                                     # a constant row: exact
    persist(url, 1, {"emb": x}, [Quantize(bits=nbits)])
    with pytest.warns(cfdist.codecs.LossyCheckpointWarning):
        got = read(url, 1)["emb"]
    assert got.dtype == dtype and got.shape == x.shape
    xf = x.float().numpy()
    err = np.abs(got.float().numpy() - xf)
    bound = per_row_bound(xf, nbits)[:, None]
    rounding = np.abs(xf) * (torch.finfo(dtype).eps if dtype != torch.float32 else 1e-6) + 1e-7
    assert (err <= bound * 1.0001 + rounding).all()
    assert err[5].max() == 0
    stored = discovery.read_manifest(open_storages(url), 1)["tensors"]["emb"]["nbytes"]
    assert stored <= 64 * 33 * nbits / 8 + 64 * 8 + 64


@settings(max_examples=30, deadline=None)
@given(seed=hs.integers(0, 2 ** 16), nbits=hs.sampled_from([8, 4, 2]), cols=hs.integers(1, 50))
def test_adaptive_quantization_is_never_worse_than_uniform_per_row(seed, nbits, cols):
    from cfdist.checkpoint.codecs.quantize import _dequantize, _quantize, row_ranges

    rng = np.random.default_rng(seed)
    x = (rng.standard_t(2, (16, cols)) * rng.uniform(0.1, 3, (16, 1))).astype(np.float32)
    levels = (1 << nbits) - 1

    def rmse(method):
        lo, scale = row_ranges(x, nbits, method)
        return np.sqrt(((_dequantize(_quantize(x, lo, scale, levels), lo, scale) - x) ** 2).mean(axis=1))

    uni, ada = rmse("uniform"), rmse("adaptive")
    assert (ada <= uni * (1 + 1e-5) + 1e-7).all()
    assert (uni <= per_row_bound(x, nbits) * 1.0001 + 1e-7).all()


def test_increments_of_quantized_tables_reuse_the_raw_rows_and_restore_within_the_bound(url):
    emb = torch.randn(200, 16)
    codecs = [Incremental(full_every=10), Quantize(bits=4), Zstd()]
    for step in range(1, 4):
        emb[step * 7] += 3
        persist(url, step, {"emb": emb}, codecs)
    m = discovery.read_manifest(open_storages(url), 3)["tensors"]["emb"]
    assert [c["name"] for c in m["codecs"]][:2] == ["incremental", "quantize"]   # zstd only if it shrinks
    with pytest.warns(cfdist.codecs.LossyCheckpointWarning, match="not bit-exact"):
        got = read(url, 3)["emb"].numpy()
    bound = per_row_bound(emb.numpy(), 4)[:, None]
    assert (np.abs(got - emb.numpy()) <= bound * 1.0001 + 1e-6).all()


def test_lc_delta_error_stays_within_one_steps_bound_along_a_chain(url):
    rng = np.random.default_rng(0)
    w = rng.standard_normal(5000).astype(np.float32)
    prev_decoded = None
    ratios = []
    for step in range(1, 9):
        w = w - 0.01 * rng.standard_normal(5000).astype(np.float32) * (rng.random(5000) < 0.5)
        info = persist(url, step, {"w": torch.from_numpy(w.copy())}, [LCDelta(bits=3, full_every=None)])
        with pytest.warns(cfdist.codecs.LossyCheckpointWarning) if step > 1 else _nowarn():
            got = read(url, step)["w"].numpy()
        if prev_decoded is None:
            assert np.array_equal(got, w)            # the first one is full
        else:
            meta = discovery.read_manifest(open_storages(url), step)["tensors"]["w"]["codecs"][0]
            d = w - prev_decoded
            assert (np.abs(got - w) <= error_bound(d, meta["e_low"]) + 4 * np.spacing(np.abs(w))).all()
            ratios.append(w.nbytes / info.bytes)
        prev_decoded = got
    assert min(ratios) > 5       # ~2 bits per value here


class _nowarn:
    def __enter__(self):
        import warnings

        self._c = warnings.catch_warnings()
        self._c.__enter__()
        warnings.simplefilter("error", cfdist.codecs.LossyCheckpointWarning)

    def __exit__(self, *a):
        self._c.__exit__(*a)


@settings(max_examples=40, deadline=None)
@given(seed=hs.integers(0, 2 ** 16), n=hs.integers(0, 3000), nbits=hs.integers(1, 6))
def test_exponent_quantization_bound_and_huffman_round_trip(seed, n, nbits):
    rng = np.random.default_rng(seed)
    d = (rng.standard_normal(n) * 10.0 ** rng.uniform(-6, 2, n)).astype(np.float32)
    d[rng.random(n) < 0.2] = 0
    sym, reps, e_low = exp_quantize(d, nbits)
    assert (np.abs(d - dequantize(sym, reps)) <= error_bound(d, e_low)).all()
    assert (dequantize(sym, reps)[d == 0] == 0).all()
    lens, payload, offs, block = huffman.encode(sym, len(reps))
    assert np.array_equal(huffman.decode(payload, lens, offs, n, block), sym)


def test_huffman_lengths_are_limited_and_the_code_is_prefix_free():
    counts = np.array([2 ** i for i in range(40)][::-1] + [1])          # Fibonacci-like skew
    lens = huffman.code_lengths(counts, limit=16)
    assert lens.max() <= 16
    assert sum(2.0 ** -int(l) for l in lens if l) <= 1.0                 # Kraft
    sym = np.repeat(np.arange(len(counts)), np.minimum(counts, 50)).astype(np.uint8)
    l2, p, o, b = huffman.encode(sym, len(counts))
    assert np.array_equal(huffman.decode(p, l2, o, len(sym), b), sym)


@pytest.mark.parametrize("mtbf, run, bits", [(None, 3600, 8), (3600, None, 8), (3600, 3600, 4),
                                             (3600, 3 * 3600, 4), (3600, 4 * 3600, 8), (60, 86400, 8)])
def test_auto_bits_follow_the_expected_number_of_restores(mtbf, run, bits):
    got, why = auto_bits(mtbf_s=mtbf, run_s=run)
    assert got == bits and f"bits={bits}" in why


def test_checkpointer_resolves_auto_bits_from_the_policy_mtbf(url):
    m = torch.nn.Linear(4, 4)
    ck = cfdist.Checkpointer({"m": m}, url, cfdist.Auto(mtbf_s=1000.0),
                             codecs=[Quantize(bits="auto", run_s=2000.0)])
    try:
        assert ck.codecs[0].bits == 4
    finally:
        ck.close()


@pytest.mark.parametrize("bad, msg", [
    (lambda: Quantize(bits=3), "bits must be 8, 4, 2 or 'auto'"),
    (lambda: Quantize(method="best"), "method"),
    (lambda: Incremental(full_every=0), "full_every"),
    (lambda: Incremental(variant="daily"), "variant"),
    (lambda: LCDelta(bits=9), "bits must be an int in 1..6"),
    (lambda: Zstd(level=40), "level must be an int in 1..22"),
    (lambda: Zstd(match=""), "match must be a glob"),
    (lambda: cfdist.Checkpointer({"m": torch.nn.Linear(1, 1)}, "memory://x", codecs=["zstd"]), "codecs must be"),
    (lambda: cfdist.Checkpointer({"m": torch.nn.Linear(1, 1)}, "memory://x", codecs=[Zstd(), Zstd(level=5)]),
     "twice"),
])
def test_bad_codec_arguments_say_what_and_how(bad, msg):
    with pytest.raises((ValueError, TypeError), match=msg):
        bad()


CHAIN_CASES = [
    # committed steps, depends, keep, newest -> deleted
    ([10, 11, 12], {11: [10], 12: [10]}, 1, 12, [11]),                  # intermittent: keep the base
    ([10, 11, 12, 20], {11: [10], 12: [10]}, 1, 20, [10, 11, 12]),      # a new full frees the chain
    ([10, 11, 12], {11: [10], 12: [10, 11]}, 1, 12, []),                # consecutive: the whole chain
    ([10, 11, 12, 13], {11: [10], 12: [10, 11], 13: [12]}, 1, 13, [10, 11]),
]


@pytest.mark.parametrize("steps, deps, keep, newest, deleted", CHAIN_CASES)
def test_retention_keeps_what_a_kept_checkpoint_depends_on(steps, deps, keep, newest, deleted):
    assert choose_deletions([(s, False) for s in steps], keep=keep, keep_epoch_ends=False, newest=newest,
                            depends=deps) == deleted


def test_encoded_shards_stay_safetensors_files(url, tmp_path):
    from safetensors.torch import load_file

    u = f"file://{tmp_path}/r"
    persist(u, 1, {"emb": torch.zeros(100, 8), "b": torch.arange(3)}, [Zstd()])
    got = load_file(str(tmp_path / "r" / "step-000000001" / "shard-00000-of-00001.safetensors"))
    assert got["emb"].dtype == torch.uint8 and got["emb"].numel() < 3200 and torch.equal(got["b"], torch.arange(3))
    assert torch.equal(read(u, 1)["emb"], torch.zeros(100, 8))
    chain.forget(u)


def test_a_peer_bundle_carries_the_chain_of_an_increment(url):
    """What a rank broadcasts to ranks that lack a checkpoint (restore agreement) includes
    the steps its codec chain needs; forgetting the copy drops them all."""
    from cfdist.checkpoint import peer

    emb = torch.zeros(30, 4)
    for step in (1, 2, 3):
        emb[step] = step
        persist(url, step, {"emb": emb}, [Incremental(full_every=None, variant="consecutive")])
    got = peer._unbundle(peer._bundle(open_storages(url), 3), 3)
    assert discovery.committed_steps(got[0]) == [1, 2, 3]
    assert torch.equal(discovery.load_verified(got, 3)[1]["emb"], emb)
    peer.forget(got, 3)
    assert discovery.committed_steps(got[0]) == []
