"""README.md's benchmark table is what ``benchmarks/table.py`` renders from ``benchmarks/results.json``,
and a ``bench_gpu.py`` card merges into both with one command."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest

from benchmarks import table
from tests.helpers import PYTHON, REPO, run_command
from tests.unit.test_bench_gpu import FIELDS, RATIOS


def _results() -> dict:
    return json.loads(table.RESULTS.read_text())


def _card(device: str = "NVIDIA H200") -> dict:
    """A card with the keys bench_gpu.py writes (the ones tests/unit/test_bench_gpu.py checks), each
    value distinct so that the rendered table shows where it came from."""
    card = {"device": device, "torch": "2.99.0+cu999", "tiny": False, "peak_tflops": 989.0,
            "precision": "bf16-mixed", "flops_per_token": 5.6e9,
            "model": {"vocab_size": 32000, "block_size": 2048, "n_layer": 16, "n_head": 16, "n_embd": 2048,
                      "tied": False, "batch": 4, "params": 940_000_000}}  # fmt: skip
    value = iter(range(1, 1000))
    for phase, groups in FIELDS.items():
        card[phase] = {}
        for group, keys in groups.items():
            card[phase][group] = {}
            for key in keys:
                n = next(value)
                card[phase][group][key] = (
                    [1 + n / 1000, 1 + (n + 1) / 1000] if key == "per_round" else 1 + n / 1000
                )
        if phase != "init" and phase != "checkpoint":
            card[phase]["peak_memory_ratio"] = 1.0 + next(value) / 1000
    for phase, keys in RATIOS.items():
        for key in keys:
            card[phase][key] = (
                1e9 * (1 + next(value) / 1000) if key == "state_bytes" else 1 + next(value) / 1000
            )
    return card


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    """Copies of results.json and README.md to merge into, and the arguments that point at them."""
    paths = {"results": tmp_path / "results.json", "readme": tmp_path / "README.md"}
    shutil.copy(table.RESULTS, paths["results"])
    shutil.copy(table.README, paths["readme"])
    return paths


def _outside(readme: str) -> str:
    return readme[: readme.index(table.START)] + readme[readme.index(table.END) :]


def _args(files: dict[str, Path]) -> list[str]:
    return ["--results", str(files["results"]), "--readme", str(files["readme"])]


def _merge(files: dict[str, Path], card: dict, tmp_path: Path, name: str = "gpu-card.json") -> int:
    path = tmp_path / name
    path.write_text(json.dumps(card))
    return table.main(["--gpu-card", str(path), *_args(files)])


def test_readme_table_is_what_the_generator_writes_from_results():
    readme = table.README.read_text()
    expected = table.rewrite(readme, table.render(_results(), table.DETAILS.read_text()))
    assert readme == expected, "README.md's benchmark table is stale: run `python benchmarks/table.py`"
    assert table.main(["--check"]) == 0


def test_check_fails_on_a_stale_table_and_writes_nothing(files, capsys):
    readme = files["readme"].read_text()
    stale = readme.replace("| 0.993 (median", "| 0.99 (median", 1)
    assert stale != readme
    files["readme"].write_text(stale)
    assert table.main(["--check", *_args(files)]) == 1
    assert "0.993 (median" in capsys.readouterr().err
    assert files["readme"].read_text() == stale


def test_every_row_names_its_machine_command_and_a_section_that_exists():
    headings = table.anchors(table.DETAILS.read_text())
    for row in _results()["rows"]:
        table.check_row(row)
        assert row["section"] in headings, row["key"]
        assert "benchmarks/" in row["command"], row["key"]
    gpu = [row for row in _results()["rows"] if "device" in row]
    assert gpu and all(row["device"] in row["machine"] and row["torch"] in row["machine"] for row in gpu)


def test_a_row_that_cannot_be_rendered_raises_naming_it():
    results = _results()
    broken = copy.deepcopy(results)
    broken["rows"][0]["result"] = "{missing:.2f}"
    with pytest.raises(ValueError, match=rf"{broken['rows'][0]['key']}.*missing"):
        table.render(broken, table.DETAILS.read_text())
    broken = copy.deepcopy(results)
    broken["rows"][0]["section"] = "No such heading"
    with pytest.raises(ValueError, match="No such heading"):
        table.render(broken, table.DETAILS.read_text())
    broken = copy.deepcopy(results)
    broken["rows"][0]["values"]["median"] = "0.99"
    with pytest.raises(ValueError, match="is not a number"):
        table.render(broken, table.DETAILS.read_text())


def test_a_card_replaces_the_rows_of_its_device(files, tmp_path):
    before = json.loads(files["results"].read_text())["rows"]
    card = _card("NVIDIA H200")
    assert _merge(files, card, tmp_path) == 0
    after = json.loads(files["results"].read_text())["rows"]
    old_gpu = [r for r in before if r.get("device") == "NVIDIA H200"]
    new_gpu = [r for r in after if r.get("device") == "NVIDIA H200"]
    assert [r["key"] for r in new_gpu] == [r["key"] for r in old_gpu]
    assert all(r["card"] == "gpu-card.json" and "torch 2.99.0+cu999" in r["machine"] for r in new_gpu)
    assert [r for r in after if "device" not in r] == [r for r in before if "device" not in r]
    rows = {r["key"]: r for r in new_gpu}
    assert (
        rows["gpu_step_eager"]["values"]["ratio"]
        == card["step_eager"]["minifabric_over_fsdp2_by_hand"]["median"]
    )
    assert (
        rows["gpu_step_compiled"]["values"]["ratio"]
        == card["step_compiled"]["minifabric_over_fsdp2_by_hand"]["median"]
    )
    assert (
        rows["gpu_single"]["values"]["ratio"] == card["single"]["minifabric_over_autocast_by_hand"]["median"]
    )
    assert (
        rows["gpu_init"]["values"]["ratio"]
        == card["init"]["minifabric_meta_over_torchtitan_pattern"]["median"]
    )
    assert (
        rows["gpu_async_save"]["values"]["first"] == card["checkpoint"]["async_first"]["lost_over_sync_save"]
    )
    assert (
        rows["gpu_async_save"]["values"]["steady"]
        == card["checkpoint"]["async_steady"]["lost_over_sync_save"]
    )
    assert (
        rows["gpu_save_load"]["values"]["save_ratio"]
        == card["checkpoint"]["save_minifabric_over_raw_dcp_rate"]
    )
    readme = files["readme"].read_text()
    for row in new_gpu:
        assert table.render_result(row) in readme
    assert "7.6 s of it CPU-generator replay" not in readme  # the old H200 rows are gone
    assert table.main(["--check", *_args(files)]) == 0
    assert _outside(readme) == _outside(table.README.read_text())  # nothing outside the markers changed


def test_another_card_gets_rows_of_its_own_and_a_partial_card_keeps_the_rest(files, tmp_path):
    before = json.loads(files["results"].read_text())["rows"]
    card = {
        k: v for k, v in _card("Fake GPU 80GB").items() if k not in ("step_compiled", "single", "checkpoint")
    }
    assert _merge(files, card, tmp_path, "fake.json") == 0
    after = json.loads(files["results"].read_text())["rows"]
    assert after[: len(before)] == before
    assert [r["key"] for r in after[len(before) :]] == ["gpu_step_eager", "gpu_init"]
    readme = files["readme"].read_text()
    assert "Measured on one Fake GPU 80GB, torch 2.99.0+cu999" in readme
    assert "Measured on one NVIDIA H200, torch 2.11" in readme
    again = _card("Fake GPU 80GB")
    again["init"]["minifabric_meta_over_torchtitan_pattern"]["median"] = 1.25
    again = {
        k: v for k, v in again.items() if k not in ("step_eager", "step_compiled", "single", "checkpoint")
    }
    assert _merge(files, again, tmp_path, "fake.json") == 0
    merged = json.loads(files["results"].read_text())["rows"]
    assert merged[len(before) + 1]["values"]["ratio"] == 1.25  # replaced in place
    assert merged[len(before)] == after[len(before)]  # the step row, not in this card, kept


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: c.update(tiny=True, device="cpu"), "--tiny CPU dry run"),
        (lambda c: c["init"].update(error="RuntimeError: CUDA out of memory"), r"phases \['init'\] failed"),
        (lambda c: [c.pop(p) for p in FIELDS], "holds none of the phases"),
        (lambda c: c.pop("device"), "is not a bench_gpu.py card"),
        (lambda c: c["checkpoint"].pop("async_first"), "lacks 'async_first'"),
    ],
    ids=["tiny", "failed-phase", "no-phase", "no-device", "missing-key"],
)
def test_a_card_that_is_not_a_gpu_measurement_is_refused_and_nothing_is_written(
    files, tmp_path, change, message
):
    card = _card()
    change(card)
    results, readme = files["results"].read_bytes(), files["readme"].read_bytes()
    with pytest.raises(ValueError, match=message):
        _merge(files, card, tmp_path)
    assert files["results"].read_bytes() == results and files["readme"].read_bytes() == readme


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_card_of_the_tiny_dry_run_merges_once_it_names_a_device(files, tmp_path):
    """The keys the merge reads are the ones bench_gpu.py writes (its --tiny dry run, every phase)."""
    out = tmp_path / "card.json"
    cmd = [
        PYTHON,
        str(REPO / "benchmarks" / "bench_gpu.py"),
        "--tiny",
        "--out",
        str(out),
        "--dir",
        str(tmp_path / "ckpt"),
    ]
    result = run_command(cmd, timeout=540)
    assert result.returncode == 0, result.stdout + result.stderr
    card = json.loads(out.read_text())
    with pytest.raises(ValueError, match="--tiny CPU dry run"):
        table.gpu_rows(card)
    card.update(tiny=False, device="Dry-run device")
    rows = table.gpu_rows(card)
    assert [r["key"] for r in rows] == [
        "gpu_step_eager", "gpu_step_compiled", "gpu_single", "gpu_init", "gpu_async_save", "gpu_save_load",
    ]  # fmt: skip
    assert _merge(files, card, tmp_path) == 0
    readme = files["readme"].read_text()
    assert "Measured on one Dry-run device" in readme
    assert "the hand-written loop's n/a" in readme  # peak memory: None on CPU
    assert table.main(["--check", *_args(files)]) == 0
