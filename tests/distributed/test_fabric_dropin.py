"""A Fabric-style loop on 2 processes under "ddp" and "fsdp": loggers, callbacks, routed
``training_step``, in-place ``all_reduce``, lightning's ``ThroughputMonitor`` and ``measure_flops``
given an Accelerator; and FSDP + "bf16-mixed" with batch norms (a small DCGAN)."""

from __future__ import annotations

import copy
import csv
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from minifabric import Accelerator
from tests.helpers import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

STEPS = 3


class Net(nn.Module):
    """Root layers around a repeated block; ``training_step`` uses the layers without ``forward``."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.head(h)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        h = torch.tanh(self.inp(x))  # the layers directly: only routing makes DDP/FSDP see this
        for block in self.blocks:
            h = torch.tanh(block(h))
        return F.mse_loss(self.head(h), y)

    def scaled_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return 2 * self.training_step((x, y))

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        return self(x)


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[int, float]] = []

    def on_train_batch_end(self, loss: torch.Tensor, batch_idx: int) -> None:
        self.calls.append((batch_idx, loss.item()))


class TakesKwargs:
    def __init__(self) -> None:
        self.seen: list[dict] = []

    def on_train_batch_end(self, **kwargs: object) -> None:
        self.seen.append(sorted(kwargs))


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _fabric_loop(rank: int, strategy: str, tmp: str) -> dict:
    from lightning_fabric.loggers import CSVLogger, TensorBoardLogger
    from lightning_fabric.utilities.throughput import ThroughputMonitor, measure_flops

    from minifabric import seed_everything

    root = Path(tmp) / strategy
    recorder, takes_kwargs = Recorder(), TakesKwargs()
    acc = Accelerator(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        callbacks=[recorder, takes_kwargs, object()],
        loggers=[CSVLogger(root, name="csv"), TensorBoardLogger(root, name="tb")],
    )
    acc.launch()
    seed_everything(0)
    model = Net()
    reference = copy.deepcopy(model)
    model, optimizer = acc.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    monitor = ThroughputMonitor(acc, window_size=2)

    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 4, generator=generator), torch.randn(8, 1, generator=generator)
    mine = slice(4 * rank, 4 * rank + 4)
    local_losses, reduced_losses, returned_same, throughput = [], [], [], []
    for step in range(STEPS):
        loss = (
            model.training_step((x[mine], y[mine])) if step < 2 else model.scaled_loss(x[mine], y[mine]) / 2
        )
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        reference.training_step((x, y)).backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()

        local = loss.detach().clone()
        local_losses.append(local.item())
        returned = acc.all_reduce(local)  # in place, like Fabric: `local` now holds the mean
        returned_same.append(returned is local)
        reduced_losses.append(local.item())
        acc.log("loss", local, step=step)
        acc.log_dict({"lr": 0.1, "step_tensor": torch.tensor(step)}, step=step)
        acc.call("on_train_batch_end", loss=local, batch_idx=step, unused="dropped")
        monitor.update(time=float(step + 1), batches=step + 1, samples=4 * (step + 1))
        throughput.append(monitor.compute_and_log(step=step))
        if step == 1:
            model.mark_forward_method("scaled_loss")
    for logger in acc.loggers:
        logger.finalize("success")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            model.predict(x)
            model.predict(x)
    outside_forward = [str(w.message) for w in caught if "outside `model(...)`" in str(w.message)]

    flops = measure_flops(model, lambda: model(x[:2]))
    acc.barrier()
    return {
        "params": {k: _full(v).detach().clone() for k, v in model.state_dict().items()},
        "reference": {k: v.detach().clone() for k, v in reference.state_dict().items()},
        "local_losses": local_losses,
        "reduced_losses": reduced_losses,
        "returned_same": returned_same,
        "recorder": recorder.calls,
        "kwargs_seen": takes_kwargs.seen,
        "throughput": throughput,
        "outside_forward": outside_forward,
        "flops": flops,
    }


@pytest.fixture(scope="module", params=["ddp", "fsdp"])
def run(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"dropin_{request.param}")
    return request.param, tmp, run_distributed(_fabric_loop, 2, request.param, str(tmp), timeout=200)


def test_routed_training_step_matches_one_process(run):
    strategy, _, results = run
    for rank, result in enumerate(results):
        for name, value in result["reference"].items():
            assert torch.allclose(result["params"][name], value, atol=1e-6), f"{strategy} rank {rank}: {name}"


def test_all_reduce_is_in_place_and_returns_it(run):
    _, _, results = run
    means = [
        sum(pair) / 2 for pair in zip(results[0]["local_losses"], results[1]["local_losses"], strict=True)
    ]
    assert results[0]["local_losses"] != results[1]["local_losses"]
    for result in results:
        assert result["returned_same"] == [True] * STEPS
        assert result["reduced_losses"] == pytest.approx(means, rel=1e-6)


def test_callbacks_get_the_keywords_they_take(run):
    _, _, results = run
    for result in results:
        assert [batch for batch, _ in result["recorder"]] == list(range(STEPS))
        assert [loss for _, loss in result["recorder"]] == pytest.approx(result["reduced_losses"])
        assert result["kwargs_seen"] == [["batch_idx", "loss", "unused"]] * STEPS


def test_csv_and_tensorboard_written_by_rank_zero_only(run):
    _, tmp, results = run
    root = tmp / run[0]
    assert sorted(p.name for p in (root / "csv").iterdir()) == ["version_0"]
    with open(root / "csv" / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows if r["loss"]] == list(range(STEPS))
    assert [float(r["loss"]) for r in rows if r["loss"]] == pytest.approx(results[0]["reduced_losses"])

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert sorted(p.name for p in (root / "tb").iterdir()) == ["version_0"]
    events = EventAccumulator(str(root / "tb" / "version_0"))
    events.Reload()
    scalars = events.Scalars("loss")
    assert [s.step for s in scalars] == list(range(STEPS))
    assert [s.value for s in scalars] == pytest.approx(results[0]["reduced_losses"], rel=1e-6)
    assert "samples_per_sec" in events.Tags()["scalars"]  # ThroughputMonitor logs through acc.log_dict


def test_throughput_monitor_takes_an_accelerator(run):
    _, _, results = run
    last = results[0]["throughput"][-1]
    assert last["device/samples_per_sec"] == pytest.approx(4.0)
    assert last["samples_per_sec"] == pytest.approx(8.0)  # world size 2
    assert all(metrics == {} for metrics in results[1]["throughput"])  # rank_zero_only knows rank 1


def test_methods_outside_forward_warn_once_and_flops_are_counted(run):
    _, _, results = run
    for result in results:
        assert len(result["outside_forward"]) == 1
        assert 'mark_forward_method("predict")' in result["outside_forward"][0]
        assert result["flops"] == 2 * 2 * (4 * 8 + 2 * 8 * 8 + 8 * 1)


# ---- FSDP + bf16-mixed + batch norm --------------------------------------------------------------


def _dcgan(rank: int) -> dict:
    acc = Accelerator(accelerator="cpu", devices=2, strategy="fsdp", precision="bf16-mixed")
    acc.launch()
    acc.seed_everything(0)
    generator = nn.Sequential(
        nn.ConvTranspose2d(8, 16, 4, 1, 0, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
        nn.ConvTranspose2d(16, 3, 4, 2, 1, bias=False), nn.Tanh(),
    )  # fmt: skip
    discriminator = nn.Sequential(
        nn.Conv2d(3, 16, 4, 2, 1, bias=False), nn.BatchNorm2d(16), nn.LeakyReLU(0.2),
        nn.Conv2d(16, 1, 4, 1, 0, bias=False), nn.Flatten(),
    )  # fmt: skip
    g, g_opt = acc.setup(generator, torch.optim.Adam(generator.parameters(), lr=2e-3))
    d, d_opt = acc.setup(discriminator, torch.optim.Adam(discriminator.parameters(), lr=2e-3))
    start = _full(g.module[0].weight).detach().clone()
    real = torch.rand(4, 3, 8, 8) * 2 - 1
    losses = []
    for _ in range(STEPS):
        fake = g(torch.randn(4, 8, 1, 1))
        d_loss = F.softplus(-d(real)).mean() + F.softplus(d(fake.detach())).mean()
        acc.backward(d_loss)
        d_opt.step()
        d_opt.zero_grad()
        g_loss = F.softplus(-d(fake)).mean()
        acc.backward(g_loss)
        g_opt.step()
        g_opt.zero_grad()
        losses.append((d_loss.item(), g_loss.item()))
    norm = g.module[1]
    return {
        "losses": losses,
        "norm_dtype": norm.weight.dtype,
        "running_mean_moved": bool(norm.running_mean.abs().sum() > 0),
        "changed": not torch.equal(_full(g.module[0].weight), start),
        "weights": _full(g.module[0].weight).detach().clone(),
    }


def test_fsdp_bf16_mixed_trains_a_model_with_batch_norm():
    results = run_distributed(_dcgan, 2, timeout=120)
    for result in results:
        assert all(torch.isfinite(torch.tensor(pair)).all() for pair in result["losses"])
        assert result["norm_dtype"] == torch.float32  # kept in float32, as autocast would
        assert result["running_mean_moved"] and result["changed"]
    assert torch.equal(results[0]["weights"], results[1]["weights"])
