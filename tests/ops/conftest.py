"""The OpInfo gates' summary lines (pass rates per variant and dtype) at the end of a test run.

A gate records its line with `record_property("opinfo_summary", line)`; test reports carry it
to the controlling process under pytest-xdist too."""
from __future__ import annotations


def pytest_terminal_summary(terminalreporter) -> None:
    lines = [value for key in ("passed", "failed") for report in terminalreporter.stats.get(key, [])
             if report.when == "call" for name, value in report.user_properties if name == "opinfo_summary"]
    if lines:
        terminalreporter.section("OpInfo pass rates")
        for line in lines:
            terminalreporter.write_line(line)
