"""The pytest plugin of the suite's second-lane worker (tests/background.py): ``python -m pytest -p
tests.lane_worker --lane-report=FILE NODEID...`` appends each test report, serialized by pytest's own
hook (the one pytest-xdist uses), to FILE as one JSON line as soon as it exists, so the main process
can replay it as if the test had run there."""

from __future__ import annotations

import json


class _Writer:
    def __init__(self, config, path: str) -> None:
        self.config = config
        self.file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed at unconfigure)

    def pytest_runtest_logreport(self, report) -> None:
        data = self.config.hook.pytest_report_to_serializable(config=self.config, report=report)
        self.file.write(json.dumps(data) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def pytest_addoption(parser) -> None:
    parser.addoption("--lane-report", metavar="FILE", help="append each test report to FILE as a JSON line")


def pytest_configure(config) -> None:
    path = config.getoption("lane_report")
    if path:
        config.pluginmanager.register(_Writer(config, path), "lane-report-writer")


def pytest_unconfigure(config) -> None:
    writer = config.pluginmanager.get_plugin("lane-report-writer")
    if writer is not None:
        writer.close()
