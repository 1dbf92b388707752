"""Test-suite wiring: multi-process tests run one at a time when the suite runs on several workers.

``scripts/test.sh`` runs pytest with ``-n 2 --dist loadgroup`` (pytest-xdist): the single-process tests
are spread over two workers, and every test marked ``distributed`` (it starts ranks of its own) joins one
group, which one worker runs in order, so that no two jobs of ranks share this machine's cores at once.
"""

from __future__ import annotations

import pytest


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("distributed") is not None:
            item.add_marker(pytest.mark.xdist_group("ranks"))
