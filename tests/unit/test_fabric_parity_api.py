"""One process, the same calls on Lightning Fabric and on minifabric: the same results (or the same error).

Each test runs one scenario through ``make(...)`` for both libraries (``Fabric`` and ``Accelerator``
take the same arguments) and compares what a user sees.
"""

from __future__ import annotations

import pytest
import torch
from lightning_fabric import Fabric
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, WeightedRandomSampler

from minifabric import Accelerator

LIBRARIES = {"lightning": Fabric, "minifabric": Accelerator}


@pytest.fixture(params=list(LIBRARIES))
def make(request):
    return LIBRARIES[request.param]


def _on_both(scenario):
    """``scenario(cls)`` for Fabric and for Accelerator."""
    return {name: scenario(cls) for name, cls in LIBRARIES.items()}


# ---- 2, 3: clip_gradients ------------------------------------------------------------------------


def _clip_third_positional(cls):
    acc = cls(accelerator="cpu", devices=1)
    model = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    model, optimizer = acc.setup(model, torch.optim.SGD(model.parameters(), lr=1.0))
    acc.backward(model(torch.full((1, 2), 3.0)).sum())  # gradient (3, 3): norm 4.24
    result = acc.clip_gradients(model, optimizer, 0.5)  # Fabric: the third argument is clip_val
    return result, model.weight.grad.tolist()


def test_clip_gradients_takes_fabrics_positional_order():
    results = _on_both(_clip_third_positional)
    assert results["minifabric"] == results["lightning"] == (None, [[0.5, 0.5]])


def _clip_nonfinite(cls, error_if_nonfinite):
    acc = cls(accelerator="cpu", devices=1)
    model = nn.Linear(2, 1)
    model, optimizer = acc.setup(model, torch.optim.SGD(model.parameters(), lr=1.0))
    acc.backward(model(torch.tensor([[float("inf"), 1.0]])).sum())
    grads = [p.grad.clone() for p in model.parameters()]
    try:
        norm = acc.clip_gradients(model, optimizer, max_norm=1.0, error_if_nonfinite=error_if_nonfinite)
    except RuntimeError as err:
        unchanged = all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters(), strict=True))
        return "raised", "non-finite" in str(err), unchanged
    return "returned", float(norm)


def test_clip_gradients_raises_on_a_non_finite_norm_by_default():
    results = _on_both(lambda cls: _clip_nonfinite(cls, True))
    assert results["minifabric"] == results["lightning"] == ("raised", True, True)
    results = _on_both(lambda cls: _clip_nonfinite(cls, False))
    assert results["minifabric"] == results["lightning"] == ("returned", float("inf"))


# ---- 4: setup_dataloaders keeps a custom sampler on one device ---------------------------------


def _custom_sampler_order(cls):
    acc = cls(accelerator="cpu", devices=1)
    sampler = list(reversed(range(10)))  # any iterable with a length is a sampler
    loader = acc.setup_dataloaders(DataLoader(TensorDataset(torch.arange(10)), batch_size=5, sampler=sampler))
    weighted = WeightedRandomSampler([0.0] * 9 + [1.0], num_samples=4)
    only_last = acc.setup_dataloaders(DataLoader(TensorDataset(torch.arange(10)), sampler=weighted))
    return [b[0].tolist() for b in loader], [b[0].tolist() for b in only_last]


def test_setup_dataloaders_keeps_a_custom_sampler_on_one_device():
    results = _on_both(_custom_sampler_order)
    assert results["minifabric"] == results["lightning"] == ([[9, 8, 7, 6, 5], [4, 3, 2, 1, 0]], [[9]] * 4)


@pytest.mark.parametrize(("workers", "shuffle"), [(0, False), (1, False), (0, True)])
def test_iterating_a_set_up_loader_leaves_the_global_stream_where_fabric_leaves_it(workers, shuffle):
    def scenario(cls):
        acc = cls(accelerator="cpu", devices=1)
        cls.seed_everything(5)
        loader = acc.setup_dataloaders(
            DataLoader(
                TensorDataset(torch.arange(4)),
                batch_size=2,
                num_workers=workers,
                persistent_workers=workers > 0,
            )
        )
        draws = []
        for _ in range(3):
            for _ in loader:
                pass
            draws.append(torch.rand(1).item())  # noise drawn in the loop, as DCGAN's generator input
        return draws

    results = _on_both(scenario)
    assert results["minifabric"] == results["lightning"]


# ---- 5: seed_everything is a staticmethod --------------------------------------------------------


def test_seed_everything_on_the_class_seeds_what_it_is_given(monkeypatch):
    for cls in LIBRARIES.values():
        monkeypatch.setenv("PL_GLOBAL_SEED", "7")
        assert cls.seed_everything(3) == 3
        first = torch.rand(2)
        cls.seed_everything(3)
        assert torch.equal(first, torch.rand(2))


# ---- 6: mixed precision casts floating-point inputs --------------------------------------------


class _Records(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(2, 2)

    def forward(self, x, index):
        self.seen = (x.dtype, index.dtype)
        return (self.linear(x) * x).sum()


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision_casts_floating_point_inputs_to_the_compute_dtype(precision):
    def scenario(cls):
        acc = cls(accelerator="cpu", devices=1, precision=precision)
        model = acc.setup(_Records())
        out = model(torch.randn(3, 2), torch.arange(3))
        return model.seen, out.dtype

    results = _on_both(scenario)
    compute = torch.bfloat16 if precision == "bf16-mixed" else torch.float16
    if precision == "16-mixed":  # Fabric switches "16-mixed" to bf16 on CPU; minifabric does not
        assert results["lightning"][0][0] == torch.bfloat16
    else:
        assert results["minifabric"] == results["lightning"]
    assert results["minifabric"] == ((compute, torch.int64), torch.float32)


# ---- 7: "64-true" keeps complex tensors complex -----------------------------------------------


class _Complex(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(2, 2)
        self.register_buffer("phase", torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64))


def test_64_true_keeps_complex_tensors_complex():
    def scenario(cls):
        acc = cls(accelerator="cpu", devices=1, precision="64-true")
        model = acc.setup(_Complex())
        return model.linear.weight.dtype, model.phase.dtype, model.phase.tolist()

    results = _on_both(scenario)
    assert results["minifabric"] == results["lightning"]
    assert results["minifabric"][1] == torch.complex64
    assert results["minifabric"][2] == [1 + 2j, 3 - 1j]


# ---- 8: before launch(), a multi-process configuration -----------------------------------------


def test_before_launch_a_multi_process_run_reports_its_world_and_refuses_collectives():
    for cls in LIBRARIES.values():
        acc = cls(accelerator="cpu", devices=2, strategy="ddp")
        assert acc.world_size == 2
        for call in (
            acc.barrier,
            lambda acc=acc: acc.broadcast(1),
            lambda acc=acc: acc.all_reduce(torch.ones(1)),
            lambda acc=acc: acc.all_gather(torch.ones(1)),
        ):
            with pytest.raises(RuntimeError, match=r"\.launch\(\)"):
                call()


# ---- 9: all_gather on one process --------------------------------------------------------------


def test_all_gather_on_one_process_returns_fabrics_shapes():
    def scenario(cls):
        acc = cls(accelerator="cpu", devices=1)
        acc.launch()
        out = acc.all_gather({"t": torch.ones(3, 2), "n": 4})
        return tuple(out["t"].shape), tuple(out["n"].shape)

    results = _on_both(scenario)
    assert results["minifabric"] == results["lightning"] == ((3, 2), ())


def test_launching_again_is_a_no_op():
    for cls in LIBRARIES.values():
        acc = cls(accelerator="cpu", devices=1)
        acc.launch()
        assert acc.launch() is None


# ---- 14, 15: setting things up again ------------------------------------------------------------


def test_the_same_raw_model_can_be_set_up_again_and_optimizers_set_up_alone():
    def scenario(cls):
        acc = cls(accelerator="cpu", devices=1)
        torch.manual_seed(0)
        model = nn.Linear(2, 1)
        acc.setup_module(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        wrapped, optimizer = acc.setup(model, optimizer)
        acc.backward(wrapped(torch.ones(1, 2)).sum())
        optimizer.step()
        lone = acc.setup_optimizers(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))
        return model.weight.tolist(), type(lone).__name__.removeprefix("Fabric").removeprefix("Wrapped")

    results = _on_both(scenario)
    assert results["minifabric"] == results["lightning"]


@pytest.mark.parametrize("cls", list(LIBRARIES.values()))
def test_passing_set_up_objects_again_raises_value_error(cls):
    acc = cls(accelerator="cpu", devices=1)
    model = nn.Linear(2, 2)
    model, optimizer = acc.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    loader = acc.setup_dataloaders(DataLoader(TensorDataset(torch.arange(4))))
    for call in (
        lambda: acc.setup(model),
        lambda: acc.setup_module(model),
        lambda: acc.setup_optimizers(optimizer),
        lambda: acc.setup_dataloaders(loader),
    ):
        with pytest.raises(ValueError):
            call()


# ---- 17: the returned loader's device ------------------------------------------------------------


def test_the_returned_loader_has_a_device():
    for cls in LIBRARIES.values():
        acc = cls(accelerator="cpu", devices=1)
        dataset = TensorDataset(torch.arange(4))
        assert acc.setup_dataloaders(DataLoader(dataset)).device == torch.device("cpu")
        assert acc.setup_dataloaders(DataLoader(dataset), move_to_device=False).device is None


# ---- 18: launch(fn) checks fn first ---------------------------------------------------------------


def _no_arguments():
    return 1


def test_launch_checks_the_function_before_starting_anything():
    for cls in LIBRARIES.values():
        with pytest.raises(TypeError, match="callable"):
            cls(accelerator="cpu", devices=2).launch(_no_arguments())
        with pytest.raises(TypeError, match="argument"):
            cls(accelerator="cpu", devices=2).launch(_no_arguments)
        with pytest.raises(TypeError, match=r"ddp_spawn|DDPStrategy"):
            cls(accelerator="cpu", devices=2, strategy="ddp_spawn").launch()


# ---- 19: a plain loss.backward() where Fabric requires fabric.backward ---------------------------


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed", "32-true"])
def test_a_plain_backward_raises_where_fabric_requires_its_backward(precision):
    def scenario(cls):
        acc = cls(accelerator="cpu", devices=1, precision=precision)
        model = acc.setup(nn.Linear(2, 1))
        try:
            model(torch.ones(1, 2)).sum().backward()
        except RuntimeError as err:
            return "raised", "backward(loss)" in str(err)
        return "ran", model.weight.grad is not None

    results = _on_both(scenario)
    assert results["minifabric"] == results["lightning"]
    assert results["minifabric"][0] == ("ran" if precision == "32-true" else "raised")


# ---- 11: litgpt's pretrain.py initializes the model after init_module(empty_init=True) ------------


def test_init_applied_after_an_empty_init_module_raises_naming_the_parameter():
    """Fabric keeps the script's init (its meta construction draws nothing); minifabric equals eager
    construction, so it cannot reproduce an init written to meta tensors after the block: it refuses."""

    def scenario(cls):
        torch.manual_seed(0)
        acc = cls(accelerator="cpu", devices=1)
        with acc.init_module(empty_init=True):
            model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        model.apply(lambda m: nn.init.normal_(m.weight, std=0.02) if isinstance(m, nn.Linear) else None)
        try:
            model = acc.setup(model)
        except ValueError as err:
            return str(err)
        return model.module[0].weight.tolist()

    results = _on_both(scenario)
    assert isinstance(results["lightning"], list)  # Fabric ran
    message = results["minifabric"]
    assert isinstance(message, str), "minifabric set up a model whose init after the block was lost"
    assert "parameter '0.weight' of Sequential (in Linear)" in message
    assert "changed in place after `init_module(empty_init=True)` ended" in message
    assert "Move the init into the block" in message and "empty_init=False" in message


# ---- 21: a LightningModule-like module sees the accelerator ---------------------------------------


class _LightningLike(nn.Module):
    """What Fabric looks for in a ``LightningModule``: a ``_fabric`` attribute (lightning is not installed)."""

    def __init__(self):
        super().__init__()
        self._fabric = None
        self._fabric_optimizers = []
        self.layer = nn.Linear(2, 2)
        self.epochs = []

    def log(self, name, value):  # what LightningModule.log does under Fabric
        self._fabric.log(name, value)

    def on_train_epoch_end(self, epoch):
        self.epochs.append(epoch)


class _Logger:
    def __init__(self):
        self.rows = []

    def log_metrics(self, metrics, step=None):
        self.rows.append(metrics)


def test_a_real_lightning_module_logs_through_the_accelerator():
    pl = pytest.importorskip("pytorch_lightning")

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(2, 1)

        def training_step(self, batch):
            loss = self.layer(batch).pow(2).mean()
            self.log("loss", loss)
            return loss

    def scenario(cls):
        logger = _Logger()
        acc = cls(accelerator="cpu", devices=1, loggers=logger)
        torch.manual_seed(0)
        module = Module()
        model, optimizer = acc.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
        loss = model.training_step(torch.ones(3, 2))
        acc.backward(loss)
        optimizer.step()
        return (
            module.fabric is acc,
            module.logger is logger,
            [{k: round(v, 6) for k, v in row.items()} for row in logger.rows],
            len(module.optimizers()) if isinstance(module.optimizers(), list) else 1,
        )

    results = _on_both(scenario)
    assert results["minifabric"] == results["lightning"]
    assert results["minifabric"][:2] == (True, True)


def test_a_lightning_module_sees_the_accelerator_and_its_loggers():
    def scenario(cls):
        logger = _Logger()
        acc = cls(accelerator="cpu", devices=1, loggers=logger)
        module = _LightningLike()
        _, optimizer = acc.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
        module.log("loss", 1.5)
        acc.call("on_train_epoch_end", epoch=3)
        return module._fabric is acc, module._fabric_optimizers == [optimizer], logger.rows, module.epochs

    results = _on_both(scenario)
    assert results["minifabric"] == results["lightning"] == (True, True, [{"loss": 1.5}], [3])
