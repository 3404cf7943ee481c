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
    (['data.sources=[{path="a.jsonl", wieght=1}]'], "unknown config key 'data.sources[0].wieght' (did you mean "
                                                    "'weight'?)"),
    (['data.sources=[{path="a.jsonl"}]'], "data.path (--dataset) and data.sources are both set"),
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


def test_table_valued_keys_from_the_command_line_and_back(tmp_path):
    from finetune.cli import build_config
    from finetune.config import load_config, to_toml
    cfg = build_config(None, ['data.chat_template_kwargs={enable_thinking=false, reasoning_effort="low"}',
                              "data.chat_template_kwargs.enable_thinking=true", "data.path=",
                              'data.sources=[{path="a.jsonl", weight=2}, {path="b.jsonl", samples=10, split="test"}]'],
                       check=False)
    assert cfg.data.chat_template_kwargs == {"enable_thinking": True, "reasoning_effort": "low"}
    assert [(s.path, s.weight, s.samples, s.split) for s in cfg.data.sources] == [("a.jsonl", 2.0, 0, "train"),
                                                                                ("b.jsonl", 0.0, 10, "test")]
    (tmp_path / "config.toml").write_text(to_toml(cfg))  # what a run records reads back as the same config
    assert load_config(tmp_path / "config.toml") == cfg
