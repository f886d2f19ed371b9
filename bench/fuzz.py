"""Fuzz the untrusted-checkpoint parsers for millions of cases (the CI property tests run thousands).

    nice -n 19 python bench/fuzz.py --seconds 600            # random mutations, all targets
    python bench/fuzz.py --engine hypothesis --cases 200000  # the CI strategies, longer
    python bench/fuzz.py --seconds 60 --mem-gb 2 --out /tmp/fuzz-crashes

Targets (``tests/fuzz_targets.py``, shared with ``tests/unit/checkpoint/test_checkpoint_fuzz.py``):
a forged MANIFEST.json (raw bytes, or a valid manifest with values replaced and re-sealed), a
forged shard (mutated bytes, or a header with arbitrary dtype/shape/offsets). Each case must end
in a result no larger than the file, or a ``CheckpointError``; anything else is a finding, saved
under ``--out`` with its input. The address space is capped (``--mem-gb`` above the start), so a
size field trusted before it is checked shows up as a MemoryError finding, not a swapping machine.
Prints the cases run per target, the rate and the findings.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import struct
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests import fuzz_targets as ft  # noqa: E402

SCALARS = [None, True, False, 0, 1, -1, 3, 2 ** 31, 2 ** 63 - 1, 2 ** 63, 2 ** 64, -2 ** 63, 10 ** 30, 0.5, -1e308,
           "", "F32", "I64", "BOOL", "PICKLE", "../x", "/etc/passwd", ft.SHARD, "__t__", "__small__", "x" * 100]


def rand_json(r: random.Random, depth: int = 0):
    k = r.random()
    if depth > 4 or k < 0.55:
        return r.choice(SCALARS) if r.random() < 0.8 else r.randint(-2 ** 70, 2 ** 70)
    if k < 0.75:
        return [rand_json(r, depth + 1) for _ in range(r.randint(0, 4))]
    if k < 0.97:
        return {r.choice(["a", "shape", "dtype", "file", "root", "__t__", "step", "tensors"]): rand_json(r, depth + 1)
                for _ in range(r.randint(0, 4))}
    d = r.randint(1, 3000)   # deep nesting, as a string spliced in later
    return json.loads("[" * min(d, 500) + "]" * min(d, 500))


def mutate_bytes(r: random.Random, b: bytes) -> bytes:
    b = bytearray(b)
    for _ in range(r.randint(1, 4)):
        k = r.random()
        if k < 0.4 and b:
            b[r.randrange(len(b))] ^= r.randint(1, 255)
        elif k < 0.55:
            b = b[:r.randint(0, len(b))]
        elif k < 0.75:
            i = r.randint(0, len(b))
            b[i:i] = os.urandom(r.randint(1, 16))
        elif k < 0.9 and len(b) >= 8:
            b[:8] = struct.pack("<Q", r.choice([0, 1, 7, len(b), 2 ** 31, 2 ** 63, 2 ** 64 - 1, 100 << 20, r.randrange(2 ** 64)]))
        else:
            i = r.randint(0, len(b))
            d = r.randint(1, 100_000)
            b[i:i] = b"[" * d + b"]" * d
    return bytes(b)


def mutate_manifest(r: random.Random) -> dict:
    m, _ = ft.valid_checkpoint()
    for _ in range(r.randint(1, 3)):
        node, key = m, None
        for _ in range(r.randint(1, 5)):
            keys = sorted(node) if isinstance(node, dict) else list(range(len(node)))
            if not keys:
                break
            key = r.choice(keys)
            child = node[key]
            if not isinstance(child, (dict, list)) or not child or r.random() < 0.3:
                break
            node, key = child, None
        if key is not None and key != ft.SEAL:
            node[key] = rand_json(r)
    return m


def forge_header(r: random.Random) -> tuple[dict, bytes]:
    from cfdist.checkpoint.format import _nbytes

    hdr = {}
    for i in range(r.randint(0, 3)):
        e = {"dtype": r.choice(["F32", "I64", "BOOL", "U8", "F16", "C64", "X", 3]),
             "shape": [r.choice([0, 1, 2, 3, 2 ** 31, 2 ** 62, -1]) for _ in range(r.randint(0, 3))]
             if r.random() < 0.8 else rand_json(r),
             "data_offsets": [r.choice([0, 4, 8, 2 ** 63, -1]), r.choice([0, 8, 16, 2 ** 64])]}
        if r.random() < 0.5:
            try:
                a = r.randint(0, 64)
                e["data_offsets"] = [a, a + _nbytes(e["dtype"], e["shape"])]
            except Exception:  # noqa: BLE001 - unusable dtype/shape: keep the forged offsets
                pass
        hdr[f"model/t{i}"] = e
    if r.random() < 0.3:
        hdr["__metadata__"] = rand_json(r)
    return hdr, os.urandom(r.randint(0, 128))


def random_cases(r: random.Random):
    _, shard = ft.valid_checkpoint()
    sealed = ft.seal_manifest(ft.valid_checkpoint()[0])
    yield "manifest_bytes", lambda: ft.manifest_bytes(mutate_bytes(r, sealed) if r.random() < 0.9 else os.urandom(r.randint(0, 64)))
    yield "manifest_object", lambda: ft.manifest_object(mutate_manifest(r), seal=r.random() < 0.9)
    yield "shard_bytes", lambda: ft.shard_bytes(mutate_bytes(r, shard))
    yield "header_object", lambda: ft.header_object(*forge_header(r), sync_manifest=r.random() < 0.7)


def run_random(args, counts, findings):
    r = random.Random(args.seed)
    targets = list(random_cases(r))
    deadline = time.monotonic() + args.seconds if args.seconds else None
    i = 0
    while (deadline is None or time.monotonic() < deadline) and (args.cases is None or i < args.cases):
        name, fn = targets[i % len(targets)]
        state = r.getstate()
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - every non-CheckpointError is a finding
            findings.append((name, i, e, traceback.format_exc(), state))
        counts[name] = counts.get(name, 0) + 1
        i += 1


def run_hypothesis(args, counts, findings):
    from hypothesis import HealthCheck, given, settings, strategies as st

    per = max(1, (args.cases or 100_000) // 4)
    conf = settings(max_examples=per, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck))

    def count(name):
        counts[name] = counts.get(name, 0) + 1

    @given(ft.MANIFEST_BYTES)
    def manifest_bytes(raw):
        count("manifest_bytes")
        ft.manifest_bytes(raw)

    @given(ft.mutated_manifest(), st.booleans())
    def manifest_object(m, seal):
        count("manifest_object")
        ft.manifest_object(m, seal=seal)

    @given(ft.SHARD_BYTES)
    def shard_bytes(shard):
        count("shard_bytes")
        ft.shard_bytes(shard)

    @given(ft.forged_header(), st.booleans())
    def header_object(hdr, sync):
        count("header_object")
        ft.header_object(*hdr, sync_manifest=sync)

    tests = [(f.__name__, f) for f in (manifest_bytes, manifest_object, shard_bytes, header_object)]
    for name, t in tests:
        try:
            conf(t)()
        except Exception as e:  # noqa: BLE001 - hypothesis re-raises the minimal failing case
            findings.append((name, -1, e, traceback.format_exc(), None))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=["random", "hypothesis"], default="random")
    p.add_argument("--seconds", type=float, default=None, help="stop after this long (random engine)")
    p.add_argument("--cases", type=int, default=None, help="stop after this many cases")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mem-gb", type=float, default=2.0, help="address space allowed above the start")
    p.add_argument("--out", default=None, help="directory for findings (default: print only)")
    args = p.parse_args(argv)
    if args.seconds is None and args.cases is None:
        args.seconds = 60.0
    with open("/proc/self/statm") as f:
        vm = int(f.read().split()[0]) * resource.getpagesize()
    cap = vm + int(args.mem_gb * (1 << 30))
    resource.setrlimit(resource.RLIMIT_AS, (cap, resource.getrlimit(resource.RLIMIT_AS)[1]))
    counts: dict[str, int] = {}
    findings: list = []
    t0 = time.monotonic()
    (run_random if args.engine == "random" else run_hypothesis)(args, counts, findings)
    dt = time.monotonic() - t0
    total = sum(counts.values())
    print(f"fuzz ({args.engine}, seed {args.seed}): {total:,} cases in {dt:.0f}s ({total / max(dt, 1e-9):,.0f}/s), "
          f"address space capped at {cap / (1 << 30):.1f} GiB")
    for name, n in sorted(counts.items()):
        print(f"  {name:16s} {n:>12,}")
    print(f"findings: {len(findings)}")
    for name, i, e, tb, _state in findings[:20]:
        print(f"--- {name} case {i}: {type(e).__name__}: {str(e)[:300]}\n{tb[-2000:]}")
    if args.out and findings:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "findings.txt"), "w") as f:
            for name, i, e, tb, state in findings:
                f.write(f"--- {name} case {i} (seed {args.seed}): {type(e).__name__}: {e}\n{tb}\n")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
