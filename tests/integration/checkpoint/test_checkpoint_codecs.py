"""Checkpointer(codecs=[...]) on a DLRM-like model (two embedding tables with sparse updates and
an MLP, synthetic clicks) on real ``file://`` storage: bytes on disk per checkpoint, bit-exact
resume through a lossless chain, a lossy resume that trains on, chain breakage, the writer
process, and ``cfdist inspect``.

Real: the Checkpointer, its writer thread (and one writer process), files with fsync, restore.
Nothing is faked; the model is small so the file runs in seconds.
"""

from __future__ import annotations

import json
import pathlib
import warnings

import pytest
import torch

import cfdist
from bench.bench_codecs import DLRM, Clicks, TwoOptim, dlrm_state, train_steps   # the benchmark's workload
from cfdist.codecs import Incremental, LCDelta, LossyCheckpointWarning, Quantize, Zstd

ROWS, DIM = 20_000, 16
DATA = Clicks(2, ROWS, 64)


def make(seed=0):
    m = DLRM(2, ROWS, DIM, seed=seed)
    return m, TwoOptim(m)


def train(m, opt, ckpt, start, n):
    return train_steps(m, opt, DATA, ckpt, start, n)[-1]


def step_bytes(root: pathlib.Path) -> dict[int, int]:
    """Bytes of every file of every committed step directory, measured on disk."""
    return {int(d.name[5:]): sum(f.stat().st_size for f in d.iterdir()) for d in sorted(root.glob("step-*"))}


def run(tmp_path, name, codecs, steps=30, k=5, keep=100):
    root = tmp_path / name
    m, opt = make()
    ck = cfdist.Checkpointer(dlrm_state(m, opt), f"file://{root}", cfdist.Every(k), keep=keep, codecs=codecs)
    train(m, opt, ck, 0, steps)
    ck.close()
    return root, m, opt, ck.stats


def test_incremental_and_quantized_checkpoints_are_six_times_smaller_on_disk(tmp_path):
    """Check-N-Run's bound (6x less written) holds for increments, measured as file sizes."""
    sizes = {}
    for name, codecs in [("full", None), ("inc", [Incremental(full_every=10)]),
                         ("inc_q8", [Incremental(full_every=10), Quantize(bits=8, match="*embedding*")]),
                         ("inc_q4", [Incremental(full_every=10), Quantize(bits=4, match="*embedding*")])]:
        root, *_, stats = run(tmp_path, name, codecs)
        sizes[name] = step_bytes(root)
        assert stats["bytes_written"] < stats["bytes_logical"] or codecs is None
    full = sizes["full"][10]
    inc = {n: max(v[s] for s in v if s != 5) for n, v in sizes.items()}   # step 5 is each chain's full one
    assert inc["inc"] < full / 3
    assert inc["inc_q8"] < full / 6
    assert inc["inc_q4"] < inc["inc_q8"]


def test_a_lossless_chain_resumes_bit_exact(tmp_path):
    codecs = [Incremental(full_every=4, variant="consecutive"), Zstd(level=1)]
    root, m, opt, _ = run(tmp_path, "lossless", codecs, steps=20, k=2)
    m2, opt2 = make(seed=7)
    ck = cfdist.Checkpointer(dlrm_state(m2, opt2), f"file://{root}", cfdist.Every(2), codecs=codecs)
    with warnings.catch_warnings():
        warnings.simplefilter("error", LossyCheckpointWarning)
        assert ck.restore() == 20
    for a, b in zip(list(m.state_dict().values()) + _moments(opt), list(m2.state_dict().values()) + _moments(opt2)):
        assert torch.equal(a, b)
    ck.close()


def _moments(opt):
    return [t for o in (opt.sparse, opt.dense) for s in o.state_dict()["state"].values() for t in s.values()
            if isinstance(t, torch.Tensor) and t.dim() > 0]


def test_a_lossy_resume_warns_once_and_trains_to_the_uninterrupted_loss(tmp_path):
    """Quantized embedding tables (4 bits) restored at step 30: the loss at step 80 stays within
    0.05 of the uninterrupted run's (both are means over the last 10 steps)."""
    codecs = [Incremental(full_every=10), Quantize(bits=4, match="*embedding*")]
    root, m_ref, opt_ref, _ = run(tmp_path, "lossy", codecs, steps=30)
    at_30 = m_ref.embedding[0].weight.detach().clone()
    ref_losses = [train(m_ref, opt_ref, None, s, 1) for s in range(30, 80)]
    m, opt = make(seed=3)
    ck = cfdist.Checkpointer(dlrm_state(m, opt), f"file://{root}", cfdist.Every(5), codecs=codecs)
    with pytest.warns(LossyCheckpointWarning) as rec:
        assert ck.restore() == 30
    assert len([w for w in rec if issubclass(w.category, LossyCheckpointWarning)]) == 1
    w_err = (m.embedding[0].weight.detach() - at_30).abs().max()
    assert 0 < w_err < 0.05           # 4 bits over a row's range (about 0.6) / 2
    losses = [train(m, opt, ck, s, 1) for s in range(30, 80)]
    ck.close()
    assert abs(sum(losses[-10:]) / 10 - sum(ref_losses[-10:]) / 10) < 0.05


def test_a_corrupt_increment_falls_back_to_the_newest_whole_chain(tmp_path):
    codecs = [Incremental(full_every=None, variant="consecutive")]
    root, *_ = run(tmp_path, "chain", codecs, steps=25, k=5)
    shard = root / "step-000000015" / "shard-00000-of-00001.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-20] ^= 0xFF
    shard.write_bytes(bytes(raw))
    m, opt = make(seed=5)
    ck = cfdist.Checkpointer(dlrm_state(m, opt), f"file://{root}", cfdist.Every(5), codecs=codecs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ck.restore() == 10
    text = "\n".join(str(w.message) for w in caught)
    assert "step 25" in text and "needs step 15" in text and "steps from 15 to 25 of this chain are lost" in text
    assert "failed its checksum" in text
    ck.close()


def test_the_writer_process_encodes_and_stats_count_logical_and_written_bytes(tmp_path):
    codecs = [Incremental(full_every=3), LCDelta(bits=3, match="model/mlp*"), Zstd(level=1)]
    root = tmp_path / "proc"
    m, opt = make()
    ck = cfdist.Checkpointer(dlrm_state(m, opt), f"file://{root}", cfdist.Every(5), keep=1,
                             persist=cfdist.PersistOptions(backend="process"),
                             codecs=codecs)
    train(m, opt, ck, 0, 20)
    ck.close()
    st = ck.stats
    on_disk = step_bytes(root)
    assert st["checkpoints"] == 4 and st["bytes_written"] < st["bytes_logical"] / 2
    # 20 is a full Incremental one but the 3rd LCDelta link: retention (keep=1) kept its chain
    manifest = json.loads((root / "step-000000020" / "MANIFEST.json").read_text())
    assert [d[0] for d in manifest["depends_on"]] == [5, 10, 15] and sorted(on_disk) == [5, 10, 15, 20]
    with pytest.warns(LossyCheckpointWarning, match="lcdelta"):
        got = cfdist.load(f"file://{root}", step=20)["state"]["model"]
    assert torch.equal(got["embedding.0.weight"], m.embedding[0].weight.detach())
    assert (got["mlp.0.weight"] - m.mlp[0].weight.detach()).abs().max() < 1e-2


def test_inspect_decodes_an_encoded_checkpoint(tmp_path, capsys):
    from cfdist.cli import main

    root, *_ = run(tmp_path, "cli", [Incremental(full_every=10), Zstd()], steps=10, k=5)
    assert main(["inspect", f"file://{root}/step-000000010", "--verify", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["verified"] and out["depends_on"] == [5] and [c["name"] for c in out["codecs"]] == ["incremental", "zstd"]
    assert out["state"]["model"]["bytes"] == sum(p.numel() * 4 for p in make()[0].parameters())
    assert out["bytes_stored"] < out["bytes"] / 3
