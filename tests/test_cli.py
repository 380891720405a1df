"""The `torchneuron` command: info and the main job (a short demo run)."""
import subprocess
import sys

import pytest

from torchneuron.cli import main


def test_info_reports_target_and_devices(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "target: trn" in out and "neuron:1" in out and "TORCHNEURON_TARGET" in out


def test_demo_trains_and_reports(capsys):
    assert main(["demo", "--steps", "8", "--batch", "4", "--seq", "32"]) == 0  # exit 0 = the loss fell
    out = capsys.readouterr().out
    assert "loss: first" in out and "tokens/s" in out and "modeled trn2 device time" in out
    assert "CPU fallbacks: 0 calls" in out


def test_target_from_environment():
    code = "import torch; print(torch.neuron.get_device_properties().target, torch.neuron.device_count())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"TORCHNEURON_TARGET": "trn3", "TORCHNEURON_DEVICE_COUNT": "3", "PATH": ""})
    assert out.stdout.split() == ["trn3", "3"], out.stderr


def test_python_dash_m_runs_the_same_command(capsys, monkeypatch):
    import runpy

    monkeypatch.setattr(sys, "argv", ["python -m torchneuron", "info"])
    try:
        runpy.run_module("torchneuron", run_name="__main__")
    except SystemExit as done:
        assert done.code == 0
    else:
        raise AssertionError("python -m torchneuron did not exit with the command's code")
    assert "target: trn" in capsys.readouterr().out


def _third_party_imports(folder: str) -> set[str]:
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1] / "torchneuron"
    files = [root / "cli.py", root / "__main__.py", *(root / folder).glob("*.py")]
    names = set()
    for file in files:
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n not in ("torch", "torchneuron")}


def test_every_shipped_command_imports_only_declared_dependencies():
    """A plain `pip install torchneuron` must run every command (explorer's pandas was test-only)."""
    import pathlib
    import re
    import tomllib

    project = tomllib.loads((pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    declared = {re.split(r"[<>=!~\[ ]", d)[0].lower().replace("-", "_") for d in project["dependencies"]}
    assert _third_party_imports("profiler") <= declared, _third_party_imports("profiler") - declared


@pytest.mark.parametrize("command, extra, missing", [("serve", "serve", "vllm"),
                                                     ("serve-diffusion", "diffusion", "diffusers")])
def test_a_server_command_without_its_extra_names_the_install(command, extra, missing, monkeypatch, tmp_path):
    """Without vLLM (or diffusers) a server command stops with the install that brings it, not a traceback."""
    import importlib.util

    from torchneuron import cli

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == missing else find_spec(name, *a))
    with pytest.raises(SystemExit) as stopped:
        cli.main([command, str(tmp_path)])
    assert missing in str(stopped.value) and f"torchneuron[{extra}]" in str(stopped.value)


@pytest.mark.parametrize("model", ["llama", "mamba2"])
def test_demo_runs_a_model_of_the_zoo(model, capsys):
    """`torchneuron demo --model NAME`: training steps, then inference, with modeled times per target."""
    assert main(["demo", "--model", model, "--zoo-steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "loss: first" in out and "tokens/s" in out and all(t in out for t in ("trn1", "trn2", "trn3"))
    assert "inference (generated tokens)" in out
