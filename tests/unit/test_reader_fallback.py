"""The shard reader parses torch.save's archive format itself; a record it does not recognise (another
torch version's layout, a compressed entry, tensor metadata) is read by ``torch.load(weights_only=True)``.

The range of torch versions the package admits is the range that runs these tests (see pyproject.toml);
this test makes every record unrecognised, so the fallback alone must read every layout exactly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from minifabric.checkpoint import archive, reader
from minifabric.checkpoint import read as sharded

pytestmark = pytest.mark.filterwarnings("ignore:.*assuming the intent is to save in a single process")


def test_records_the_parser_does_not_recognise_are_read_by_torch_load(tmp_path: Path, monkeypatch) -> None:
    torch.manual_seed(0)
    saved = {
        "f32": torch.randn(5, 7),
        "bf16": torch.randn(4, 3).bfloat16(),
        "i64": torch.arange(10),
        "transposed": torch.randn(6, 5).t(),
        "sliced": torch.randn(10, 4)[2:5],
        "scalar": torch.tensor(3.5),
    }
    dcp.save(dict(saved), storage_writer=dcp.FileSystemWriter(tmp_path), no_dist=True)
    unrecognised: list[int] = []

    def unknown_layout(file, start, length):
        unrecognised.append(start)
        raise archive.NotPlain("a layout this parser does not know")

    loads: list[bool] = []
    real_load = torch.load

    def counting_load(*args, **kwargs):
        loads.append(kwargs.get("weights_only"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(reader, "locate", unknown_layout)
    monkeypatch.setattr(torch, "load", counting_load)
    for views in ((), set(saved)):
        targets = {key: torch.full_like(value.contiguous(), 7) for key, value in saved.items()}
        sharded.read_tensors(tmp_path, targets, views=views)
        for key, value in saved.items():
            assert torch.equal(targets[key], value), key
    assert unrecognised and len(loads) >= 2 * len(saved)  # every tensor went through the fallback ...
    assert all(flag is True for flag in loads)  # ... which never unpickles code


def test_an_older_torch_than_the_tested_range_is_refused_at_import() -> None:
    from minifabric._torch import check_torch_version

    for inside in ("2.11.0", "2.13.0+cpu", "2.15.0", "2.16.0.dev20261201"):
        check_torch_version(inside)
    with pytest.raises(ImportError, match=r"supports torch 2\.11 to 2\.15 .*found torch==2\.10\.0"):
        check_torch_version("2.10.0")


def test_the_package_admits_exactly_the_tested_range() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    from minifabric._torch.versions import MAX_TORCH_VERSION, MIN_TORCH_VERSION

    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    (torch_requirement,) = [dep for dep in project["dependencies"] if dep.startswith("torch")]
    low, high = MIN_TORCH_VERSION, (MAX_TORCH_VERSION[0], MAX_TORCH_VERSION[1] + 1)
    assert torch_requirement == f"torch>={low[0]}.{low[1]},<{high[0]}.{high[1]}"
