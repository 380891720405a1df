"""The `torchneuron` command: info and the main job (a short demo run)."""
import subprocess
import sys

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
