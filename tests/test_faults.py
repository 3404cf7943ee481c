"""Fault injection (tests/faults.py): exact step matches, malformed specs refused, pause releases, installed in a
launched rank through the core's one hook (launch.rank_main)."""
from __future__ import annotations

import pytest

import faults
from helpers import REPO


def test_steps_match_exactly():
    spec = faults.spec("kill_in_save=8,pause_at_step=3")
    assert spec == {"kill_in_save": 8, "pause_at_step": 3}
    for step in (80, 18, 88):
        faults.kill_if(spec, "kill_in_save", step)  # would end this process if it matched
    faults.kill_if(spec, "kill_at_step", 8)


@pytest.mark.parametrize("text", ["kill_at=3", "kill_at_step=x", "nan_at_step=2", "kill_at_step"])
def test_a_malformed_spec_is_refused(text):
    with pytest.raises(ValueError, match="FINETUNE_TEST_FAULTS: bad entry"):
        faults.spec(text)


def test_pause_blocks_until_released(capfd):
    calls = []
    faults.pause_if({"pause_at_step": 2}, 1, lambda: calls.append(1) or False)  # not this step: never asks
    faults.pause_if({"pause_at_step": 2}, 2, lambda: calls.append(1) or len(calls) >= 3)
    assert len(calls) == 3
    assert "rank 0 paused at step 2" in capfd.readouterr().err


def test_the_package_has_no_fault_code_and_a_rank_installs_it_from_the_tests_path(monkeypatch):
    """finetune holds no fault injector; rank_main installs tests/faults.py when FINETUNE_TEST_FAULTS is set."""
    import finetune.checkpoint as ckpt
    import finetune.launch as launch
    import finetune.train as train
    assert not (REPO / "finetune" / "faults.py").exists()
    mentions = [p.name for p in (REPO / "finetune").rglob("*.py") if "import faults" in p.read_text()]
    assert mentions == ["launch.py"]  # the one hook
    for owner, name in ((train, "next_micro_batches"), (ckpt.Checkpointer, "finish"), (ckpt.TrainState, "__init__"),
                        (ckpt.SignalFlag, "__enter__")):
        monkeypatch.setattr(owner, name, getattr(owner, name))  # what install() patches: restored after the test
    before = train.next_micro_batches
    launch.rank_main(lambda: None, (), False)
    assert train.next_micro_batches is before  # not set: nothing installed
    monkeypatch.setenv("FINETUNE_TEST_FAULTS", "kill_at_step=99")
    launch.rank_main(lambda: None, (), False)
    assert train.next_micro_batches is not before
