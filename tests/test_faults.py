"""Fault injection (finetune/faults.py): parsed once, exact step matches, malformed specs refused, pause releases."""
from __future__ import annotations

import pytest

from finetune import faults


@pytest.fixture
def fault_env(monkeypatch):
    def set_spec(text):
        monkeypatch.setenv("FINETUNE_TEST_FAULTS", text)
        faults.spec.cache_clear()
    yield set_spec
    faults.spec.cache_clear()


def test_steps_match_exactly_and_are_parsed_once(fault_env, monkeypatch):
    fault_env("kill_in_save=8,pause_at_step=3")
    assert faults.spec() == {"kill_in_save": 8, "pause_at_step": 3}
    monkeypatch.setenv("FINETUNE_TEST_FAULTS", "kill_in_save=80")
    assert faults.spec()["kill_in_save"] == 8  # parsed once per process
    for step in (80, 18, 88):
        faults.kill_if("kill_in_save", step)  # would end this process if it matched
    faults.kill_if("kill_at_step", 8)


@pytest.mark.parametrize("text", ["kill_at=3", "kill_at_step=x", "nan_at_step=2", "kill_at_step"])
def test_a_malformed_spec_is_refused(fault_env, text):
    fault_env(text)
    with pytest.raises(ValueError, match="FINETUNE_TEST_FAULTS: bad entry"):
        faults.spec()


def test_pause_blocks_until_released(fault_env, capfd):
    fault_env("pause_at_step=2")
    calls = []
    faults.pause_if(1, lambda: calls.append(1) or False)  # not this step: never asks
    faults.pause_if(2, lambda: calls.append(1) or len(calls) >= 3)
    assert len(calls) == 3
    assert "rank 0 paused at step 2" in capfd.readouterr().err
