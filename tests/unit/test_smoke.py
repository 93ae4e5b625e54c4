import torch

from minifabric import Accelerator


def test_single_device_step_changes_model():
    acc = Accelerator(accelerator="cpu")
    acc.launch()
    model = torch.nn.Linear(4, 2)
    before = model.weight.detach().clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = acc.setup(model, optimizer)
    acc.backward(model(torch.randn(8, 4)).sum())
    optimizer.step()
    assert not torch.equal(before, model.weight)
