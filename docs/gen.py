"""The generated sections of the documentation, rewritten from the code so they cannot drift.

::

    python docs/gen.py            # rewrite every generated section in docs/*.md
    python docs/gen.py --check    # exit 1 and name the stale sections (tests/docs runs this check)

Two sections are generated, each between its ``<!-- NAME:begin -->`` / ``<!-- NAME:end -->``
markers:

* ``docs/configuration.md``: every parameter of ``cfdist.Checkpointer``, ``cfdist.fit`` (its
  ``FitConfig`` fields included), ``cfdist.Auto`` and ``RetryPolicy``, once, with its default
  (from the signature or the dataclass field), its docstring's first sentence (the config
  dataclass's field docstring, else the ``Args:`` entry) and the page that explains it;
* ``docs/benchmarks.md``: the benchmark summary from ``docs/bench/results.json``, by the same
  generator as ``cfdist bench --docs`` (:func:`cfdist.benchmarks.report.readme_section`).

Run from the repository root. Not part of the site (``exclude_docs`` in ``mkdocs.yml``).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import os
import re
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_PAGE = os.path.join("docs", "configuration.md")
BENCH_PAGE = os.path.join("docs", "benchmarks.md")
BENCH_SOURCE = os.path.join("docs", "bench")

# Where each parameter is explained (a page and anchor under docs/). A parameter not named here
# links to its entry in the API reference; add it here when a page explains it.
EXPLAINED = {
    "Checkpointer": {
        "state": "training-loop.md#the-state",
        "storage": "storage.md#storage-urls",
        "policy": "training-loop.md#when-to-checkpoint-policies",
        "keep": "storage.md#retention",
        "keep_epoch_ends": "storage.md#retention",
        "restore_from": "storage.md#tiers-restore_from",
        "storage_options": "storage.md#object-stores-s3-gs-az",
        "codecs": "codecs.md",
        "buffers": "storage.md#double-buffering-buffers2",
        "host_memory": "storage.md#a-host-memory-budget-host_memory",
        "writers": "training-loop.md#who-writes-writers",
        "persist": "api.md#cfdist.PersistOptions",
        "load": "api.md#cfdist.LoadOptions",
        "group": "api.md#cfdist.GroupOptions",
    },
    "PersistOptions": {
        "backend": "storage.md#where-persist-runs",
        "timeout_s": "storage.md#hung-storage-persistoptionstimeout_s",
        "io": "storage.md#local-disks-o_direct-and-the-page-cache",
    },
    "LoadOptions": {
        "verify": "guarantees.md#no-code-on-load",
        "read_retry": "guarantees.md#transient-is-not-corrupt",
    },
    "GroupOptions": {name: "training-loop.md#in-a-torchdistributed-job"
                     for name in ("rank", "world_size", "store", "lookahead", "agree_timeout_s")},
    "fit": {
        "train_loop": "multi-node.md",
        "storage": "multi-node.md#tiers",
        "shared_storage": "multi-node.md#tiers",
        "num_nodes": "multi-node.md",
        "workers_per_node": "multi-node.md",
        "policy": "training-loop.md#when-to-checkpoint-policies",
        "preemption": "experiments.md#failure-schedules",
        "max_failures": "multi-node.md#recovery",
        "run_name": "multi-node.md",
        "ray_address": "multi-node.md#simulated-nodes-on-one-machine",
        "remove_node": "multi-node.md#simulated-nodes-on-one-machine",
        "add_node": "multi-node.md#simulated-nodes-on-one-machine",
    },
    "TierOptions": {
        "memory_tier": "multi-node.md#tiers",
        "local_tier": "multi-node.md#tiers",
        "shared_every": "multi-node.md#tiers",
        "shared_writers": "multi-node.md#the-shared-tier-upload",
        "shared_slice_timeout_s": "multi-node.md#the-shared-tier-upload",
        "peer_copy": "multi-node.md#recovery",
        "keep": "storage.md#retention",
        "memory_every": "multi-node.md#memory-snapshots-every-step-memory_every",
        "storage_options": "storage.md#object-stores-s3-gs-az",
    },
    "RecoveryOptions": {
        "min_nodes": "multi-node.md#recovery",
        "wait_for_nodes_s": "multi-node.md#recovery",
        "sigterm_grace_s": "multi-node.md#preemption-notices-and-sigterm",
        "warm_spares": "multi-node.md#recovery",
        "metadata_url": "multi-node.md#preemption-notices-and-sigterm",
    },
    "OutputOptions": {
        "event_log": "multi-node.md#recovery",
        "log_dir": "troubleshooting.md#what-a-failure-looks-like-under-cfdistfit",
    },
    "Auto": {
        "max_overhead": "training-loop.md#when-to-checkpoint-policies",
        "mtbf_s": "training-loop.md#when-to-checkpoint-policies",
    },
    "RetryPolicy": {name: "guarantees.md#transient-is-not-corrupt"
                    for name in ("tries", "first_delay_s", "max_delay_s")},
}


# ---- reading the code ------------------------------------------------------------------------

def field_docs(cls) -> dict[str, str]:
    """``{field: docstring}`` of a class whose fields carry a string literal right after them."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    out = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            out[node.target.id] = inspect.cleandoc(nxt.value.value)
    return out


def args_docs(obj) -> dict[str, str]:
    """``{parameter: text}`` from the ``Args:`` section of a Google-style docstring
    (``a, b: text`` documents both)."""
    doc = inspect.getdoc(obj) or ""
    m = re.search(r"^Args:\n((?:[ \t]+.*\n?|\n)+)", doc, re.M)
    if not m:
        return {}
    out, names, lines = {}, None, []
    for line in m.group(1).splitlines():
        head = re.match(r"^    (\*{0,2}\w[\w, ]*):\s*(.*)$", line)
        if head:
            if names:
                out.update({n: " ".join(lines) for n in names})
            names = [n.strip().lstrip("*") for n in head.group(1).split(",")]
            lines = [head.group(2)]
        elif line.strip() and names:
            lines.append(line.strip())
    if names:
        out.update({n: " ".join(lines) for n in names})
    return out


def summary(text: str, at_least: int = 60) -> str:
    """The docstring's first sentence (more, until ``at_least`` characters), as Markdown."""
    text = " ".join(text.split())
    text = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", text).replace("``", "`")    # reST roles and literals
    end = 0
    for m in re.finditer(r"(?<![ (]e\.g)(?<![ (]i\.e)\.(\s+(?=[A-Z0-9`(\"])|$)", text):
        end = m.start() + 1
        if end >= at_least:
            break
    return text[:end] if end else text


def _default(value) -> str:
    if value is inspect.Parameter.empty or value is dataclasses.MISSING:
        return "required"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return f"`{type(value).__name__}()`"
    return f"`{value!r}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def parameters(name: str) -> list[tuple[str, str, str, str]]:
    """``[(parameter, default, description, where explained)]`` of one documented component."""
    import cfdist
    from cfdist.checkpoint import options
    from cfdist.checkpoint.options import CheckpointerConfig
    from cfdist.checkpoint.retry import RetryPolicy
    from cfdist.cluster import config as cluster_config
    from cfdist.cluster.config import FitConfig
    from cfdist.policy.auto import AutoConfig

    rows: list[tuple[str, object, str]] = []
    if name == "Checkpointer":
        docs = {**args_docs(cfdist.Checkpointer), **field_docs(CheckpointerConfig)}
        sig = inspect.signature(cfdist.Checkpointer.__init__)
        rows = [(p.name, p.default, docs.get(p.name, "")) for p in list(sig.parameters.values())[1:]
                if p.kind is not inspect.Parameter.VAR_KEYWORD]   # **deprecated: the old flat names
    elif name in ("PersistOptions", "LoadOptions", "GroupOptions", "TierOptions", "RecoveryOptions",
                  "OutputOptions"):
        cls = getattr(options, name, None) or getattr(cluster_config, name)
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            d = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            rows.append((f.name, d, docs.get(f.name, "")))
    elif name == "fit":
        docs = {**args_docs(cfdist.fit), **field_docs(FitConfig)}
        sig = inspect.signature(cfdist.fit)
        rows = [(p.name, p.default, docs.get(p.name, "")) for p in sig.parameters.values()
                if p.kind is not inspect.Parameter.VAR_KEYWORD]
    elif name in ("Auto", "RetryPolicy"):
        cls = AutoConfig if name == "Auto" else RetryPolicy
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            d = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            rows.append((f.name, d, docs.get(f.name, "")))
    else:
        raise KeyError(name)
    api = API_ANCHORS[name]
    return [(p, _default(d), summary(text) or "(undocumented)", EXPLAINED[name].get(p, api))
            for p, d, text in rows]


API_ANCHORS = {
    "Checkpointer": "api.md#cfdist.Checkpointer",
    "fit": "api.md#cfdist.fit",
    "Auto": "api.md#cfdist.Auto",
    "RetryPolicy": "api.md#cfdist.checkpoint.retry.RetryPolicy",
    "PersistOptions": "api.md#cfdist.PersistOptions",
    "LoadOptions": "api.md#cfdist.LoadOptions",
    "GroupOptions": "api.md#cfdist.GroupOptions",
    "TierOptions": "api.md#cfdist.TierOptions",
    "RecoveryOptions": "api.md#cfdist.RecoveryOptions",
    "OutputOptions": "api.md#cfdist.OutputOptions",
}

TITLES = {
    "Checkpointer": "`cfdist.Checkpointer(state, storage, policy=None, *, ...)` (and `CheckpointerConfig`)",
    "PersistOptions": "`cfdist.PersistOptions` (`Checkpointer(persist=)`): how a checkpoint is written",
    "LoadOptions": "`cfdist.LoadOptions` (`Checkpointer(load=)`): how `restore` reads it back",
    "GroupOptions": "`cfdist.GroupOptions` (`Checkpointer(group=)`): the job's ranks",
    "fit": "`cfdist.fit(train_loop, *, storage, ...)`",
    "TierOptions": "`cfdist.TierOptions` (`fit(tiers=)`): the memory, node-local and shared tiers",
    "RecoveryOptions": "`cfdist.RecoveryOptions` (`fit(recovery=)`): how a run recovers",
    "OutputOptions": "`cfdist.OutputOptions` (`fit(output=)`): what a run shows and writes",
    "Auto": "`cfdist.Auto(max_overhead=0.035, mtbf_s=None, **kwargs)` (and `AutoConfig`)",
    "RetryPolicy": "`cfdist.checkpoint.retry.RetryPolicy(*, tries, first_delay_s, max_delay_s)` "
                   "(`LoadOptions(read_retry=)`, `cfdist.load(read_retry=)`)",
}


def config_section() -> str:
    L = ["<!-- config-reference:begin -->",
         "<!-- generated by `python docs/gen.py` from the signatures and config dataclasses; do not edit by hand -->",
         ""]
    for name in ("Checkpointer", "PersistOptions", "LoadOptions", "GroupOptions", "fit", "TierOptions",
                 "RecoveryOptions", "OutputOptions", "Auto", "RetryPolicy"):
        L += [f"## {TITLES[name]}", "", "| parameter | default | what it does | explained in |", "|---|---|---|---|"]
        for p, d, text, where in parameters(name):
            page = where.split("#")[0]
            label = {"api.md": "API reference"}.get(page, page.removesuffix(".md").replace("-", " "))
            L.append(f"| `{p}` | {_cell(d)} | {_cell(text)} | [{label}]({where}) |")
        L.append("")
    L.append("<!-- config-reference:end -->")
    return "\n".join(L)


def bench_section() -> str:
    from cfdist.benchmarks import report

    with open(os.path.join(ROOT, BENCH_SOURCE, "results.json")) as f:
        results = json.load(f)
    return report.readme_section(results, report_path=report.relative_report_path(BENCH_SOURCE, BENCH_PAGE))


# ---- rewriting ---------------------------------------------------------------------------------

SECTIONS = {
    CONFIG_PAGE: ("<!-- config-reference:begin -->", "<!-- config-reference:end -->", config_section),
    BENCH_PAGE: ("<!-- cfdist-bench:begin -->", "<!-- cfdist-bench:end -->", bench_section),
}


def rewrite(text: str, begin: str, end: str, section: str, path: str) -> str:
    pat = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if not pat.search(text):
        raise ValueError(f"{path} has no {begin} ... {end} markers to put the generated section between")
    return pat.sub(lambda _: section, text, count=1)


def stale() -> list[str]:
    """The pages whose generated section differs from what the code generates now."""
    out = []
    for path, (begin, end, make) in SECTIONS.items():
        with open(os.path.join(ROOT, path)) as f:
            text = f.read()
        if rewrite(text, begin, end, make(), path) != text:
            out.append(path)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="only report stale sections (exit 1 if any)")
    a = ap.parse_args(argv)
    sys.path.insert(0, ROOT)
    if a.check:
        bad = stale()
        for p in bad:
            print(f"{p}: its generated section is stale; run `python docs/gen.py`")
        return 1 if bad else 0
    for path, (begin, end, make) in SECTIONS.items():
        full = os.path.join(ROOT, path)
        with open(full) as f:
            text = f.read()
        new = rewrite(text, begin, end, make(), path)
        if new != text:
            with open(full, "w") as f:
                f.write(new)
            print(f"rewrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
