"""Shared fixtures (the neuron device is registered by `import torch`, an entry point, or here)
and the order tests run in."""
import os

# `make test` runs two test processes on two cores: each compiles Inductor's C++ in process rather
# than through a pool of compile subprocesses of its own (~10% faster here). Set before torch loads
# Inductor's config.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# CI machines set CI, and PyTorch checks more under it (Inductor refuses implicit fallbacks for ops
# that have a decomposition; functorch raises on aliasing custom ops). Tests run that way everywhere,
# so a local run fails where CI would.
os.environ.setdefault("CI", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import torchneuron  # noqa: F401  (registers the device even with TORCH_DEVICE_BACKEND_AUTOLOAD=0)


@pytest.fixture
def neuron() -> torch.device:
    return torch.device("neuron")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--zoo-full", action="store_true", default=False,
                     help="also run the model zoo's long cases (tests/models: marked zoo_full), e.g. "
                          "every zoo model compiled")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "zoo_full: a long model-zoo case, run only with --zoo-full")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Slow tests first: `make test` spreads test modules over two workers (pytest-xdist,
    `--dist loadscope`) in this order, so the long OpInfo gates start at once instead of
    leaving one worker busy at the end. Cases marked zoo_full are skipped without --zoo-full."""
    if not config.getoption("--zoo-full"):
        skip = pytest.mark.skip(reason="a long model-zoo case: pass --zoo-full to run it")
        for item in items:
            if item.get_closest_marker("zoo_full") is not None:
                item.add_marker(skip)
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


# The model zoo's tests (tests/models) record each model's modeled trn2 step as the `zoo` property;
# the reports reach this process from pytest-xdist workers too, and the run ends with their table.
_zoo_steps: list[dict] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" and report.passed:
        _zoo_steps.extend(value for key, value in report.user_properties if key == "zoo")


def pytest_terminal_summary(terminalreporter) -> None:
    if not _zoo_steps:
        return
    terminalreporter.section("model zoo: modeled trn2 training step")
    terminalreporter.write_line(f"{'model':<14} {'mode':<9} {'step':>11} {'MFU':>9}")
    for row in sorted(_zoo_steps, key=lambda r: (r["model"], r["mode"])):
        terminalreporter.write_line(f"{row['model']:<14} {row['mode']:<9} {row['trn2_step_ms']:>8.3f} ms "
                                    f"{row['mfu'] * 100:>7.4f}%")
