"""``launch(fn, ...)`` on 2 CPU processes, on Lightning Fabric and on minifabric: the same results on every rank.

One spawned function covers what differs only with several processes: each rank gets its own copy
of the model it is passed, a custom sampler is split between the ranks (each gets its share of
what the sampler yields), and a ``DataLoader`` subclass with extra ``__init__`` arguments built
inside the function is rebuilt with the distributed sampler.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


class _TaggedLoader(DataLoader):
    """A ``DataLoader`` subclass whose ``__init__`` takes an argument it does not keep as an attribute."""

    def __init__(self, dataset, tag, **kwargs):
        super().__init__(dataset, **kwargs)
        self.label = f"tag-{tag}"


def _train(acc, model):
    model, optimizer = acc.setup(model, torch.optim.SGD(model.parameters(), lr=1.0))
    acc.backward(model(torch.ones(1, 1)).sum())  # gradient 1 on every rank: the mean is 1
    optimizer.step()  # 1 - 1 * 1 = 0 on every rank, if each rank has its own weights
    weights = acc.all_gather(model.weight.detach().reshape(1)).flatten().tolist()

    data = TensorDataset(torch.arange(10))
    reverse = acc.setup_dataloaders(DataLoader(data, batch_size=1, sampler=list(reversed(range(10)))))
    mine = [int(batch[0]) for batch in reverse]
    tagged = acc.setup_dataloaders(_TaggedLoader(data, tag=7, batch_size=1, shuffle=False))
    tagged_mine = [int(batch[0]) for batch in tagged]
    samples = acc.all_gather(torch.tensor(mine)).tolist()
    tagged_samples = acc.all_gather(torch.tensor(tagged_mine)).tolist()
    return weights, samples, tagged_samples, tagged.label


def _train_on_lightning(fabric, model):
    """Lightning's spawned ranks exit with their gloo group alive, and torch then sometimes aborts at
    interpreter exit ("terminate called without an active exception"); minifabric leaves its group
    (collect, barrier, destroy) when the launched function returns, so the reference does the same."""
    from minifabric.runtime.environment import destroy_process_group

    result = _train(fabric, model)
    destroy_process_group()
    return result


def _run(cls, function=_train):
    torch.manual_seed(0)
    model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    return cls(accelerator="cpu", devices=2, strategy="ddp_spawn").launch(function, model)


def test_launch_fn_gives_each_rank_its_model_and_its_share_of_the_data():
    from lightning_fabric import Fabric

    from minifabric import Accelerator

    lightning, mini = _run(Fabric, _train_on_lightning), _run(Accelerator)
    assert mini == lightning
    weights, samples, tagged_samples, label = mini
    assert weights == [0.0, 0.0]  # on shared memory, both steps would land on one weight: -1
    assert samples == [[9, 7, 5, 3, 1], [8, 6, 4, 2, 0]]  # the sampler's order, split between the ranks
    assert tagged_samples == [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]
    assert label == "tag-7"


def _load_full_state_dict(rank, path):
    from minifabric import Accelerator

    acc = Accelerator(accelerator="cpu", strategy="fsdp", devices=2)
    acc.launch()
    model = acc.setup(nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3)))
    result = model.load_state_dict(torch.load(path, weights_only=True))  # litgpt's load on every rank
    out = model(torch.ones(2, 4))
    return [list(result.missing_keys), list(result.unexpected_keys)], out.tolist()


def test_a_full_state_dict_loads_into_the_sharded_model_on_every_rank(tmp_path):
    """litgpt's finetune/full.py loads its base checkpoint with ``model.load_state_dict`` under FSDP."""
    from tests.helpers import run_distributed

    torch.manual_seed(0)
    source = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    torch.save(source.state_dict(), tmp_path / "base.pt")
    expected = source(torch.ones(2, 4)).tolist()
    for keys, out in run_distributed(_load_full_state_dict, 2, str(tmp_path / "base.pt"), timeout=240):
        assert keys == [[], []]
        assert torch.allclose(torch.tensor(out), torch.tensor(expected), atol=1e-6)
