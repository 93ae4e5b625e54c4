"""``minifabric run``: flags -> torchrun arguments and the settings the script's Accelerator reads."""

import os
import sys

import pytest

import minifabric
from minifabric import cli
from tests.helpers import run_command


@pytest.fixture
def torchrun(monkeypatch):
    """Capture what ``minifabric run`` hands to torchrun instead of starting processes."""
    calls = []
    monkeypatch.setattr("torch.distributed.run.main", lambda args: calls.append((args, dict(os.environ))))
    return calls


def test_run_builds_the_torchrun_command_line(torchrun):
    cli.main(["run", "--devices", "2", "--main-port", "29611", "train.py", "--lr", "0.1"])
    ((args, _),) = torchrun
    assert args == [
        "--nproc-per-node=2",
        "--nnodes=1",
        "--node-rank=0",
        "--master-addr=127.0.0.1",
        "--master-port=29611",
        "--module",
        "minifabric.runtime.run_script",
        "train.py",
        "--lr",
        "0.1",
    ]


def test_multi_node_flags(torchrun):
    cli.main(
        [
            "run",
            "--num-nodes",
            "2",
            "--node-rank",
            "1",
            "--main-address",
            "10.0.0.1",
            "--main-port",
            "1234",
            "t.py",
        ]
    )
    ((args, env),) = torchrun
    assert "--nnodes=2" in args and "--node-rank=1" in args
    assert "--master-addr=10.0.0.1" in args and "--master-port=1234" in args
    assert env["MINIFABRIC_NUM_NODES"] == "2"


def test_settings_reach_the_script_through_the_environment(torchrun, monkeypatch):
    for var in ("MINIFABRIC_STRATEGY", "MINIFABRIC_PRECISION", "MINIFABRIC_ACCELERATOR"):
        monkeypatch.delenv(var, raising=False)
    cli.main(
        [
            "run",
            "--devices",
            "2",
            "--strategy",
            "ddp",
            "--precision",
            "bf16-mixed",
            "--accelerator",
            "cpu",
            "t.py",
        ]
    )
    ((_, env),) = torchrun
    assert env["MINIFABRIC_DEVICES"] == "2"
    assert env["MINIFABRIC_STRATEGY"] == "ddp"
    assert env["MINIFABRIC_PRECISION"] == "bf16-mixed"
    assert env["MINIFABRIC_ACCELERATOR"] == "cpu"
    assert env["OMP_NUM_THREADS"]
    # only for torchrun's start: the calling process's environment is as it was
    assert "MINIFABRIC_STRATEGY" not in os.environ and "MINIFABRIC_PRECISION" not in os.environ


def test_devices_auto_on_cpu_is_one(torchrun):
    cli.main(["run", "--devices", "auto", "--accelerator", "cpu", "t.py"])
    assert "--nproc-per-node=1" in torchrun[0][0]


@pytest.mark.parametrize("argv", [["run", "--devices", "0", "t.py"], ["run", "--devices", "two", "t.py"]])
def test_bad_devices_exit_with_a_message(torchrun, argv, capsys):
    with pytest.raises(SystemExit, match="--devices="):
        cli.main(argv)
    assert not torchrun


@pytest.mark.parametrize("flag", ["--strategy", "--precision", "--accelerator"])
def test_unknown_choices_are_refused(torchrun, flag, capsys):
    with pytest.raises(SystemExit):
        cli.main(["run", flag, "nonsense", "t.py"])
    assert f"argument {flag}: unknown value 'nonsense'" in capsys.readouterr().err
    assert not torchrun


def test_a_typo_gets_the_closest_value(torchrun, capsys):
    with pytest.raises(SystemExit):
        cli.main(["run", "--strategy", "fdsp", "t.py"])
    assert 'did you mean "fsdp"?' in capsys.readouterr().err


def test_fabric_spellings_reach_the_script_in_canonical_form(torchrun):
    cli.main(["run", "--strategy", "FSDP", "--precision", "16", "--accelerator", "CPU", "t.py"])
    ((_, env),) = torchrun
    assert env["MINIFABRIC_STRATEGY"] == "fsdp"
    assert env["MINIFABRIC_PRECISION"] == "16-mixed"
    assert env["MINIFABRIC_ACCELERATOR"] == "cpu"


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"minifabric {minifabric.__version__}") and "torch" in out


def test_no_arguments_print_the_help(torchrun, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main([])
    assert info.value.code in (0, 2)
    out = capsys.readouterr().out
    assert "usage: minifabric" in out and "run" in out and "consolidate" in out
    assert not torchrun


@pytest.mark.parametrize("argv", [["--help"], ["run", "--help"], ["consolidate", "--help"]])
def test_help_texts_are_plain_words(argv, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "``" not in out and ":class:" not in out and ":func:" not in out
    assert "usage: minifabric" in out


def test_the_command_runs_as_a_module():
    result = run_command([sys.executable, "-m", "minifabric", "--version"], timeout=60)
    assert result.returncode == 0 and result.stdout.startswith("minifabric ")


def test_underscore_spellings_are_accepted(torchrun):
    cli.main(
        ["run", "--num_nodes", "1", "--node_rank", "0", "--main_address", "h", "--main_port", "5", "t.py"]
    )
    assert "--master-addr=h" in torchrun[0][0]


def test_a_bad_checkpoint_path_is_one_line_not_a_traceback(tmp_path, capsys):
    (tmp_path / "model.pt").write_bytes(b"not a checkpoint folder")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["consolidate", str(tmp_path / "model.pt"), str(tmp_path / "out.pt")])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert "minifabric consolidate: error:" in err and "model.pt" in err
    assert "Traceback" not in err
    assert not (tmp_path / "out.pt").exists()


def test_max_restarts_reaches_torchrun(torchrun):
    cli.main(["run", "--devices", "2", "--max-restarts", "3", "train.py"])
    ((args, _),) = torchrun
    assert "--max-restarts=3" in args and args.index("--max-restarts=3") < args.index("--module")


def test_negative_max_restarts_exit_with_a_message(torchrun, capsys):
    with pytest.raises(SystemExit, match=r"--max-restarts=-1 must be 0 or more"):
        cli.main(["run", "--max-restarts", "-1", "train.py"])
    assert not torchrun
