"""The GPU card: minifabric against hand-written PyTorch on one GPU, every number a ratio taken in one run.

Usage (from the repository root)::

    python benchmarks/bench_gpu.py --out gpu-card.json        # one GPU, ~0.94B GPT, bf16-mixed (<= 5 min)
    python benchmarks/bench_gpu.py --tiny --out /tmp/card.json  # CPU dry run of every path (seconds)

One process, world size 1 (nccl on CUDA; gloo with ``--tiny``). The model is ``tests.models.GPT``
(16 blocks, d=2048, 16 heads, vocab 32000, sequence 2048, untied), batch 4, AdamW, ``bf16-mixed``.
Each comparison builds both loops side by side and times them in interleaved rounds (order rotated
every round); a ratio is the median of the per-round ratios. Phases:

- ``init``: ``init_module(empty_init=True)`` + ``setup`` against the Fabric/torchtitan pattern
  (meta build, ``fully_shard``, ``to_empty(device)``, ``reset_parameters()`` on the device) and
  against eager construction on the device + ``setup``.
- ``step_eager`` / ``step_compiled``: ``strategy="fsdp"`` against a hand-written FSDP2 loop
  (``fully_shard`` per block then root, ``MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)``), eager and with each block compiled; tokens/s, MFU and peak memory of both.
- ``single``: ``strategy="single"`` against a plain ``torch.autocast`` loop.
- ``checkpoint``: save and load GB/s of the model and AdamW state against raw ``dcp.save`` /
  ``dcp.load`` of the same state (loads read what was just written: the page cache); and the time
  the loop loses to ``save(..., asynchronous=True)`` (the call, plus what the following steps take
  beyond a normal step, plus any wait) over a synchronous save, at the first and the third save,
  with the bytes each save copied by route (``handle.staged``: page-locked, device, pageable).

MFU counts 6N + 12*L*d*T FLOPs per token, N the parameters without the two embedding tables (a
lookup does no FLOPs; the untied output layer is a matmul and counts), against ``--peak-tflops``.
Peak memory is ``torch.cuda.max_memory_allocated`` over the loop's build and warm-up steps, minus
what was allocated before (the other loop's resident state); on CPU it is ``null`` (n/a on CPU).
A phase that fails is recorded with its error, the others still run, and the exit code is 1.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch import nn

from minifabric import Accelerator
from tests.models import GPT, GPTConfig, gpt_loss

PHASES = ("init", "step_eager", "checkpoint", "single", "step_compiled")
FULL = dict(cfg=GPTConfig(vocab_size=32000, block_size=2048, n_layer=16, n_head=16, n_embd=2048, tied=False),
            batch=4, rounds=5, steps=5, init_rounds=3, ckpt_rounds=2, warmup=2, backend="inductor")  # fmt: skip
TINY = dict(cfg=GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64, tied=False),
            batch=2, rounds=2, steps=1, init_rounds=2, ckpt_rounds=2, warmup=1, backend="eager")  # fmt: skip
NA_CPU = "n/a on CPU"


class Bench:
    """What every phase shares: the device, the FSDP accelerator, the model size, the batch."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.size = TINY if args.tiny else FULL
        self.cfg: GPTConfig = self.size["cfg"]
        self.device = torch.device("cpu" if args.tiny else "cuda", 0 if not args.tiny else None)
        self.cuda = self.device.type == "cuda"
        self.peak_tflops = args.peak_tflops
        self.dir = Path(args.dir or tempfile.mkdtemp(prefix="bench-gpu-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.backend = args.compile_backend or self.size["backend"]
        if self.cuda:
            torch.cuda.set_device(self.device)
        self.accelerator("fsdp")  # creates the process group the hand-written loops use too
        generator = torch.Generator().manual_seed(0)
        self.batch = torch.randint(
            0, self.cfg.vocab_size, (self.size["batch"], self.cfg.block_size + 1), generator=generator
        ).to(self.device)

    def accelerator(self, strategy: str) -> Accelerator:
        """A new launched accelerator for each model: an accelerator keeps every model it set up alive."""
        acc = Accelerator(accelerator=self.device.type, strategy=strategy, devices=1, precision="bf16-mixed")
        acc.launch()
        return acc

    def sync(self) -> None:
        """Wait for the GPU (nothing on the CPU)."""
        if self.cuda:
            torch.cuda.synchronize()

    def timed(self, fn: Callable[[], Any]) -> float:
        """Seconds ``fn()`` takes, the GPU work it queued included."""
        self.sync()
        start = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - start

    def free(self) -> None:
        """Collect garbage and return cached GPU blocks, so the next build starts alike."""
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def memory_start(self) -> int | None:
        """Reset the peak; the bytes allocated now (``None`` on the CPU)."""
        if not self.cuda:
            return None
        self.sync()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()

    def memory_peak(self, start: int | None) -> int | None:
        """The peak allocated since ``memory_start`` above what was allocated then."""
        return None if start is None else torch.cuda.max_memory_allocated() - start

    def tokens(self) -> int:
        """Tokens per step."""
        return self.batch.shape[0] * self.cfg.block_size

    def flops_per_token(self) -> int:
        """6N + 12*L*d*T, N without the embedding tables (lookups do no FLOPs)."""
        with torch.device("meta"):
            model = GPT(self.cfg)
        tables = {id(p) for p in (*model.wte.parameters(), *model.wpe.parameters())}
        n = sum(p.numel() for p in model.parameters() if id(p) not in tables)
        return 6 * n + 12 * self.cfg.n_layer * self.cfg.n_embd * self.cfg.block_size

    def throughput(self, step_seconds: float) -> dict[str, float]:
        """Step time, tokens/s and MFU against ``--peak-tflops``."""
        tokens_per_s = self.tokens() / step_seconds
        return {
            "step_s": step_seconds,
            "tokens_per_s": tokens_per_s,
            "mfu": tokens_per_s * self.flops_per_token() / (self.peak_tflops * 1e12),
        }


# ---- the hand-written references --------------------------------------------------------------


def init_weights(model: GPT, device: torch.device) -> None:
    """What a torchtitan-style ``init_weights`` does after ``to_empty``: every module's own init, buffers refilled."""
    with torch.no_grad():
        for module in model.modules():
            if module is not model and hasattr(module, "reset_parameters"):
                module.reset_parameters()
        model.positions.copy_(torch.arange(model.cfg.block_size, device=device))


def hand_fsdp(bench: Bench, compiled: bool) -> GPT:
    """Meta build, ``fully_shard`` per block then root (bf16 params, fp32 reduce), ``to_empty``, init."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(bench.device.type, (1,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    with torch.device("meta"):
        model = GPT(bench.cfg)
    for block in model.blocks:
        if compiled:
            block.compile(backend=bench.backend)
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    model.to_empty(device=bench.device)
    init_weights(model, bench.device)
    return model


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer of every loop."""
    return torch.optim.AdamW(model.parameters(), lr=1e-4)


def minifabric_step(acc: Accelerator, model: nn.Module, optimizer: Any, batch: torch.Tensor) -> Callable[[], None]:
    """One training step through the accelerator."""
    def step() -> None:
        acc.backward(gpt_loss(model, batch))
        optimizer.step()
        optimizer.zero_grad()

    return step


def plain_step(model: nn.Module, optimizer: Any, batch: torch.Tensor, autocast: Any = None) -> Callable[[], None]:
    """One hand-written training step (forward under ``autocast()`` when given)."""
    def step() -> None:
        if autocast is None:
            loss = gpt_loss(model, batch)
        else:
            with autocast():
                loss = gpt_loss(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


# ---- timing ------------------------------------------------------------------------------------


def interleaved(bench: Bench, loops: dict[str, Callable[[], Any]], rounds: int, steps: int) -> dict[str, list[float]]:
    """Per-round mean time of one call of each loop; the loops alternate, the order rotating each round."""
    times: dict[str, list[float]] = {name: [] for name in loops}
    names = list(loops)
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(bench.timed(lambda loop=loops[name]: [loop() for _ in range(steps)]) / steps)
    return times


def ratio(times: dict[str, list[float]], a: str, b: str) -> dict[str, Any]:
    """``a`` over ``b`` in each round, and the median of those ratios."""
    per_round = [x / y for x, y in zip(times[a], times[b], strict=True)]
    return {"median": statistics.median(per_round), "per_round": per_round}


def warm(bench: Bench, step: Callable[[], None], memory: int | None) -> int | None:
    """Warm-up steps; the loop's peak memory since ``memory`` (its build included)."""
    for _ in range(bench.size["warmup"]):
        step()
    bench.sync()
    return bench.memory_peak(memory)


# ---- phases ------------------------------------------------------------------------------------


def compare(bench: Bench, ref: str, ours: Callable[[], Callable], theirs: Callable[[], Callable]) -> dict[str, Any]:
    """Build minifabric's loop, then the reference ``ref`` (each warmed up: peak memory over build and
    warm-up, the other loop's resident state subtracted), then time them interleaved."""
    steps: dict[str, Callable[[], Any]] = {}
    memory: dict[str, int | None] = {}
    for name, build in (("minifabric", ours), (ref, theirs)):
        start = bench.memory_start()
        torch.manual_seed(0)
        steps[name] = build()
        memory[name] = warm(bench, steps[name], start)
    times = interleaved(bench, steps, bench.size["rounds"], bench.size["steps"])
    result: dict[str, Any] = {f"minifabric_over_{ref}": ratio(times, "minifabric", ref), "per_round_s": times}
    for name in steps:
        result[name] = {**bench.throughput(statistics.median(times[name])), "peak_memory_bytes": memory[name]}
    ours_bytes, ref_bytes = memory["minifabric"], memory[ref]
    result["peak_memory_ratio"] = ours_bytes / ref_bytes if ours_bytes and ref_bytes else None
    return result


def phase_step(bench: Bench, compiled: bool) -> dict[str, Any]:
    """``strategy="fsdp"`` against hand-written FSDP2, eager or with each block compiled."""
    def ours() -> Callable[[], None]:
        acc = bench.accelerator("fsdp")
        with acc.init_module(empty_init=True):
            model = GPT(bench.cfg)
        compiled_model = torch.compile(model, backend=bench.backend) if compiled else model
        model, optimizer = acc.setup(compiled_model, adamw(model))
        return minifabric_step(acc, model, optimizer, bench.batch)

    def theirs() -> Callable[[], None]:
        hand = hand_fsdp(bench, compiled)
        return plain_step(hand, adamw(hand), bench.batch)

    return compare(bench, "fsdp2_by_hand", ours, theirs)


def phase_single(bench: Bench) -> dict[str, Any]:
    """``strategy="single"`` against a plain ``torch.autocast`` loop."""
    def ours() -> Callable[[], None]:
        acc = bench.accelerator("single")
        with acc.init_module():
            model = GPT(bench.cfg)
        model, optimizer = acc.setup(model, adamw(model))
        return minifabric_step(acc, model, optimizer, bench.batch)

    def theirs() -> Callable[[], None]:
        with bench.device:
            plain = GPT(bench.cfg)
        autocast = lambda: torch.autocast(bench.device.type, dtype=torch.bfloat16)  # noqa: E731
        return plain_step(plain, adamw(plain), bench.batch, autocast)

    return compare(bench, "autocast_by_hand", ours, theirs)


def phase_init(bench: Bench) -> dict[str, Any]:
    """Meta init + setup against the torchtitan pattern and against eager construction + setup."""
    def build(kind: str) -> Callable[[], None]:
        def run() -> None:
            torch.manual_seed(0)
            if kind == "torchtitan_pattern":
                hand_fsdp(bench, compiled=False)
                return
            acc = bench.accelerator("fsdp")
            with acc.init_module(empty_init=kind == "minifabric_meta"):
                model = GPT(bench.cfg)
            acc.setup(model)

        return run

    kinds = ("minifabric_meta", "torchtitan_pattern", "eager_then_setup")
    builds = {kind: build(kind) for kind in kinds}
    # the first build of each kind pays one-time imports and kernel loads: not timed
    for run in builds.values():
        run()
        bench.free()
    loops = {kind: (lambda run=run: (run(), bench.free())) for kind, run in builds.items()}
    times = interleaved(bench, loops, bench.size["init_rounds"], 1)
    return {
        "minifabric_meta_over_torchtitan_pattern": ratio(times, "minifabric_meta", "torchtitan_pattern"),
        "minifabric_meta_over_eager_then_setup": ratio(times, "minifabric_meta", "eager_then_setup"),
        "median_s": {kind: statistics.median(t) for kind, t in times.items()},
        "per_round_s": times,
        "note": "each timing includes freeing the model (gc, empty_cache), alike for all three",
        "partial_draws_exact": partial_draws_exact(bench),
        "construction_s_by_ranks": construction_by_ranks(bench),
    }


def construction_by_ranks(bench: Bench) -> dict[str, float]:
    """Seconds of one rank's construction under ``init_module(empty_init=True)`` as rank 0 of an FSDP
    world of 1 and of 8 (``keep``): it draws only its rows of dense fills where it can, so the
    second should cost less than the first (each median of ``init_rounds`` builds)."""
    from minifabric.init import meta_init_context

    def build(parts: int) -> None:
        torch.manual_seed(0)
        with meta_init_context(keep=(parts, 0), device=bench.device):
            GPT(bench.cfg)

    out = {}
    for parts in (1, 8):
        build(parts)  # warm
        out[f"1 of {parts}"] = statistics.median(bench.timed(lambda p=parts: build(p)) for _ in range(bench.size["init_rounds"]))
        bench.free()
    return out


def partial_draws_exact(bench: Bench) -> dict[str, Any]:
    """Whether ranks under FSDP draw only their rows of dense fills on this GPU (the self-test of the
    round arithmetic, per op and dtype): where not, meta init draws whole tensors (exact, slower)."""
    if not bench.cuda:
        return {"all": NA_CPU}
    from minifabric._torch.philox import replay_is_exact

    ops = {"normal_": torch.ops.aten.normal_.default, "uniform_": torch.ops.aten.uniform_.default}
    dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
    return {f"{name} {dtype}": replay_is_exact(bench.device, op, dtype) for name, op in ops.items() for dtype in dtypes}


def phase_checkpoint(bench: Bench) -> dict[str, Any]:
    """Save/load rates against raw DCP and the async-save loss (``gpu_checkpoint.py``)."""
    from benchmarks.gpu_checkpoint import measure_checkpoints

    acc = bench.accelerator("fsdp")
    torch.manual_seed(0)
    with acc.init_module(empty_init=True):
        model = GPT(bench.cfg)
    model, optimizer = acc.setup(model, adamw(model))
    step = minifabric_step(acc, model, optimizer, bench.batch)
    step()  # AdamW state exists
    return measure_checkpoints(bench, acc, model, optimizer, step)


# ---- the card ----------------------------------------------------------------------------------


def table(card: dict[str, Any]) -> str:
    """The card's ratios and absolute numbers as a short text table (a phase not run or failed says so)."""

    def fmt(value: Any, spec: str = ".3f") -> str:
        return "n/a" if value is None else format(value, spec)

    def mib(value: Any) -> str:
        return NA_CPU if value is None else f"{value / 2**20:.0f} MiB"

    rows = []
    for phase in PHASES:
        data = card.get(phase)
        if data is None or "error" in data:
            rows.append(f"{phase:14s} {'not run' if data is None else 'FAILED: ' + data['error']}")
            continue
        if phase == "init":
            rows.append(f"{phase:14s} meta+setup / torchtitan pattern {fmt(data['minifabric_meta_over_torchtitan_pattern']['median'])}")
            rows.append(f"{'':14s} meta+setup / eager+setup       {fmt(data['minifabric_meta_over_eager_then_setup']['median'])}")
            by_ranks = data.get("construction_s_by_ranks", {})
            rows.append(f"{'':14s} construction as 1 of 1 / 1 of 8 ranks: {fmt(by_ranks.get('1 of 1'))} s / {fmt(by_ranks.get('1 of 8'))} s")
        elif phase == "checkpoint":
            rows.append(f"{phase:14s} save rate minifabric/raw dcp   {fmt(data['save_minifabric_over_raw_dcp_rate'])}"
                        f"  ({fmt(data['save_gb_per_s']['minifabric'], '.2f')} GB/s)")
            rows.append(f"{'':14s} load rate minifabric/raw dcp   {fmt(data['load_minifabric_over_raw_dcp_rate'])}"
                        f"  ({fmt(data['load_gb_per_s']['minifabric'], '.2f')} GB/s)")
            rows.append(f"{'':14s} async loss / sync save: first {fmt(data['async_first']['lost_over_sync_save'])},"
                        f" steady {fmt(data['async_steady']['lost_over_sync_save'])}")
        else:
            ref = "autocast_by_hand" if phase == "single" else "fsdp2_by_hand"
            rows.append(f"{phase:14s} minifabric/{ref} step time {fmt(data[f'minifabric_over_{ref}']['median'])}")
            for loop in ("minifabric", ref):
                rows.append(f"{'':14s}   {loop:17s} {fmt(data[loop]['tokens_per_s'], '.0f')} tokens/s,"
                            f" MFU {fmt(data[loop]['mfu'])}, peak {mib(data[loop]['peak_memory_bytes'])}")
    return "\n".join(rows)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Run the phases, write the card after each, print the table; 1 if a phase failed."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the JSON file to write")
    parser.add_argument("--tiny", action="store_true", help="CPU dry run with a tiny model (gloo, world size 1)")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="the device's dense bf16 peak (H100/H200: 989)")
    parser.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES))
    parser.add_argument("--compile-backend", default=None, help="torch.compile backend (default: inductor; eager with --tiny)")
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: a new temporary folder)")
    args = parser.parse_args(argv)
    if not args.tiny and not torch.cuda.is_available():
        parser.error("no CUDA device: run on a GPU, or pass --tiny for the CPU dry run")
    bench = Bench(args)
    card: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if bench.cuda else "cpu",
        "torch": torch.__version__,
        "tiny": args.tiny,
        "model": {**vars(bench.cfg), "batch": bench.size["batch"]},
        "flops_per_token": bench.flops_per_token(),
        "peak_tflops": args.peak_tflops,
        "precision": "bf16-mixed",
        "compile_backend": bench.backend,
        "memory_note": "torch.cuda.max_memory_allocated minus what was allocated before" if bench.cuda else NA_CPU,
    }  # fmt: skip
    with torch.device("meta"):
        card["model"]["params"] = sum(p.numel() for p in GPT(bench.cfg).parameters())
    out = Path(args.out)
    runs = {"init": phase_init, "step_eager": lambda b: phase_step(b, False), "checkpoint": phase_checkpoint,
            "single": phase_single, "step_compiled": lambda b: phase_step(b, True)}  # fmt: skip
    failed = []
    for name in args.phases:
        start = time.perf_counter()
        try:
            card[name] = runs[name](bench)
        except BaseException as err:  # recorded, and the run exits 1 (DCP's CheckpointException is a BaseException)
            if isinstance(err, (KeyboardInterrupt, SystemExit)):
                raise
            traceback.print_exc()
            card[name] = {"error": f"{type(err).__name__}: {err}"}
            failed.append(name)
        card[name]["phase_wall_s"] = time.perf_counter() - start
        bench.free()
        if bench.cuda:  # what the phase left allocated: a model kept alive would show here
            card[name]["allocated_after_bytes"] = torch.cuda.memory_allocated()
        out.write_text(json.dumps(card, indent=1))
        print(f"[bench_gpu] {name} done in {card[name]['phase_wall_s']:.1f} s", flush=True)
    if args.dir is None:
        shutil.rmtree(bench.dir, ignore_errors=True)
    print(table(card))
    if failed:
        print(f"[bench_gpu] failed phases: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
