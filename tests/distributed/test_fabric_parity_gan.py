"""A DCGAN-shaped Fabric script (tests/scripts/gan_script.py) on Lightning Fabric and on minifabric.

Fabric's DCGAN example draws the generator's noise from the global random stream inside the loop,
after iterating a set-up loader; the losses match Fabric's only if that stream does. Fabric's FSDP
needs a GPU, so on CPU minifabric's "fsdp" is compared with Fabric's "ddp" (equal in fp32 up to the
order in which gradients are summed), and
"fsdp" + "bf16-mixed" (auto-wrap makes each repeated ``BatchNorm2d`` its own unit, next to bf16
activations) must run and give the losses of "ddp" + "bf16-mixed".
"""

from __future__ import annotations

import json

import pytest

from tests.helpers import PYTHON, REPO, Session

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

SCRIPT = REPO / "tests" / "scripts" / "gan_script.py"


def _run(tmp_path, library, strategy, precision):
    out = tmp_path / f"{library}-{strategy}-{precision}.json"
    run = Session([PYTHON, str(SCRIPT), library, strategy, precision, str(out)])
    code, _ = run.finish(timeout=240)  # kills the whole session (every rank) on a timeout
    assert code == 0, f"{library} {strategy} {precision}:\n{run.output[-3000:]}"
    return json.loads(out.read_text())


def test_gan_losses_equal_fabrics_under_ddp_and_fsdp(tmp_path):
    fabric = _run(tmp_path, "lightning", "ddp", "32-true")
    assert _run(tmp_path, "minifabric", "ddp", "32-true") == fabric  # every rank, every step, both losses
    sharded = _run(tmp_path, "minifabric", "fsdp", "32-true")  # gradients reduced in another order
    flat = [loss for rank in sharded for step in rank for loss in step]
    assert flat == pytest.approx(
        [loss for rank in fabric for step in rank for loss in step], rel=1e-4, abs=1e-6
    )
    mixed = _run(tmp_path, "minifabric", "fsdp", "bf16-mixed")  # each BatchNorm2d is its own unit
    assert len(mixed) == 2 and len(mixed[0]) == len(fabric[0])
    autocast = _run(tmp_path, "minifabric", "ddp", "bf16-mixed")  # float32 batch norms under autocast
    assert [loss for rank in mixed for step in rank for loss in step] == pytest.approx(
        [loss for rank in autocast for step in rank for loss in step], rel=1e-2, abs=1e-4
    )
