"""The command line: config errors are one clean line and exit 2 (in-process through the typer app, and once as
a real process)."""
from __future__ import annotations

import pytest

from helpers import invoke, run_cli

CONFIG_ERRORS = [
    (["train.lrr=1"], "unknown config key 'train.lrr' (did you mean 'lr'?)"),
    (["train.mixed_precision=bf61"],
     "train.mixed_precision must be one of 'bf16', 'fp32', got 'bf61' (did you mean 'bf16'?)"),
    (["data.max_seq_len=-1"], "data.max_seq_len must be > 0, got -1"),
    (["ac.ratio=2"], "ac.ratio must be in [0, 1], got 2.0"),
    (["--model", "/nonexistent/model"], "model path '/nonexistent/model' does not exist"),
    (["--nproc-per-node", "0"], "--nproc-per-node must be >= 1, got 0"),
    (["--dataset", "/nonexistent/data.jsonl"], "/nonexistent/data.jsonl"),
]


@pytest.mark.parametrize("args, expect", CONFIG_ERRORS)
def test_config_errors_are_one_clean_line(args, expect, tmp_path, llama_dir):
    """In-process through the typer app (what `finetune sft` runs); the next test runs one case as a real process."""
    model = [] if "--model" in args else ["--model", str(llama_dir)]
    result = invoke("sft", "--output-dir", tmp_path / "out", *model, *args)
    assert result.exit_code == 2, (result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expect in lines[0], result.stderr
    assert not (tmp_path / "out").exists()


def test_a_config_error_from_the_real_command_is_one_line_and_exit_2(tmp_path, llama_dir):
    args, expect = CONFIG_ERRORS[0]
    proc = run_cli("sft", "--output-dir", tmp_path, "--model", llama_dir, *args, check=False)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {expect}"), proc.stderr
    assert "Traceback" not in proc.stderr
