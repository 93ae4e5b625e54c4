"""Ray Train: an Accelerator loop run by ``TorchTrainer`` adopts Ray's process group and resumes after a failure.

Needs the ``ray`` extra (``pip install -e ".[ray]"``); skipped without it. One small Ray instance
(2 CPUs) is shared by the tests of this module and shut down after them: starting Ray is the slow
part (about 20 s on a shared 2-core machine).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import REPO, run_distributed

ray = pytest.importorskip("ray")
train_module = pytest.importorskip("ray.train")
torch_trainer = pytest.importorskip("ray.train.torch")

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}},
    )
    try:
        yield
    finally:
        ray.shutdown()


def _loop(config: dict) -> None:
    """Ray's ``train_loop_per_worker``: an ordinary Accelerator script."""
    import torch.distributed as dist

    from minifabric import Accelerator
    from tests.scripts.elastic import train

    group = dist.group.WORLD  # Ray created it before this function runs
    acc = Accelerator(accelerator="cpu")
    acc.launch()
    marker = Path(config["out"]) / "died-once"
    die_at = -1
    if config["fail"] and not marker.exists():
        die_at = 4
        if acc.global_rank == 1:
            marker.touch()
    resumed, weights = train(acc, config["ckpt"], die_at=die_at)
    adopted = dist.group.WORLD is group and dist.get_backend() == "gloo" and acc.device.type == "cpu"
    report = f"{acc.global_rank} {acc.world_size} {adopted} {resumed} {weights}"
    (Path(config["out"]) / f"rank-{acc.global_rank}").write_text(report)


def _fit(tmp_path: Path, fail: bool) -> dict[int, list[str]]:
    from ray.train import FailureConfig, RunConfig, ScalingConfig

    out = tmp_path / "out"
    out.mkdir()
    trainer = torch_trainer.TorchTrainer(
        _loop,
        train_loop_config={"out": str(out), "ckpt": str(tmp_path / "ckpt"), "fail": fail},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(
            storage_path=str(tmp_path / "ray"), name="run", failure_config=FailureConfig(max_failures=1)
        ),
    )
    trainer.fit()
    return {rank: (out / f"rank-{rank}").read_text().split() for rank in (0, 1)}


def _reference(rank: int, ckpt: str) -> str:
    from minifabric import Accelerator
    from tests.scripts.elastic import train

    acc = Accelerator(accelerator="cpu")
    acc.launch()
    return train(acc, ckpt)[1]


def test_a_killed_worker_is_restarted_and_resumes_from_the_checkpoint(ray_cluster, tmp_path):
    reference = run_distributed(_reference, 2, str(tmp_path / "reference"))
    assert reference[0] == reference[1]
    results = _fit(tmp_path, fail=True)
    assert (tmp_path / "out" / "died-once").exists()  # the first attempt lost rank 1 after step 4
    for rank, (got_rank, world, adopted, resumed, weights) in results.items():
        assert (int(got_rank), world, adopted) == (rank, "2", "True")  # Ray's group, ranks, backend, device
        assert resumed == "4"  # the restarted attempt began at the last checkpoint
        assert weights == reference[0]  # and ended as the run without a failure, bitwise
