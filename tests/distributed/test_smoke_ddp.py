import pytest
import torch

from minifabric import Accelerator
from tests.helpers import run_distributed

pytestmark = pytest.mark.distributed


def _train(rank):
    acc = Accelerator(accelerator="cpu", strategy="ddp", devices=2)
    acc.launch()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = acc.setup(model, optimizer)
    torch.manual_seed(rank)
    acc.backward(model(torch.randn(8, 4)).sum())
    optimizer.step()
    return model.weight.detach().clone()


def test_ddp_ranks_agree():
    w0, w1 = run_distributed(_train, 2)
    assert torch.equal(w0, w1)
