"""System tests start processes, jobs or clusters of their own: every one is ``slow``."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "/system/" in str(item.fspath):
            item.add_marker(pytest.mark.slow)
