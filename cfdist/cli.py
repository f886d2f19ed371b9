"""The ``cfdist`` command.

::

    cfdist fit run.yaml               # cfdist.fit from a YAML file (see `cfdist fit --help`)
    cfdist ls file:///mnt/ssd/cfdist/run1
    cfdist inspect file:///mnt/ssd/cfdist/run1/step-000001200   # or the run dir: newest step
    cfdist inspect file:///mnt/ssd/cfdist/run1 --diff 1100 1200  # what changed between two steps
    cfdist export file:///mnt/ssd/cfdist/run1 --format safetensors --out ./model   # for inference
    cfdist demo                       # the local demo (python -m cfdist.demo)
    cfdist bench                      # checkpoint benchmarks vs torch.save and DCP (--quick, --full)

Subcommands live in :data:`SUBCOMMANDS`: ``name -> "module:function"``; the function receives
the ``argparse`` subparsers object and registers its parser with ``set_defaults(run=...)`` (or
``func=...``); either is called with the parsed arguments and returns the exit code. Add a
command by adding one entry; a command whose module cannot be imported is listed as unavailable.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

SUBCOMMANDS: dict[str, str] = {
    "fit": "cfdist.cli:_register_fit",
    "ls": "cfdist.cli:_register_ls",
    "inspect": "cfdist.cli:_register_inspect",
    "export": "cfdist.cli:_register_export",
    "demo": "cfdist.cli:_register_demo",
    "experiment": "cfdist.experiments.experiment:register",   # preemption experiments (cfdist/experiments)
    "bench": "cfdist.benchmarks.cli:register",             # benchmarks vs torch.save and DCP
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cfdist", description="Preemption-tolerant PyTorch training with "
                                "iteration-level checkpoints.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, target in SUBCOMMANDS.items():
        mod, fn = target.split(":")
        try:
            getattr(importlib.import_module(mod), fn)(sub)
        except Exception as e:  # noqa: BLE001 - a broken or optional command must not break the others
            q = sub.add_parser(name, help=f"(unavailable: {e})")
            q.set_defaults(run=lambda a, e=e: _fail(f"cfdist {a.command} is unavailable: {e}"))
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "passthrough", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    run = getattr(args, "run", None) or getattr(args, "func")
    return int(run(args) or 0)


def _fail(msg: str) -> int:
    print(f"cfdist: error: {msg}", file=sys.stderr)
    return 2


# ---- fit -----------------------------------------------------------------------------------------

FIT_EXAMPLE = """\
example run.yaml:

  train: launch/train_small.py:train_loop   # file.py:function or package.module:function
  train_args: {steps: 200}                  # keyword arguments of the training function
  num_nodes: 2
  workers_per_node: 1
  storage: file:///mnt/local-ssd/cfdist
  shared_storage: s3://my-bucket/runs       # optional
  run_name: shapes
  policy: every:20                          # auto | every:K | epoch | {auto: {max_overhead: 0.03}}
  max_failures: 10
  preemption: {fixed_interval: {every_s: 600, kind: crash}}   # optional (cfdist.chaos)
  # any other cfdist.fit / FitConfig option: min_nodes, shared_every, cpus_per_worker, ...
"""


def _register_fit(sub) -> None:
    p = sub.add_parser("fit", help="run cfdist.fit from a YAML config", epilog=FIT_EXAMPLE,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="YAML file")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a top-level key (value parsed as YAML), e.g. --set num_nodes=1")
    p.set_defaults(run=_run_fit)


def load_train_fn(spec: str):
    """``path/to/file.py:fn`` or ``package.module:fn`` -> the function (shipped to workers by value)."""
    import importlib.util
    import os

    import ray.cloudpickle

    if ":" not in spec:
        raise ValueError(f"train must be 'file.py:function' or 'module:function', got {spec!r}")
    where, fn = spec.rsplit(":", 1)
    if where.endswith(".py"):
        path = os.path.abspath(where)
        name = os.path.splitext(os.path.basename(path))[0]
        spec_ = importlib.util.spec_from_file_location(name, path)
        if spec_ is None:
            raise FileNotFoundError(f"train file {path} not found")
        mod = importlib.util.module_from_spec(spec_)
        sys.modules[name] = mod
        spec_.loader.exec_module(mod)
    else:
        mod = importlib.import_module(where)
    ray.cloudpickle.register_pickle_by_value(mod)   # workers need not have the file
    try:
        return getattr(mod, fn)
    except AttributeError:
        raise AttributeError(f"{where} has no function {fn!r}") from None


def parse_policy(value):
    import cfdist

    if value is None or value == "auto":
        return cfdist.Auto()
    if isinstance(value, str) and value.startswith("every:"):
        return cfdist.Every(int(value.split(":", 1)[1]))
    if value == "epoch":
        return cfdist.EveryEpoch()
    if isinstance(value, dict) and len(value) == 1:
        (kind, kw), = value.items()
        if kind == "auto":
            return cfdist.Auto(**(kw or {}))
        if kind == "every":
            return cfdist.Every(**kw) if isinstance(kw, dict) else cfdist.Every(int(kw))
    raise ValueError(f"policy must be auto, every:K, epoch or {{auto: {{...}}}}, got {value!r}")


def parse_preemption(value):
    if value is None:
        return None
    from cfdist import chaos

    classes = {"fixed_interval": chaos.FixedInterval, "exponential": chaos.Exponential, "weibull": chaos.Weibull}
    if not (isinstance(value, dict) and len(value) == 1 and next(iter(value)) in classes):
        raise ValueError(f"preemption must be one of {sorted(classes)} with its arguments, e.g. "
                         f"{{fixed_interval: {{every_s: 600, kind: crash}}}}; got {value!r}")
    (kind, kw), = value.items()
    return classes[kind](**kw)


def _run_fit(a) -> int:
    import functools

    import yaml

    from cfdist.api import fit

    with open(a.config) as f:
        cfg = yaml.safe_load(f) or {}
    for kv in a.set:
        k, _, v = kv.partition("=")
        cfg[k] = yaml.safe_load(v)
    if "train" not in cfg or "storage" not in cfg:
        return _fail(f"{a.config} needs at least 'train' and 'storage'\n\n{FIT_EXAMPLE}")
    fn = load_train_fn(cfg.pop("train"))
    train_args = cfg.pop("train_args", None) or {}
    policy = parse_policy(cfg.pop("policy", None))
    preemption = parse_preemption(cfg.pop("preemption", None))
    result = fit(functools.partial(fn, **train_args) if train_args else fn, policy=policy,
                 preemption=preemption, **cfg)
    from rich.console import Console

    from cfdist.demo import summary_table

    Console().print(summary_table(result, title=f"cfdist fit {a.config}"))
    return 0


# ---- ls / inspect ----------------------------------------------------------------------------------

def _register_ls(sub) -> None:
    p = sub.add_parser("ls", help="list the committed checkpoints of a storage URL")
    p.add_argument("storage", help="URL of a run directory (file://..., s3://...)")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument("--all", action="store_true", help="also the checkpoints moved aside under rejected/ "
                   "(a run rolled back past them); cfdist.load(url, step=N) still reads them")
    p.set_defaults(run=_run_ls)


def _run_ls(a) -> int:
    import time

    from rich.console import Console
    from rich.table import Table

    from cfdist.checkpoint import list_checkpoints
    from cfdist.storage.redact import redact_url

    rows = list_checkpoints(a.storage, include_rejected=a.all)
    if a.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    if not rows:
        print(f"no committed checkpoint in {redact_url(a.storage)}")
        return 1
    t = Table(title=redact_url(a.storage))
    for col in ("step", "epoch", "epoch end", "committed", "bytes", "url") + (("moved aside because",) if a.all else ()):
        t.add_column(col)
    for r in rows:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["time"])) if r.get("time") else "-"
        why = (r["rejected"].get("why") or "?") if "rejected" in r else ""
        t.add_row(str(r["step"]), str(r["epoch"]), "yes" if r["epoch_end"] else "", when,
                  f"{r['bytes']:,}" if r.get("bytes") is not None else "-", r["url"], *((why,) if a.all else ()))
    Console().print(t)
    return 0


def _register_inspect(sub) -> None:
    p = sub.add_parser("inspect", help="show what a checkpoint holds (and verify its checksums)")
    p.add_argument("checkpoint", nargs="?", help="URL of a step directory (.../step-000001200) or of a run "
                                                 "directory (its newest step)")
    p.add_argument("--verify", action="store_true", help="read every tensor and check its xxh3")
    p.add_argument("--diff", nargs=2, metavar=("STEP_A", "STEP_B"),
                   help="compare two checkpoints: step directory URLs, or step numbers in the run "
                        "directory given as CHECKPOINT")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=_run_inspect)


def split_checkpoint_url(url: str) -> tuple[str, int | None]:
    """``.../step-000001200`` -> (``...``, 1200); a run directory -> (url, None)."""
    from cfdist.checkpoint.format import parse_step_dir

    base, _, last = url.rstrip("/").rpartition("/")
    step = parse_step_dir(last)
    return (base, step) if step is not None else (url.rstrip("/"), None)


def logical_nbytes(t: dict) -> int:
    """A manifest tensor entry's size before codecs."""
    import math

    from cfdist.checkpoint.format import ST_TO_TORCH

    lg = t.get("logical")
    return math.prod(lg["shape"]) * ST_TO_TORCH[lg["dtype"]].itemsize if lg else t["nbytes"]


def summarize_manifest(m: dict) -> dict:
    """A short, JSON-able summary of a manifest: sizes per state entry, the small state."""
    per_key: dict[str, list[int]] = {}
    later_pieces = {p[0] for sp in (m.get("split") or {}).values() for p in sp["pieces"][1:]}
    for name, t in m["tensors"].items():
        key = name.split("/", 1)[0]
        c = per_key.setdefault(key, [0, 0])
        c[0] += name not in later_pieces   # a tensor split between writers counts once
        c[1] += logical_nbytes(t)
    skeleton = m.get("skeleton", {})
    late = m.get("late", {})
    return {
        "step": m["step"], "epoch": m.get("epoch"), "epoch_end": m.get("epoch_end"),
        "world_size": m.get("world_size"), "bytes": m.get("bytes"), "format": m.get("format"),
        "state": {k: {"tensors": per_key.get(k, [0, 0])[0], "bytes": per_key.get(k, [0, 0])[1]}
                  for k in sorted(set(skeleton) | set(late) | set(per_key)) if not k.startswith("_")},
        "shards": [s["file"] for s in m["shards"]],
        "writers": (m.get("slicing") or {}).get("writers", 1),
        "codecs": m.get("codecs", []), "bytes_stored": m.get("bytes_stored"),
        "depends_on": [d[0] for d in m.get("depends_on", [])],
    }


def _run_inspect(a) -> int:
    if a.diff:
        return _run_diff(a)
    if a.checkpoint is None:
        return _fail("inspect needs a CHECKPOINT URL (a step or run directory), or --diff STEP_A STEP_B")
    from rich.console import Console
    from rich.table import Table

    from cfdist.checkpoint import CheckpointError
    from cfdist.checkpoint.discovery import committed_steps, load, read_manifest
    from cfdist.storage import open_storages

    root, step = split_checkpoint_url(a.checkpoint)
    sts = open_storages(root)
    if step is None:
        steps = committed_steps(sts[0])
        if not steps:
            return _fail(f"no committed checkpoint in {sts[0].url}")
        step = steps[-1]
    try:
        summary = summarize_manifest(read_manifest(sts, step))
        if a.verify:
            load(root, step, verify=True)
            summary["verified"] = True
    except CheckpointError as e:
        return _fail(str(e))
    if a.json:
        print(json.dumps(summary))
        return 0
    t = Table(title=f"{sts[0].url}/step-{step:09d}")
    t.add_column("state entry")
    t.add_column("tensors", justify="right")
    t.add_column("bytes", justify="right")
    for k, v in summary["state"].items():
        t.add_row(k, str(v["tensors"]), f"{v['bytes']:,}")
    con = Console()
    con.print(f"step {summary['step']}, epoch {summary['epoch']}{' (end)' if summary['epoch_end'] else ''}, "
              f"world size {summary['world_size']}, {summary['bytes']:,} bytes in {len(summary['shards'])} "
              f"shard(s), format {summary['format']}" + (", checksums OK" if summary.get("verified") else ""))
    if summary["codecs"]:
        con.print(f"codecs {', '.join(c['name'] for c in summary['codecs'])}: {summary['bytes_stored']:,} bytes "
                  f"stored" + (f", needs steps {summary['depends_on']}" if summary["depends_on"] else ""))
    con.print(t)
    return 0


def resolve_step(spec: str, run: str | None) -> tuple[str, int | None]:
    """A step given as a step-directory URL, or as a number inside the run directory ``run``."""
    if spec.isdigit():
        if run is None:
            raise ValueError(f"step {spec} is a number: give the run directory too, e.g. "
                             f"cfdist inspect file:///path/run --diff {spec} ...")
        return split_checkpoint_url(run)[0], int(spec)
    return split_checkpoint_url(spec)


def _load_or_fail(root: str, step: int | None):
    from cfdist.checkpoint import CheckpointError
    from cfdist.checkpoint.discovery import load

    try:
        return load(root, step)
    except CheckpointError as e:
        print(f"cfdist: error: {e}", file=sys.stderr)
        return None


def _run_diff(a) -> int:
    from rich.console import Console
    from rich.table import Table

    from cfdist.checkpoint.compare import diff_checkpoints

    try:
        (ra, sa), (rb, sb) = (resolve_step(x, a.checkpoint) for x in a.diff)
    except ValueError as e:
        return _fail(str(e))
    la, lb = _load_or_fail(ra, sa), _load_or_fail(rb, sb)
    if la is None or lb is None:
        return 2
    d = diff_checkpoints(la, lb)
    if a.json:
        print(json.dumps(d))
        return 0
    con, t = Console(), d["tensors"]
    con.print(f"step {d['step_a']} ({ra}) vs step {d['step_b']} ({rb}): {len(t['changed'])} tensor(s) "
              f"differ, {t['equal']} equal, {len(t['only_a'])} only in A, {len(t['only_b'])} only in B, "
              f"{len(d['values'])} small value(s) differ")
    if t["changed"]:
        tab = Table(title="tensors that differ")
        for col in ("tensor", "shape", "dtype", "elements differing", "max |a-b|"):
            tab.add_column(col, overflow="fold")    # full tensor names, wrapped on narrow terminals
        for c in t["changed"]:
            if "shape_a" in c:
                tab.add_row(c["name"], f"{c['shape_a']} -> {c['shape_b']}", f"{c['dtype_a']} -> {c['dtype_b']}", "-", "-")
            else:
                mx = "-" if c["max_abs_diff"] is None else f"{c['max_abs_diff']:.6g}"
                tab.add_row(c["name"], str(c["shape"]), c["dtype"], str(c["n_diff"]), mx)
        con.print(tab)
    for side in ("only_a", "only_b"):
        if t[side]:
            con.print(f"only in {side[-1].upper()}: " + ", ".join(t[side]))
    if d["values"]:
        tab = Table(title="small state that differs")
        for col in ("value", "A", "B"):
            tab.add_column(col)
        for v in d["values"]:
            tab.add_row(v["path"], str(v["a"]), str(v["b"]))
        con.print(tab)
    return 0


# ---- export ----------------------------------------------------------------------------------------

def _register_export(sub) -> None:
    p = sub.add_parser("export", help="write one state entry (the model) as safetensors or a torch file, "
                                      "readable without cfdist")
    p.add_argument("checkpoint", help="URL of a step directory (.../step-000001200) or of a run "
                                      "directory (its newest step that verifies)")
    p.add_argument("--format", choices=("safetensors", "torch"), default="safetensors",
                   help="safetensors: DIR/model.safetensors (safetensors.torch.load_file, Hugging Face); "
                        "torch: DIR/model.pt (torch.load(path, weights_only=True))")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory (created)")
    p.add_argument("--key", default=None, help="state entry to export (default: 'model', or the only "
                                               "entry with tensors)")
    p.add_argument("--strip-prefix", action="append", default=None, metavar="PREFIX", nargs="?",
                   const="module.", help="remove PREFIX from tensor names (default PREFIX: DDP's "
                                         "'module.'; repeat for several, e.g. _orig_mod.)")
    p.set_defaults(run=_run_export)


def _run_export(a) -> int:
    from cfdist.checkpoint.compare import export_tensors, save_export

    root, step = split_checkpoint_url(a.checkpoint)
    loaded = _load_or_fail(root, step)
    if loaded is None:
        return 2
    try:
        key, tensors = export_tensors(loaded, a.key, strip_prefixes=tuple(a.strip_prefix or ()))
    except ValueError as e:
        return _fail(str(e))
    path = save_export(tensors, a.out, a.format, {"cfdist_step": loaded["step"], "cfdist_key": key,
                                                  "cfdist_source": root})
    n = sum(t.numel() * t.element_size() for t in tensors.values())
    print(f"exported {key!r} of step {loaded['step']}: {len(tensors)} tensors, {n:,} bytes -> {path}")
    return 0


# ---- demo ------------------------------------------------------------------------------------------

def _register_demo(sub) -> None:
    p = sub.add_parser("demo", help="local cfdist.fit with simulated worker kills (python -m cfdist.demo)",
                       add_help=False)
    p.set_defaults(passthrough=True, run=lambda a: __import__("cfdist.demo", fromlist=["main"]).main(a.extra))


if __name__ == "__main__":
    sys.exit(main())
