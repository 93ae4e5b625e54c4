"""The Accelerator on one process: setup, the step, utilities, and every misuse the API names."""

import random

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, SequentialSampler, TensorDataset

from minifabric import Accelerator, SingleDeviceStrategy


def test_properties_of_a_single_process(acc):
    assert acc.device == torch.device("cpu")
    assert (acc.global_rank, acc.local_rank, acc.node_rank, acc.world_size) == (0, 0, 0, 1)
    assert acc.is_global_zero
    assert isinstance(acc.strategy, SingleDeviceStrategy)
    assert acc.precision.name == "32-true"


def test_step_after_setup_changes_the_model(acc):
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = acc.setup(model, optimizer)
    before = model.weight.detach().clone()
    acc.backward(model(torch.randn(8, 4)).sum())
    optimizer.step()
    assert not torch.equal(before, model.weight)
    assert isinstance(optimizer, torch.optim.SGD)


def test_setup_returns_the_scheduler_pointed_at_the_wrapped_optimizer(acc):
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, scheduler = acc.setup(model, optimizer, scheduler=scheduler)
    optimizer.step()
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == 0.5


def test_setup_module_then_setup_optimizers(acc):
    model = nn.Linear(2, 2)
    first, second = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.Adam(model.parameters())
    model = acc.setup_module(model)
    first, second = acc.setup_optimizers(first, second)
    assert isinstance(first, torch.optim.SGD)
    assert isinstance(second, torch.optim.Adam)


def test_clip_gradients_by_norm_returns_the_total_norm(acc):
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = acc.setup(model, optimizer)
    acc.backward(model(torch.randn(8, 4)).sum() * 100)
    expected = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
    norm = acc.clip_gradients(model, optimizer, max_norm=1.0)
    torch.testing.assert_close(norm, expected)
    clipped = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
    torch.testing.assert_close(clipped, torch.tensor(1.0), rtol=1e-4, atol=1e-4)


def test_clip_gradients_by_value(acc):
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = acc.setup(model, optimizer)
    acc.backward(model(torch.randn(8, 4)).sum() * 100)
    assert acc.clip_gradients(model, optimizer, clip_val=0.5) is None
    assert all(p.grad.abs().max() <= 0.5 for p in model.parameters())


def test_no_backward_sync_is_a_no_op_on_one_process(acc):
    model = acc.setup(nn.Linear(2, 2))
    with acc.no_backward_sync(model):
        acc.backward(model(torch.randn(3, 2)).sum())
    assert model.weight.grad is not None


def test_seed_everything_makes_runs_repeat(acc):
    assert acc.seed_everything(7) == 7
    first = (torch.randn(3), random.random())
    acc.seed_everything(7)
    assert torch.equal(first[0], torch.randn(3))
    assert first[1] == random.random()


def test_rank_zero_first_runs_the_body(acc):
    ran = []
    with acc.rank_zero_first():
        ran.append(1)
    with acc.rank_zero_first(local=True):
        ran.append(2)
    assert ran == [1, 2]


def test_print_on_rank_zero(acc, capsys):
    acc.print("hello", 1)
    assert capsys.readouterr().out == "hello 1\n"


def test_launch_with_a_function_on_one_process_calls_it_here():
    acc = Accelerator(accelerator="cpu")
    assert acc.launch(lambda a, x: (a.world_size, x), 5) == (1, 5)


# ---- collectives on one process ------------------------------------------------------------


def test_collectives_are_the_identity_on_one_process(acc):
    acc.barrier()
    assert acc.broadcast({"a": 1}) == {"a": 1}
    tensor = torch.tensor([1.0, 3.0])
    assert torch.equal(acc.all_gather(tensor), tensor)  # as Fabric: no new dimension on one process
    gathered = acc.all_gather({"x": tensor, "n": 2})
    assert gathered["x"].shape == (2,)
    assert gathered["n"].tolist() == 2
    for op in ("mean", "sum", "max", "min"):
        assert torch.equal(acc.all_reduce(tensor, reduce_op=op), tensor)
    assert acc.all_reduce(3, reduce_op="mean").item() == 3
    assert acc.all_reduce({"loss": 2.0})["loss"].item() == 2.0


def test_unknown_reduce_op_raises(acc):
    with pytest.raises(ValueError, match=r"Unknown reduce_op='avg'.*'mean'"):
        acc.all_reduce(torch.ones(1), reduce_op="avg")


# ---- data loaders ----------------------------------------------------------------------------


def _loader(shuffle=True):
    return DataLoader(TensorDataset(torch.arange(12.0)), batch_size=4, shuffle=shuffle)


def test_setup_dataloaders_adds_a_distributed_sampler_and_sets_its_epoch(acc):
    acc.seed_everything(0)
    loader = acc.setup_dataloaders(_loader())
    assert isinstance(loader.sampler, DistributedSampler)
    assert loader.sampler.shuffle
    epochs = []
    for _ in range(2):
        batches = [batch[0] for batch in loader]
        epochs.append(torch.cat(batches))
        assert sorted(epochs[-1].tolist()) == list(range(12))
    assert loader.sampler.epoch == 1  # set on every new pass
    assert not torch.equal(epochs[0], epochs[1])  # a new order each epoch


def test_setup_dataloaders_moves_batches_to_the_device(acc):
    loader = acc.setup_dataloaders(_loader())
    assert all(batch[0].device == acc.device for batch in loader)
    assert loader._device == acc.device
    assert acc.setup_dataloaders(_loader(), move_to_device=False)._device is None


def test_setup_dataloaders_can_keep_the_sampler(acc):
    loader = acc.setup_dataloaders(_loader(shuffle=False), use_distributed_sampler=False)
    assert isinstance(loader.sampler, SequentialSampler)
    first, second = acc.setup_dataloaders(_loader(), _loader())
    assert isinstance(first.sampler, DistributedSampler) and isinstance(second.sampler, DistributedSampler)


def test_setup_dataloaders_rejects_other_objects(acc):
    with pytest.raises(TypeError, match="DataLoader"):
        acc.setup_dataloaders([1, 2, 3])
    with pytest.raises(ValueError, match="at least one DataLoader"):
        acc.setup_dataloaders()


# ---- misuse ----------------------------------------------------------------------------------


def test_setup_before_launch_with_several_processes_raises():
    acc = Accelerator(accelerator="cpu", devices=2)
    with pytest.raises(RuntimeError, match=r"needs 2 processes.*acc\.launch\(\)"):
        acc.setup(nn.Linear(2, 2))


def test_setup_without_launch_on_one_process_joins_by_itself():
    acc = Accelerator(accelerator="cpu")
    model = acc.setup(nn.Linear(2, 2))
    assert model(torch.randn(1, 2)).shape == (1, 2)


def test_launch_twice_is_a_no_op_as_in_fabric_but_not_with_a_function(acc):
    assert acc.launch() is None
    with pytest.raises(RuntimeError, match=r"after `acc.launch\(\)`"):
        acc.launch(len)


def test_launch_with_a_non_callable_raises():
    with pytest.raises(TypeError, match="needs a callable, got 3"):
        Accelerator(accelerator="cpu").launch(3)


def test_setting_up_the_returned_model_again_raises_value_error_as_fabric(acc):
    model = nn.Linear(2, 2)
    wrapped = acc.setup(model)
    with pytest.raises(ValueError, match="Linear was already set up"):
        acc.setup(wrapped)
    with pytest.raises(ValueError, match="Linear was already set up"):
        acc.setup_module(wrapped)


def test_setting_up_the_same_raw_model_again_is_allowed_as_in_fabric(acc):
    model = nn.Linear(2, 2)
    first = acc.setup_module(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    second, optimizer = acc.setup(model, optimizer)  # Fabric allows this: the same model, set up once
    assert second.module is model and first.module is model
    acc.backward(second(torch.ones(1, 2)).sum())
    optimizer.step()
    assert torch.equal(first.weight, model.weight)


def test_setup_of_a_non_module_raises(acc):
    with pytest.raises(TypeError, match=r"torch\.nn\.Module first, got str"):
        acc.setup("model")


def test_init_module_after_setup_builds_another_model(acc):
    acc.setup(nn.Linear(2, 2))
    with acc.init_module():
        second = nn.Linear(2, 2)
    acc.setup(second)


def test_optimizer_over_another_models_parameters_raises(acc):
    model, other = nn.Linear(2, 2), nn.Linear(3, 3)
    with pytest.raises(ValueError, match=r"not parameters of the\s+Linear being set up.*\(3, 3\)"):
        acc.setup(model, torch.optim.SGD([*model.parameters(), *other.parameters()], lr=0.1))


def test_optimizer_of_a_model_never_set_up_is_set_up_as_in_fabric(acc):
    acc.setup_module(nn.Linear(2, 2))
    other = nn.Linear(3, 3)
    optimizer = acc.setup_optimizers(torch.optim.SGD(other.parameters(), lr=0.1))
    assert optimizer.param_groups[0]["params"][0] is other.weight


def test_setting_up_an_optimizer_twice_raises(acc):
    model = nn.Linear(2, 2)
    model, optimizer = acc.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="already set up"):
        acc.setup_optimizers(optimizer)


@pytest.mark.parametrize("kwargs", [{}, {"max_norm": 1.0, "clip_val": 0.5}])
def test_clip_gradients_needs_exactly_one_of_max_norm_and_clip_val(acc, kwargs):
    model = nn.Linear(2, 2)
    model, optimizer = acc.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"exactly one of clip_val=.* and max_norm="):
        acc.clip_gradients(model, optimizer, **kwargs)


def test_no_backward_sync_needs_the_set_up_model(acc):
    with pytest.raises(TypeError, match=r"model returned by `acc\.setup`"):
        acc.no_backward_sync(nn.Linear(2, 2))


def test_scheduler_without_optimizer_raises(acc):
    with pytest.raises(ValueError, match="needs an optimizer"):
        acc.setup(nn.Linear(2, 2), scheduler=object())


@pytest.mark.parametrize("seed", ["1", 1.5, True])
def test_seed_must_be_an_int(acc, seed):
    with pytest.raises(TypeError, match="seed must be an int"):
        acc.seed_everything(seed)
