"""Ray Train's preemption notice stops an Accelerator loop through ``should_stop``, on every rank at once.

Needs the ``ray`` extra; skipped without it. The preemption is Ray's own: rank 0 asks Ray's GCS to
drain the node the run is on (``drain_node`` with the reason ``DRAIN_NODE_REASON_PREEMPTION``, as
Ray's autoscaler does before a spot instance is reclaimed), Ray Train's watcher sees the drain and
tells the workers, and ``acc.should_stop`` (which calls ``ray.train.get_preemption_info()`` once per
read) turns True. A drained node stays drained, so this module starts its own Ray instance and
shuts it down after (also on failure); no other test may share it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import REPO, run_distributed

ray = pytest.importorskip("ray")
pytest.importorskip("ray.train")
torch_trainer = pytest.importorskip("ray.train.torch")

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(240)]

DRAIN_AT = 3  # rank 0 asks for the drain after this step
MAX_STEPS = 3000  # the loop gives up (and the test fails) if no stop came by then


@pytest.fixture(scope="module")
def ray_cluster():
    if not hasattr(pytest.importorskip("ray.train"), "get_preemption_info"):
        pytest.skip("this Ray has no ray.train.get_preemption_info (Ray Train v1)")
    env = {
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "0.2",  # Ray's watcher polls the drains every 5 s by default
    }
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
    try:
        yield
    finally:
        ray.shutdown()


def _drain_this_node() -> None:
    """Ask Ray's GCS to drain this node for a preemption, as Ray's autoscaler does."""
    import time

    from ray.core.generated import autoscaler_pb2

    context = ray.get_runtime_context()
    gcs = ray._raylet.GcsClient(address=context.gcs_address)
    accepted, why = gcs.drain_node(
        context.get_node_id(),
        autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
        "minifabric test: preempted",
        int(time.time() * 1000) + 120_000,  # the node "goes away" in 2 minutes
    )
    if not accepted:
        raise RuntimeError(f"Ray refused to drain the node: {why}")


def _loop(config: dict) -> None:
    """Ray's ``train_loop_per_worker``: train until ``should_stop``, then save and return."""
    import time

    import ray.train
    import torch

    from minifabric import Accelerator
    from minifabric.runtime.rank import stop_requested

    acc = Accelerator(accelerator="cpu")
    acc.launch()
    acc.seed_everything(0)
    model = torch.nn.Linear(4, 1)
    model, optimizer = acc.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
    report = "never-stopped"
    read_seconds = 0.0
    for step in range(1, MAX_STEPS + 1):
        acc.backward(model(torch.randn(8, 4)).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
        time.sleep(0.005)  # at least 15 s of steps for Ray's notice to arrive
        if step == DRAIN_AT and acc.global_rank == 0:
            _drain_this_node()
        started = time.perf_counter()
        stop = acc.should_stop  # the same step on every rank
        read_seconds += time.perf_counter() - started
        if stop:
            acc.save(config["ckpt"], {"model": model, "optimizer": optimizer, "step": step})
            info = ray.train.get_preemption_info()  # called once more on every rank: the counts still match
            ranks = ",".join(map(str, info.preempted_ranks)) if info is not None else "none"
            weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            report = f"{step} {ranks} {stop_requested()} {weights.numpy().tobytes().hex()}"
            break
    (Path(config["out"]) / f"rank-{acc.global_rank}").write_text(report)
    (Path(config["out"]) / f"read-ms-{acc.global_rank}").write_text(f"{1000 * read_seconds / step:.2f}")


def _load(rank: int, ckpt: str) -> tuple[int, str]:
    import torch

    from minifabric import Accelerator

    acc = Accelerator(accelerator="cpu")
    acc.launch()
    model = torch.nn.Linear(4, 1)
    model, optimizer = acc.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    acc.load(ckpt, state)
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return state["step"], weights.numpy().tobytes().hex()


def test_rays_preemption_notice_stops_every_rank_at_the_same_step(ray_cluster, tmp_path):
    from ray.train import RunConfig, ScalingConfig

    out = tmp_path / "out"
    out.mkdir()
    trainer = torch_trainer.TorchTrainer(
        _loop,
        train_loop_config={"out": str(out), "ckpt": str(tmp_path / "ckpt")},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(storage_path=str(tmp_path / "ray"), name="run"),
    )
    trainer.fit()  # the loop returned on every worker: Ray ends the run as finished
    reports = [(out / f"rank-{rank}").read_text().split() for rank in (0, 1)]
    print("ms per should_stop read (ranks 0, 1):", [(out / f"read-ms-{r}").read_text() for r in (0, 1)])
    assert "never-stopped" not in reports[0] + reports[1], reports
    (step, ranks, signalled, weights), other = reports
    assert other == reports[0]  # the same step, the same notice and the same weights on both ranks
    assert int(step) > DRAIN_AT  # stopped after the drain, by Ray's notice ...
    assert (ranks, signalled) == ("0,1", "False")  # ... for both workers' node, with no signal received
    loaded = run_distributed(_load, 2, str(tmp_path / "ckpt"), timeout=120)
    assert loaded == [(int(step), weights)] * 2  # the checkpoint saved at the stop loads on every rank
