"""A Lightning Fabric training script, written for Fabric; ``minifabric`` as first argument swaps one import.

    python tests/scripts/fabric_script.py lightning OUT_DIR     # runs on lightning-fabric
    python tests/scripts/fabric_script.py minifabric OUT_DIR    # the same script on minifabric

The only difference between the two runs is the import line below. It uses what Fabric scripts
use: loggers, callbacks, ``training_step`` on the set-up model, ``seed_everything``, distributed
shuffling, gradient clipping, in-place ``all_reduce``, lightning's ``ThroughputMonitor``. Rank 0
writes ``OUT_DIR/result.json`` with the losses and final weights.
"""

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning_fabric.loggers import CSVLogger
from lightning_fabric.utilities.throughput import ThroughputMonitor
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

if sys.argv[1] == "minifabric":
    from minifabric import Accelerator as Fabric
else:
    from lightning_fabric import Fabric

OUT = Path(sys.argv[2])


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: list[torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)


class LossHistory:
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, loss: torch.Tensor) -> None:
        self.losses.append(loss.item())


def main() -> None:
    history = LossHistory()
    fabric = Fabric(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        loggers=CSVLogger(OUT / "logs", name="run"),
        callbacks=[history],
    )
    fabric.launch()
    fabric.seed_everything(42)

    model = Regressor()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 6, generator=generator), torch.randn(64, 1, generator=generator))
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=8, shuffle=True))
    monitor = ThroughputMonitor(fabric, window_size=2)

    step = 0
    for _ in range(2):
        for batch in loader:
            loss = model.training_step(batch)
            fabric.backward(loss)
            fabric.clip_gradients(model, optimizer, max_norm=0.5)
            optimizer.step()
            optimizer.zero_grad()
            mean_loss = loss.detach().clone()
            fabric.all_reduce(mean_loss)  # in place
            fabric.log("loss", mean_loss, step=step)
            fabric.call("on_train_batch_end", loss=mean_loss)
            step += 1
            monitor.update(time=float(step), batches=step, samples=8 * step)
            throughput = monitor.compute_and_log(step=step)
    fabric.logger.finalize("success")
    if fabric.global_rank == 0:
        result = {
            "losses": history.losses,
            "weights": {k: v.flatten().tolist() for k, v in model.state_dict().items()},
            "throughput": throughput,
        }
        (OUT / "result.json").write_text(json.dumps(result))
    fabric.barrier()
    if sys.argv[1] == "lightning":
        # Lightning's ranks exit with their gloo group alive, and torch then sometimes aborts at
        # interpreter exit ("terminate called without an active exception"). Destroying it right after
        # a collective can deadlock instead (gloo's worker thread needs the GIL to free the finished
        # work). The reference leaves the group the way minifabric does: collect, barrier, destroy.
        from minifabric.runtime.environment import destroy_process_group

        destroy_process_group()


if __name__ == "__main__":
    main()
