"""A Lightning fit with cfdist's CheckpointCallback, run as a child process by test_lightning.py.

    python lightning_child.py STORAGE OUT [--ddp] [--loader resumable|stateful] [--model-checkpoint]

Appends one JSON line per finished batch to OUT/progress-<rank>.jsonl (global step, sample ids,
pid) and, when the fit ends, writes the final parameters to OUT/final.pt (rank 0). Under
``--ddp`` Lightning relaunches this script for rank 1 (strategy="ddp", gloo on CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import lightning.pytorch as pl
import torch
import torch.nn.functional as F

import cfdist
from cfdist.cluster.exits import exit_process
from cfdist.lightning import CheckpointCallback

N, BATCH, EPOCHS = 40, 4, 2


class Points(torch.utils.data.Dataset):
    def __len__(self):
        return N

    def __getitem__(self, i):
        x = torch.sin(torch.arange(4, dtype=torch.float32) * (i + 1))
        return x, x.sum(0, keepdim=True) * 0.5, i


class Net(pl.LightningModule):
    def __init__(self, dropout: float):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Dropout(dropout),
                                       torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Recorder(pl.Callback):
    def __init__(self, out: str, delay: float):
        self.out, self.delay = out, delay

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        with open(os.path.join(self.out, f"progress-{trainer.global_rank}.jsonl"), "a") as f:
            f.write(json.dumps({"step": trainer.global_step, "epoch": trainer.current_epoch,
                                "ids": batch[2].tolist(), "pid": os.getpid()}) + "\n")
        time.sleep(self.delay)        # room for the test's kill to land mid-run


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("storage")
    p.add_argument("out")
    p.add_argument("--ddp", action="store_true")
    p.add_argument("--loader", default="resumable", choices=("resumable", "stateful"))
    p.add_argument("--model-checkpoint", action="store_true")
    p.add_argument("--delay", type=float, default=0.05)
    a = p.parse_args()
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    # Dropout draws from each rank's RNG; the DDP run leaves it out (ranks restore rank 0's RNG).
    model = Net(dropout=0.0 if a.ddp else 0.2)
    callbacks = [CheckpointCallback(a.storage, policy=cfdist.Every(3), keep=2), Recorder(a.out, a.delay)]
    if a.model_checkpoint:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=os.path.join(a.out, "lightning-ckpts"),
                                                      every_n_train_steps=5, save_top_k=-1))
    trainer = pl.Trainer(
        max_epochs=EPOCHS, accelerator="cpu", devices=2 if a.ddp else 1, strategy="ddp" if a.ddp else "auto",
        callbacks=callbacks, logger=False, enable_checkpointing=a.model_checkpoint,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=a.out, deterministic=True,
    )
    if a.loader == "resumable":
        loader = cfdist.ResumableLoader(Points(), BATCH, seed=1)   # rank/world from torch.distributed
    else:
        from torchdata.stateful_dataloader import StatefulDataLoader

        loader = StatefulDataLoader(Points(), batch_size=BATCH, shuffle=True)
    if a.ddp:
        # The loader reads rank and world size when built, after DDP is set up.
        model.train_dataloader = lambda: cfdist.ResumableLoader(Points(), BATCH, seed=1)
        trainer.fit(model)
    else:
        trainer.fit(model, train_dataloaders=loader)
    if trainer.global_rank == 0:
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, os.path.join(a.out, "final.pt"))


if __name__ == "__main__":
    main()
    exit_process(0)   # no gloo thread racing the interpreter's shutdown (cfdist.cluster.exits)
