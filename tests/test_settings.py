"""torchneuron/settings.py: one parser for every environment variable, one rule for switches, clear
errors, and the tables generated from it."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from torchneuron import settings
from torchneuron.settings import Settings

ROOT = Path(__file__).resolve().parents[1]


def test_defaults_when_nothing_is_set():
    config = Settings.from_environ({})
    assert config == Settings()
    assert (config.device_count, config.strict, config.timeline, config.compile_fallback) == (2, False, True, "raise")
    assert Settings.from_environ({"TORCHNEURON_DEVICE_COUNT": "  "}).device_count == 2  # empty: the default


@pytest.mark.parametrize("text, value", [("1", True), ("true", True), ("YES", True), (" on ", True),
                                         ("0", False), ("false", False), ("No", False), ("off", False)])
def test_one_rule_for_every_switch(text, value):
    switches = [f for f in settings.variables() if f.type == "bool"]
    assert len(switches) >= 7
    config = Settings.from_environ({f.metadata["env"]: text for f in switches})
    assert all(getattr(config, f.name) is value for f in switches)


def test_the_two_old_misreadings():
    # TORCHNEURON_TIMELINE=false was off for collectives but on for the C++ work log;
    # TORCHNEURON_ADAPTIVE_NO_PLAN_CACHE=0 turned the debugging mode on.
    assert Settings.from_environ({"TORCHNEURON_TIMELINE": "false"}).timeline is False
    assert Settings.from_environ({"TORCHNEURON_ADAPTIVE_NO_PLAN_CACHE": "0"}).adaptive_no_plan_cache is False


def test_bad_values_name_the_variable_and_what_it_accepts():
    with pytest.raises(ValueError) as error:
        Settings.from_environ({"TORCHNEURON_STRICT": "maybe", "TORCHNEURON_DEVICE_COUNT": "0",
                               "TORCHNEURON_MEMORY_CAPACITY": "lots", "TORCHNEURON_COMPILE_FALLBACK": "cpu"})
    message = str(error.value)
    for expected in ("TORCHNEURON_STRICT='maybe'", "1/true/yes/on", "TORCHNEURON_DEVICE_COUNT='0'", "from 1 to 64",
                     "TORCHNEURON_MEMORY_CAPACITY='lots'", "8GiB", "TORCHNEURON_COMPILE_FALLBACK='cpu'", "raise, eager"):
        assert expected in message
    assert Settings.from_environ({"TORCHNEURON_MEMORY_CAPACITY": "8GiB"}).memory_capacity == 8 * 2**30


def test_current_follows_the_environment(monkeypatch):
    monkeypatch.setenv("TORCHNEURON_COMPILE_DUMP_DIR", "/tmp/somewhere")
    assert settings.current().compile_dump_dir == "/tmp/somewhere"
    first = settings.current()
    assert settings.current() is first  # unchanged environment: not parsed again
    monkeypatch.delenv("TORCHNEURON_COMPILE_DUMP_DIR")
    assert settings.current().compile_dump_dir is None


def test_every_variable_the_package_reads_is_a_setting():
    names = set(settings.NAMES)
    pattern = re.compile(r"\b(TORCHNEURON_[A-Z0-9_]+|NEURON_PLATFORM_TARGET_OVERRIDE)\b")
    sources = [p for p in (ROOT / "torchneuron").rglob("*") if p.suffix in (".py", ".cpp", ".h") and p.name != "settings.py"]
    mentioned = {m for p in sources for m in pattern.findall(p.read_text())}
    assert mentioned <= names, f"not in torchneuron/settings.py: {sorted(mentioned - names)}"
    readers = [str(p.relative_to(ROOT)) for p in sources
               if re.search(r"getenv\(\"TORCHNEURON|environ(\.get)?\(?\[?\"(TORCHNEURON|NEURON_PLATFORM)", p.read_text())]
    assert not readers, f"read the environment through torchneuron.settings instead: {readers}"


def test_readme_table_is_generated_from_settings():
    readme = (ROOT / "README.md").read_text()
    assert settings.markdown_table() in readme, (
        "README.md's table of environment variables is out of date: replace it with the output of "
        "`python -m torchneuron.settings`")


def test_the_runtime_gets_its_settings_from_python():
    """C++ reads no environment: the values reach it through _C when the library loads."""
    env = {**os.environ, "TORCHNEURON_TIMELINE": "false", "TORCHNEURON_ADAPTIVE_NO_PLAN_CACHE": "0",
           "TORCHNEURON_DEVICE_COUNT": "3", "TORCHNEURON_STRICT": "on", "PYTHONPATH": str(ROOT)}
    code = ("import torch, torchneuron; from torchneuron.runtime import _C; from torchneuron.hardware import worklog;"
            "print(_C.configuration(), worklog.is_enabled(), torch.neuron.is_strict(), torch.neuron.device_count())")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["{'device_count':", "3,", "'plan_cache':", "True}", "False", "True", "3"]
