"""A run on one GPU whose rank raises at step 2 (for test_cuda_faults.py).

    python tests/gpu/raise_on_cuda.py DEVICE STRATEGY

Prints ``STEP n`` after each step; at step 2 raises ``RuntimeError("planned failure on DEVICE")``.
"""

import sys

import torch

from minifabric import Accelerator
from tests.gpu.common import CFG, batches
from tests.models import GPT, gpt_loss

if __name__ == "__main__":
    device, strategy = sys.argv[1], sys.argv[2]
    acc = Accelerator(accelerator=device, strategy=strategy, devices=1)
    acc.launch()
    model = GPT(CFG)
    model, optimizer = acc.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for step, batch in enumerate(batches(4).to(acc.device), start=1):
        if step == 2:
            raise RuntimeError(f"planned failure on {device}")
        acc.backward(gpt_loss(model, batch))
        optimizer.step()
        optimizer.zero_grad()
        print(f"STEP {step}", flush=True)
