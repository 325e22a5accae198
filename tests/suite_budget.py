"""The slow tier's budget: a run fails when the tests marked slow took longer in all than
`slow_tier_budget_minutes` (setup.cfg's [tool:pytest], the one place it is written), so a change that
adds minutes to CI pays them back in the same change. The time is pytest's own (setup, call and
teardown of each test, on that run); the failure names the slowest tests.

The check applies to runs that select the whole slow tier (a run given files, -k or -m selects less
and is not judged: its total says nothing of CI's)."""
from __future__ import annotations

import pytest

OPTION = "slow_tier_budget_minutes"
SHOWN = 15  # slowest tests named when the budget is passed


def add_budget_option(parser) -> None:
    parser.addini(OPTION, "the most the slow tier may take in all, in minutes (0: no check)", default="0")


class SlowTierBudget:
    def __init__(self, config):
        self.config = config
        self.durations: dict[str, float] = {}
        self.verdict: str | None = None

    def _whole_suite(self) -> bool:
        option = self.config.option
        if option.keyword or option.markexpr or getattr(option, "deselect", None):
            return False
        testpaths = [str(path).rstrip("/") for path in self.config.getini("testpaths")]
        given = [str(arg).rstrip("/") for arg in self.config.args]
        return not given or given == testpaths

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report):
        if "slow" in report.keywords:
            self.durations[report.nodeid] = self.durations.get(report.nodeid, 0.0) + report.duration

    @pytest.hookimpl
    def pytest_sessionfinish(self, session):
        budget = float(self.config.getini(OPTION) or 0)
        if budget <= 0 or not self._whole_suite():
            return
        total = sum(self.durations.values())
        slowest = sorted(self.durations.items(), key=lambda item: -item[1])[:SHOWN]
        listing = "\n".join(f"  {seconds:7.1f} s  {nodeid}" for nodeid, seconds in slowest)
        if total > budget * 60:
            self.verdict = (f"the slow tier took {total / 60:.1f} min, over its budget of {budget:g} min "
                            f"({OPTION} in setup.cfg): a change that adds minutes pays them back. "
                            f"Its slowest tests:\n{listing}")
            if session.exitstatus == pytest.ExitCode.OK:
                session.exitstatus = pytest.ExitCode.TESTS_FAILED
        else:
            self.verdict = f"the slow tier took {total / 60:.1f} min of its {budget:g}-min budget ({OPTION})"

    @pytest.hookimpl
    def pytest_terminal_summary(self, terminalreporter):
        if self.verdict is not None:
            terminalreporter.write_sep("=", "slow-tier budget")
            terminalreporter.write_line(self.verdict)
