"""A second module for the suite's process isolation test: its own process."""

from __future__ import annotations

from tests.support.suite_probe import Probe


class OtherModule(Probe):
    NAME = "Other module bench"
