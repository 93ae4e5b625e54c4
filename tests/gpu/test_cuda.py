"""CUDA tier: the same checks as on CPU, on one GPU. Skipped cleanly where CUDA is not available."""

import pytest
import torch

from minifabric import Accelerator
from tests.helpers import run_distributed
from tests.models import GPT, GPTConfig, gpt_loss, gpt_optimizer, token_batches

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)


def test_single_device_trains_on_cuda_with_batches_moved():
    acc = Accelerator(accelerator="cuda", devices=1, precision="bf16-mixed")
    acc.launch()
    acc.seed_everything(0)
    model = GPT(CFG)
    model, optimizer = acc.setup(model, gpt_optimizer(model))
    assert acc.device.type == "cuda" and next(model.parameters()).is_cuda
    data = torch.utils.data.TensorDataset(token_batches(1, 8, CFG)[0])
    loader = acc.setup_dataloaders(torch.utils.data.DataLoader(data, batch_size=4))
    losses = []
    for _ in range(3):
        for (batch,) in loader:
            assert batch.is_cuda
            loss = gpt_loss(model, batch)
            acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_fp16_mixed_scales_the_loss_and_skips_inf_steps_on_cuda():
    acc = Accelerator(accelerator="cuda", devices=1, precision="16-mixed")
    acc.launch()
    model = torch.nn.Linear(8, 8)
    model, optimizer = acc.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    scale = acc.precision.scaler.get_scale()
    before = model.weight.detach().clone()
    acc.backward(model(torch.randn(4, 8, device=acc.device)).sum() * float("inf"))
    optimizer.step()
    assert torch.equal(model.weight, before)  # the inf step was skipped
    assert acc.precision.scaler.get_scale() < scale


def _fsdp_on_one_gpu(rank):
    acc = Accelerator(accelerator="cuda", strategy="fsdp", devices=1, precision="bf16-mixed")
    acc.launch()
    acc.seed_everything(0)
    with acc.init_module(empty_init=True):
        model = GPT(CFG)
    optimizer = gpt_optimizer(model)
    model, optimizer = acc.setup(model, optimizer)
    batches = token_batches(4, 4, CFG).to(acc.device)
    losses = []
    for batch in batches:
        loss = gpt_loss(model, batch)
        acc.backward(loss)
        acc.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_fsdp_with_meta_init_trains_on_one_gpu():
    (losses,) = run_distributed(_fsdp_on_one_gpu, 1, timeout=300)
    assert all(torch.isfinite(torch.tensor(losses)))


def test_async_save_of_a_cuda_model_is_the_state_at_the_call(tmp_path):
    """The copy to page-locked CPU memory is taken before the call returns; later in-place updates stay out."""
    acc = Accelerator(accelerator="cuda", devices=1)
    acc.launch()
    model = torch.nn.Linear(64, 64)
    model, optimizer = acc.setup(model, torch.optim.AdamW(model.parameters(), lr=0.1))
    acc.backward(model(torch.randn(4, 64, device="cuda")).sum())
    optimizer.step()
    expected = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    handle = acc.save(tmp_path / "ckpt.pt", {"model": model, "optimizer": optimizer}, asynchronous=True)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    handle.wait()
    fresh = torch.nn.Linear(64, 64)
    acc.load_raw(tmp_path / "ckpt.pt", fresh)
    for key, value in fresh.state_dict().items():
        assert torch.equal(value.cpu(), expected[key]), key
