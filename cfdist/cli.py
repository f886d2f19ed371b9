"""The ``cfdist`` command.

::

    cfdist fit run.yaml               # cfdist.fit from a YAML file (see `cfdist fit --help`)
    cfdist ls file:///mnt/ssd/cfdist/run1
    cfdist inspect file:///mnt/ssd/cfdist/run1/step-000001200   # or the run dir: newest step
    cfdist inspect file:///mnt/ssd/cfdist/run1 --diff 1100 1200  # what changed between two steps
    cfdist export file:///mnt/ssd/cfdist/run1 --format safetensors --out ./model   # for inference
    cfdist demo                       # the local demo (python -m cfdist.demo)
    cfdist bench                      # checkpoint benchmarks vs torch.save and DCP (--quick, --full)
    cfdist plan --iter-s 0.5 --steps 40000 --state-gb 20 --trace bamboo-p3-trace.csv   # dollars and hours

Subcommands live in :data:`SUBCOMMANDS`: ``name -> "module:function"``; the function receives
the ``argparse`` subparsers object and registers its parser with ``set_defaults(run=...)`` (or
``func=...``); either is called with the parsed arguments and returns the exit code. Add a
command by adding one entry; a command whose module cannot be imported is listed as unavailable.

What users type: a path without a scheme (``cfdist-runs/demo``) is resolved against the working
directory (:func:`local_url`); a mistake (a missing or wrong directory, a bad URL, a bad value)
is one line ``cfdist: error: <what, why, the fix>`` on stderr and exit status 2, never a
traceback (:func:`main` turns :func:`user_errors` into that line, for every subcommand).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

SUBCOMMANDS: dict[str, str] = {
    "fit": "cfdist.cli:_register_fit",
    "ls": "cfdist.cli:_register_ls",
    "inspect": "cfdist.cli:_register_inspect",
    "export": "cfdist.cli:_register_export",
    "demo": "cfdist.cli:_register_demo",
    "experiment": "cfdist.experiments.experiment:register",   # preemption experiments (cfdist/experiments)
    "bench": "cfdist.benchmarks.cli:register",             # benchmarks vs torch.save and DCP
    "plan": "cfdist.planner.cli:register",                 # cost of a run on spot machines (cfdist/planner)
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
    """``cfdist ARGS``: the exit status (0 ok, 1 nothing found, 2 a mistake in what was typed).

    Bad arguments exit 2 through argparse (usage and one error line); a user error raised by a
    subcommand (:func:`user_errors`) is printed as one line and returns 2; anything else (a bug)
    propagates with its traceback."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "passthrough", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    run = getattr(args, "run", None) or getattr(args, "func")
    try:
        return int(run(args) or 0)
    except Exception as e:  # noqa: BLE001 - only the user errors are caught; the rest re-raised
        if not isinstance(e, user_errors()):
            raise
        return _fail(one_line(e))


def _fail(msg: str) -> int:
    print(f"cfdist: error: {msg}", file=sys.stderr)
    return 2


class UsageError(ValueError):
    """A mistake in what the user typed (a missing directory, not a checkpoint directory): its
    message says what was given, why it does not fit and what to type instead."""


def user_errors() -> tuple[type, ...]:
    """Exceptions a user causes by what they type or point at: a bad value (``ValueError``, the
    configs' validation), storage that is missing or unreachable (``OSError``: ``StorageError``,
    ``StorageUnavailable``, ``FileNotFoundError``), a scheme whose package is missing
    (``ImportError``), a checkpoint that is not committed or is corrupt (``CheckpointError``), a
    YAML file that does not parse (when PyYAML is installed)."""
    from cfdist.checkpoint.format import CheckpointError

    out = [UsageError, ValueError, OSError, ImportError, CheckpointError]
    try:
        import yaml

        out.append(yaml.YAMLError)
    except ImportError:
        pass
    return tuple(out)


def one_line(e: BaseException) -> str:
    """``e``'s message on one line (a YAML error's location lines joined), with a redacted URL;
    an ``OSError`` without a message says its errno text and file."""
    from cfdist.storage.redact import redact

    if isinstance(e, OSError) and not isinstance(e, UsageError) and e.strerror and e.filename:
        text = f"{e.filename}: {e.strerror}"
    else:
        text = str(e) or type(e).__name__
    return redact(" ".join(part.strip() for part in text.splitlines() if part.strip()))


# ---- paths and URLs as typed -------------------------------------------------------------------------

def local_url(arg: str) -> str:
    """What the user typed as a storage URL: a path without a scheme (``cfdist-runs/demo``,
    ``~/runs/x``) becomes ``file://`` + its absolute path against the working directory; a URL
    (``file:///...``, ``s3://...``) is returned unchanged."""
    if "://" in arg:
        return arg
    return "file://" + os.path.abspath(os.path.expanduser(arg))


def _local_path(url: str) -> str | None:
    return url[len("file://"):] if url.startswith("file:///") else None


def checked_dir(arg: str, url: str) -> None:
    """Raise :class:`UsageError` when the local directory ``url`` (typed as ``arg``) is missing
    or a file; remote URLs are checked when they are read. Never creates anything."""
    path = _local_path(url)
    if path is None:
        return
    typed = "" if "://" in arg or arg.rstrip("/") == path.rstrip("/") else f" (from {arg!r})"
    if os.path.isfile(path):
        raise UsageError(f"{path}{typed} is a file, not a checkpoint directory: give the run directory "
                         f"(the storage= of the run) or one of its step-NNNNNNNNN directories")
    if not os.path.isdir(path):
        near = os.path.dirname(path.rstrip("/"))
        while near and not os.path.isdir(near):
            near = os.path.dirname(near)
        raise UsageError(f"{path}{typed} does not exist: give the directory the run wrote its checkpoints "
                         f"to (the storage= of the run; {near or '/'} exists)")


def _holds_checkpoints(path: str) -> bool:
    """Whether the local directory ``path`` was written by a Checkpointer (a step directory,
    committed or not, a rejected/ folder, the run's history or stripe identity)."""
    from cfdist.checkpoint.format import parse_step_dir

    try:
        names = os.listdir(path)
    except OSError:
        return False
    return any(parse_step_dir(n.split(".tmp-")[0]) is not None for n in names) or bool(
        {"rejected", "history.json", "STRIPE.json"} & set(names))


def not_a_checkpoint_dir(url: str) -> UsageError | None:
    """For a local ``url`` that holds no checkpoint: the error that says so and names the
    subdirectories that do hold checkpoints (a ``cfdist.fit`` run keeps one per node); None when
    it is a checkpoint directory (maybe with nothing committed yet) or not local."""
    path = _local_path(url)
    if path is None or _holds_checkpoints(path):
        return None
    subs = []
    for root, dirs, _ in os.walk(path):
        if root != path and _holds_checkpoints(root):
            subs.append(os.path.relpath(root, path))
            dirs[:] = []
        elif root.count(os.sep) - path.rstrip(os.sep).count(os.sep) >= 2:
            dirs[:] = []   # two levels down is enough: <run>/<node>/<tier>
        if len(subs) >= 4:
            break
    fix = (f"checkpoints are in its subdirectories {', '.join(sorted(subs))}: give one of them, e.g. "
           f"{os.path.join(path, sorted(subs)[0])}" if subs else
           "give the directory the run wrote its checkpoints to (the storage= of the run)")
    return UsageError(f"{path} is not a checkpoint directory (no step-NNNNNNNNN directories in it); {fix}")


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
  tiers: {shared_every: 5, memory_every: 1}          # optional: cfdist.TierOptions
  recovery: {min_nodes: 1}                           # optional: cfdist.RecoveryOptions
  output: {progress: true}                           # optional: cfdist.OutputOptions
  # any other cfdist.fit argument: cpus_per_worker, total_steps, ...
"""


def _register_fit(sub) -> None:
    p = sub.add_parser("fit", help="run cfdist.fit from a YAML config", epilog=FIT_EXAMPLE,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="YAML file")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a key (value parsed as YAML), e.g. --set num_nodes=1 or "
                        "--set tiers.shared_every=5")
    p.set_defaults(run=_run_fit)


def load_train_fn(spec: str):
    """``path/to/file.py:fn`` or ``package.module:fn`` -> the function (shipped to workers by value)."""
    import importlib.util

    import ray.cloudpickle

    if ":" not in spec:
        raise ValueError(f"train must be 'file.py:function' or 'module:function', got {spec!r}")
    where, fn = spec.rsplit(":", 1)
    if where.endswith(".py"):
        path = os.path.abspath(where)
        name = os.path.splitext(os.path.basename(path))[0]
        spec_ = importlib.util.spec_from_file_location(name, path)
        if spec_ is None or not os.path.isfile(path):
            raise UsageError(f"train file {path} does not exist (from {where!r}, relative to the working "
                             f"directory): give file.py:function or package.module:function")
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


def fit_options() -> set[str]:
    """The top-level keys a ``cfdist fit`` YAML file may hold besides ``train`` and
    ``train_args``: ``cfdist.fit``'s arguments (``tiers``, ``recovery``, ``output`` are
    mappings of their group's fields)."""
    import inspect

    from cfdist.api import fit

    return {n for n, p in inspect.signature(fit).parameters.items()
            if p.kind is p.KEYWORD_ONLY and n not in ("remove_node", "add_node")}


def fit_groups(cfg: dict, where: str) -> dict:
    """``cfg`` with its ``tiers``/``recovery``/``output`` mappings made into the groups' objects;
    a grouped setting written at the top level (``shared_every: 5``, the form before the groups)
    joins its group. UsageError naming the group's fields for an unknown one."""
    import dataclasses

    from cfdist.cluster.config import GROUP_OF, GROUPS

    cfg = dict(cfg)
    values: dict[str, dict] = {}
    for key in [k for k in cfg if k in GROUP_OF]:
        values.setdefault(GROUP_OF[key], {})[key] = cfg.pop(key)
    for group, cls in GROUPS.items():
        given = cfg.pop(group, None) or {}
        if not isinstance(given, dict):
            raise UsageError(f"{where}: {group} must be a mapping of its settings, e.g. {group}: {{...}}; got {given!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(given) - names)
        if unknown:
            raise UsageError(f"{where}: {group}: unknown key(s) {', '.join(map(repr, unknown))}; "
                             f"its keys are {', '.join(sorted(names))}")
        both = sorted(set(given) & set(values.get(group, {})))
        if both:
            raise UsageError(f"{where}: {', '.join(both)} given both at the top level and under {group}: keep one")
        merged = {**values.get(group, {}), **given}
        if merged:
            cfg[group] = cls(**merged)
    return cfg


_POLICY_FORMS = "auto, every:K, epoch, {every: K} or {auto: {max_overhead: 0.03}}"


def parse_policy(value):
    """A policy as written in a ``cfdist fit`` YAML file (:data:`_POLICY_FORMS`); ``ValueError``
    naming the forms for anything else."""
    import cfdist

    if value is None or value == "auto":
        return cfdist.Auto()
    if value == "epoch":
        return cfdist.EveryEpoch()
    if isinstance(value, str) and value.startswith("every:") and value[6:].strip().isdigit():
        return cfdist.Every(int(value[6:]))
    if isinstance(value, dict) and len(value) == 1:
        (kind, kw), = value.items()
        try:
            if kind == "auto" and isinstance(kw, (dict, type(None))):
                return cfdist.Auto(**(kw or {}))
            if kind == "every":
                return cfdist.Every(**kw) if isinstance(kw, dict) else cfdist.Every(int(kw))
        except (TypeError, ValueError) as e:   # an unknown, missing or bad argument
            raise ValueError(f"policy {value!r}: {e}; write it as {_POLICY_FORMS}") from None
    raise ValueError(f"policy must be {_POLICY_FORMS}, got {value!r}")


def parse_preemption(value):
    if value is None:
        return None
    from cfdist import chaos

    classes = {"fixed_interval": chaos.FixedInterval, "exponential": chaos.Exponential, "weibull": chaos.Weibull}
    if not (isinstance(value, dict) and len(value) == 1 and next(iter(value)) in classes):
        raise ValueError(f"preemption must be one of {sorted(classes)} with its arguments, e.g. "
                         f"{{fixed_interval: {{every_s: 600, kind: crash}}}}; got {value!r}")
    (kind, kw), = value.items()
    try:
        return classes[kind](**(kw or {}))
    except TypeError as e:   # an unknown or missing argument
        raise ValueError(f"preemption {value!r}: {e}; e.g. {{fixed_interval: {{every_s: 600, kind: crash}}}}") from None


def _run_fit(a) -> int:
    import functools

    import yaml

    from cfdist.api import fit

    if not os.path.isfile(a.config):
        raise UsageError(f"config file {os.path.abspath(a.config)} does not exist: give a YAML file "
                         f"(`cfdist fit --help` shows an example)")
    with open(a.config) as f:
        cfg = yaml.safe_load(f) or {}
    if not isinstance(cfg, dict):
        raise UsageError(f"{a.config} must be a YAML mapping (key: value lines), not a {type(cfg).__name__}; "
                         f"`cfdist fit --help` shows an example")
    for kv in a.set:
        k, eq, v = kv.partition("=")
        if not (k and eq):
            raise UsageError(f"--set {kv!r} must be KEY=VALUE, e.g. --set num_nodes=1")
        group, dot, field = k.partition(".")
        if dot:   # --set tiers.shared_every=5
            if not isinstance(cfg.setdefault(group, {}), dict):
                raise UsageError(f"--set {kv!r}: {group} is not a mapping in {a.config}")
            cfg[group][field] = yaml.safe_load(v)
        else:
            cfg[k] = yaml.safe_load(v)
    if "train" not in cfg or "storage" not in cfg:
        return _fail(f"{a.config} needs at least 'train' and 'storage'\n\n{FIT_EXAMPLE}")
    for key in ("storage", "shared_storage"):   # paths in the file are relative to the working directory
        if isinstance(cfg.get(key), str):
            cfg[key] = local_url(cfg[key])
        elif isinstance(cfg.get(key), list):
            cfg[key] = [local_url(u) if isinstance(u, str) else u for u in cfg[key]]
    cfg = fit_groups(cfg, a.config)
    unknown = sorted(set(cfg) - {"train", "train_args"} - fit_options())
    if unknown:
        raise UsageError(f"{a.config}: unknown key(s) {', '.join(map(repr, unknown))}; the keys are the "
                         f"arguments of cfdist.fit: {', '.join(sorted(fit_options()))}")
    policy = parse_policy(cfg.pop("policy", None))
    preemption = parse_preemption(cfg.pop("preemption", None))
    train_args = cfg.pop("train_args", None) or {}
    try:   # last: importing the training file runs the user's code
        fn = load_train_fn(cfg.pop("train"))
    except AttributeError as e:
        raise UsageError(f"{a.config}: train: {e}") from None
    result = fit(functools.partial(fn, **train_args) if train_args else fn, policy=policy,
                 preemption=preemption, **cfg)
    from rich.console import Console

    from cfdist.demo import summary_table

    Console().print(summary_table(result, title=f"cfdist fit {a.config}"))
    return 0


# ---- ls / inspect ----------------------------------------------------------------------------------

def _register_ls(sub) -> None:
    p = sub.add_parser("ls", help="list the committed checkpoints of a storage URL")
    p.add_argument("storage", help="a run directory: a path (relative to the working directory) or a URL "
                                   "(file:///..., s3://...)")
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

    url = local_url(a.storage)
    checked_dir(a.storage, url)
    rows = list_checkpoints(url, include_rejected=a.all)
    if not rows and (err := not_a_checkpoint_dir(url)) is not None:
        raise err
    if a.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    if not rows:
        print(f"no committed checkpoint in {redact_url(url)}")
        return 1
    t = Table(title=redact_url(url))
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


def checkpoint_arg(arg: str) -> tuple[str, int | None]:
    """A typed step or run directory -> ``(run directory URL, step or None)``; a local run
    directory must exist (:class:`UsageError` otherwise)."""
    root, step = split_checkpoint_url(local_url(arg))
    checked_dir(arg, root)
    return root, step


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

    root, step = checkpoint_arg(a.checkpoint)
    sts = open_storages(root)
    if step is None:
        steps = committed_steps(sts[0])
        if not steps:
            raise not_a_checkpoint_dir(root) or UsageError(
                f"no committed checkpoint in {sts[0].url} yet: `cfdist ls {a.checkpoint} --all` shows what is there")
        step = steps[-1]
    try:
        summary = summarize_manifest(read_manifest(sts, step))
        if a.verify:
            load(root, step, verify=True)
            summary["verified"] = True
    except CheckpointError as e:
        return _fail(f"{one_line(e)} (`cfdist ls {root}` lists the committed steps)")
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
            raise UsageError(f"step {spec} is a number: give the run directory too, e.g. "
                             f"cfdist inspect ./path/run --diff {spec} ...")
        return checkpoint_arg(run)[0], int(spec)
    return checkpoint_arg(spec)


def _load_or_fail(root: str, step: int | None):
    from cfdist.checkpoint import CheckpointError
    from cfdist.checkpoint.discovery import load

    try:
        return load(root, step)
    except CheckpointError as exc:
        e = exc
        if step is None and (bad := not_a_checkpoint_dir(root)) is not None:
            e = bad
        _fail(f"{one_line(e)}" + ("" if isinstance(e, UsageError) else f" (`cfdist ls {root}` lists the "
                                                                          f"committed steps)"))
        return None


def _run_diff(a) -> int:
    from rich.console import Console
    from rich.table import Table

    from cfdist.checkpoint.compare import diff_checkpoints

    (ra, sa), (rb, sb) = (resolve_step(x, a.checkpoint) for x in a.diff)
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

    root, step = checkpoint_arg(a.checkpoint)
    loaded = _load_or_fail(root, step)
    if loaded is None:
        return 2
    try:
        key, tensors = export_tensors(loaded, a.key, strip_prefixes=tuple(a.strip_prefix or ()))
    except ValueError as e:
        return _fail(str(e))
    path = save_export(tensors, os.path.abspath(a.out), a.format, {"cfdist_step": loaded["step"], "cfdist_key": key,
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
