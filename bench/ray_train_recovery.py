"""Ray Train's recovery with and without cfdist, on the same workload, in one run.

    python bench/ray_train_recovery.py --steps 60 --every 10 --crash-at 35 --repeats 3

The workload: the shapes CNN of ``launch/train_small.py`` on 2 CPU workers (a local Ray on
loopback), checkpoints every ``--every`` steps, and one worker SIGKILLed at ``--crash-at``;
Ray Train restarts the group (``FailureConfig``). Two ways to checkpoint:

* ``plain``: Ray Train's documented pattern: rank 0 ``torch.save``s model, optimizer and loader
  position into a temporary directory and ``ray.train.report(checkpoint=...)`` uploads it
  (synchronously: the loop waits), every worker calls ``report``;
* ``cfdist``: ``cfdist.Checkpointer`` into the run directory and
  ``cfdist.ray_train.RayTrainReporter``: the committed step directory is reported in place.

Printed per mode: wall time of the fit, the training loop's time inside checkpoint+report calls
(its stall), the recovery gap (last step before the kill to the first step after the restart),
and the steps trained twice (lost work); with ``--repeats`` the modes alternate (plain, cfdist,
plain, ...) and the medians with min-max follow the runs. Both modes use ``cfdist.ResumableLoader`` so that both
resume at the same sample; this measures checkpoint and restart costs, not data handling.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "launch"))
from train_small import SmallCNN, make_shapes  # noqa: E402


def train_func(config: dict) -> None:
    import ray.train
    import ray.train.torch

    import cfdist
    from cfdist.ray_train import RayTrainReporter, run_storage

    torch.manual_seed(0)
    rank = ray.train.get_context().get_world_rank()
    model = ray.train.torch.prepare_model(SmallCNN())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = cfdist.ResumableLoader(make_shapes(n=1024), 32, seed=0)
    every, mode = config["every"], config["mode"]
    if mode == "cfdist":
        ckpt = cfdist.Checkpointer({"model": model, "optim": opt, "data": loader}, run_storage(),
                                   cfdist.Every(every), keep=2)
        reporter = RayTrainReporter(ckpt, every=every)
        step = reporter.restore() or 0
    else:
        step = 0
        given = ray.train.get_checkpoint()
        if given is not None:
            with given.as_directory() as d:
                saved = torch.load(os.path.join(d, "state.pt"), weights_only=True)
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["optim"])
            loader.load_state_dict(json.loads(saved["data"]))
            step = int(saved["step"])
    log = open(config["log"], "a") if rank == 0 else None
    stall = 0.0
    while step < config["steps"]:
        for x, y in loader:
            F.cross_entropy(model(x), y).backward()
            t0 = time.perf_counter()
            if mode == "cfdist":
                ckpt.step(opt)
                opt.zero_grad()
                step = ckpt.step_count
                reporter.maybe_report()
            else:
                opt.step()
                opt.zero_grad()
                step += 1
                if step % every == 0:
                    with tempfile.TemporaryDirectory() as d:
                        ck = None
                        if rank == 0:
                            torch.save({"model": model.state_dict(), "optim": opt.state_dict(),
                                        "data": json.dumps(loader.state_dict()), "step": step},
                                       os.path.join(d, "state.pt"))
                            ck = ray.train.Checkpoint.from_directory(d)
                        ray.train.report({"step": step}, checkpoint=ck)
            stall += time.perf_counter() - t0
            if log:
                log.write(json.dumps({"step": step, "t": time.time(), "stall": stall, "pid": os.getpid()}) + "\n")
                log.flush()
            if step == config["crash_at"] and rank == 1 and not os.path.exists(config["marker"]):
                open(config["marker"], "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
            if step >= config["steps"]:
                break
    if mode == "cfdist":
        reporter.close()


def run(mode: str, a, tmp: str, i: int = 0) -> dict:
    import ray.train
    from ray.train.torch import TorchTrainer

    logf = os.path.join(tmp, f"{mode}-{i}.jsonl")
    t0 = time.time()
    TorchTrainer(
        train_func,
        train_loop_config={"mode": mode, "every": a.every, "steps": a.steps, "crash_at": a.crash_at,
                           "log": logf, "marker": os.path.join(tmp, f"{mode}-{i}.crashed")},
        scaling_config=ray.train.ScalingConfig(num_workers=2),
        run_config=ray.train.RunConfig(name=f"{mode}-{i}", storage_path=os.path.join(tmp, "results"),
                                       failure_config=ray.train.FailureConfig(max_failures=1)),
    ).fit()
    wall = time.time() - t0
    rows = [json.loads(x) for x in open(logf)]
    first_pid = rows[0]["pid"]
    before = [r for r in rows if r["pid"] == first_pid]
    after = [r for r in rows if r["pid"] != first_pid]
    return {"mode": mode, "wall_s": round(wall, 1),
            "stall_s": round(before[-1]["stall"] + (after[-1]["stall"] if after else 0), 3),
            "recovery_gap_s": round(after[0]["t"] - before[-1]["t"], 1) if after else None,
            "steps_redone": before[-1]["step"] - after[0]["step"] + 1 if after else 0}


def main() -> None:
    import ray

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--crash-at", type=int, default=35)
    p.add_argument("--repeats", type=int, default=1, help="runs per mode, interleaved")
    a = p.parse_args()
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ray.init(num_cpus=4, _node_ip_address="127.0.0.1", include_dashboard=False,
             runtime_env={"env_vars": {"GLOO_SOCKET_IFNAME": "lo",
                                       "PYTHONPATH": os.pathsep.join([repo, os.path.join(repo, "launch")])}})
    try:
        with tempfile.TemporaryDirectory() as tmp:
            res = [run(m, a, tmp, i) for i in range(a.repeats) for m in ("plain", "cfdist")]
    finally:
        ray.shutdown()
    cols = ("wall_s", "stall_s", "recovery_gap_s", "steps_redone")
    print(f"{'mode':8} {'wall s':>7} {'stall s':>8} {'recovery gap s':>15} {'steps redone':>13}")
    for r in res:
        print(f"{r['mode']:8} {r['wall_s']:>7} {r['stall_s']:>8} {r['recovery_gap_s']!s:>15} {r['steps_redone']:>13}")
    if a.repeats > 1:
        print("median [min, max] over", a.repeats, "runs per mode:")
        for m in ("plain", "cfdist"):
            vals = {c: sorted(r[c] for r in res if r["mode"] == m and r[c] is not None) for c in cols}
            print(f"{m:8} " + "  ".join(f"{c} {statistics.median(v):g} [{v[0]:g}, {v[-1]:g}]"
                                       for c, v in vals.items() if v))
    print(json.dumps(res))


if __name__ == "__main__":
    main()
