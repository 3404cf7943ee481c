"""The other half of test_families.py's table of model families (the two xdist workers share it)."""
from __future__ import annotations

import pytest

from test_families import HALVES, check_family, chats  # noqa: F401 - chats: the fixture


@pytest.mark.parametrize("name", HALVES[1])
def test_a_family_trains_on_2_ranks_as_on_1_exports_exactly_and_packs_exactly(name, chats,  # noqa: F811
                                                                              tmp_path, capfd):
    check_family(name, chats, tmp_path, capfd)
