"""Full (unsharded) state into a set-up FSDP model and optimizer, on 2 ranks, against one process.

The files are what users load: a one-process ``model.state_dict()`` read with litgpt's
``lazy_load`` (Lightning's ``_lazy_load``) or ``torch.load``, a one-process ``optimizer.state_dict()``
(keyed by index), and torch's ``get_optimizer_state_dict(..., full_state_dict=True)`` (keyed by name).
After loading, the weights and one more optimizer step must equal the one-process run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from tests.distributed.checkpoint_common import Net, accelerator, assert_same, run_ranks, snapshot, train

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]


def _train_one_process(model: Net, optimizer: torch.optim.Optimizer, steps: int, seed: int = 1) -> None:
    """:func:`train` without an accelerator (same data)."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model(torch.randn(4, 8, generator=generator)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _reference(root: Path) -> dict:
    """One process: 2 AdamW steps, the files written, then 1 more step (data seed 2)."""
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    _train_one_process(model, optimizer, 2)
    torch.save(model.state_dict(), root / "model.pt")
    torch.save(optimizer.state_dict(), root / "optimizer.pt")
    named = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    torch.save(named, root / "optimizer_named.pt")
    loaded = snapshot(model, optimizer)
    torch.manual_seed(3)  # the dropout masks of the step
    _train_one_process(model, optimizer, 1, seed=2)
    return {"loaded": loaded, "stepped": snapshot(model, optimizer)}


def _load_and_step(rank: int, root: str, how: str) -> dict:
    from lightning_fabric.utilities.load import _lazy_load

    acc = accelerator(2)
    torch.manual_seed(7)  # other weights than the file's
    model = Net()
    model, optimizer = acc.setup(model, torch.optim.AdamW(model.parameters(), lr=0.05))
    train(acc, model, optimizer, None, 1, seed=5)  # the optimizer holds (other) state already
    if how == "lazy":  # litgpt's load_checkpoint outside its FSDPStrategy branch
        model.load_state_dict(_lazy_load(f"{root}/model.pt"), strict=True)
    else:
        model.load_state_dict(torch.load(f"{root}/model.pt", weights_only=True))
    if how in ("lazy", "load_state_dict"):
        optimizer.load_state_dict(torch.load(f"{root}/optimizer.pt", weights_only=True))
    elif how == "raw_named":
        acc.load_raw(f"{root}/optimizer_named.pt", optimizer)
    else:
        acc.load_raw(f"{root}/optimizer.pt", optimizer)
    loaded = snapshot(model, optimizer)
    torch.manual_seed(3)
    train(acc, model, optimizer, None, 1, seed=2)
    return {"loaded": loaded, "stepped": snapshot(model, optimizer)}


@pytest.mark.parametrize("how", ["lazy", "load_state_dict", "raw_named", "raw_indexed"])
def test_full_state_loads_into_sharded_model_and_optimizer_like_one_process(tmp_path: Path, how: str) -> None:
    """Model: ``load_state_dict`` of lazily loaded or plain full tensors; optimizer: its
    ``load_state_dict`` of a one-process state dict, ``load_raw`` of torch's name-keyed full state or
    of the index-keyed one. The weights and a following step equal one process, on both ranks."""
    reference = _reference(tmp_path)
    for rank, out in enumerate(run_ranks(_load_and_step, 2, str(tmp_path), how, timeout=150)):
        assert_same(out["loaded"], reference["loaded"], f"rank {rank} loaded")
        assert_same(out["stepped"], reference["stepped"], f"rank {rank} stepped")


def _refused(rank: int, root: str) -> dict:
    acc = accelerator(2)
    torch.manual_seed(7)
    model = Net()
    model, optimizer = acc.setup(model, torch.optim.AdamW(model.parameters(), lr=0.05))
    train(acc, model, optimizer, None, 1)
    before = snapshot(model, optimizer)
    errors = []
    wrong = torch.load(f"{root}/model.pt", weights_only=True)
    wrong["head.bias"] = torch.zeros(3)
    optimizer_wrong = torch.load(f"{root}/optimizer.pt", weights_only=True)
    optimizer_wrong["state"][5]["exp_avg"] = torch.zeros(4)  # head.bias has 2 elements
    for attempt in (lambda: model.load_state_dict(wrong), lambda: optimizer.load_state_dict(optimizer_wrong)):
        try:
            attempt()
            errors.append(None)
        except ValueError as err:
            errors.append(str(err))
    return {"errors": errors, "unchanged": snapshot(model, optimizer), "before": before}


def test_full_state_of_other_shapes_is_refused_on_every_rank_and_changes_nothing(tmp_path: Path) -> None:
    _reference(tmp_path)
    for rank, out in enumerate(run_ranks(_refused, 2, str(tmp_path), timeout=150)):
        module_error, optimizer_error = out["errors"]
        assert module_error is not None and "head.bias: state dict (3,), model (2,)" in module_error, rank
        assert (
            optimizer_error is not None
            and "optimizer.state[5]['exp_avg'] has the shape (4,)" in optimizer_error
        )
        assert_same(out["unchanged"], out["before"], f"rank {rank}")
