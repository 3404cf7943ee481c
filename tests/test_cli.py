"""The command line: config errors are one clean line and exit 2 (in-process through the typer app, and once as
a real process)."""
from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest

from helpers import invoke, run_cli

CONFIG_ERRORS = [
    (["train.lrr=1"], "unknown config key 'train.lrr' (did you mean 'lr'?)"),
    (["train.mixed_precision=bf61"],
     "train.mixed_precision must be one of 'bf16', 'fp32', got 'bf61' (did you mean 'bf16'?)"),
    (["data.max_seq_len=-1"], "data.max_seq_len must be > 0, got -1"),
    (["ac.ratio=2"], "ac.ratio must be in [0, 1], got 2.0"),
    (["train.lr=inf"], "train.lr must be a finite number, got inf"),
    (["train.eps=nan"], "train.eps must be a finite number, got nan"),
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
    proc = run_cli("sft", "--output-dir", tmp_path, "--model", llama_dir, *args, check=False, fresh=True)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {expect}"), proc.stderr
    assert "Traceback" not in proc.stderr


def test_table_valued_keys_from_the_command_line_and_back(tmp_path):
    from finetune.args import build_config
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


def refuse_writes_under(monkeypatch, directory, code: int) -> None:
    """From now on the OS refuses to create files under `directory` with `code` (EROFS: a read-only mount, EACCES:
    no permission), as the kernel does: the tests run as root, whom chmod does not stop."""
    real_open = os.open

    def refusing_open(path, flags, *args, **kwargs):
        if flags & os.O_CREAT and Path(path).absolute().is_relative_to(directory):
            raise OSError(code, os.strerror(code), str(path))
        return real_open(path, flags, *args, **kwargs)
    monkeypatch.setattr(os, "open", refusing_open)


@pytest.mark.parametrize("code, cause", [(errno.EROFS, "Read-only file system (EROFS)"),
                                         (errno.EACCES, "Permission denied (EACCES)")])
@pytest.mark.parametrize("command", ["sft new", "sft resume", "prepare-checkpoint", "export-hf"])
def test_an_unwritable_output_dir_is_one_line_at_start_up(command, code, cause, llama_dir, chat_file, tmp_path,
                                                          monkeypatch):
    """Before the model or data are loaded (a new sft run used to stop after them, at its lock file)."""
    import finetune.data
    disk = tmp_path / "disk"
    (disk / "old" / "checkpoints" / "step-2").mkdir(parents=True)  # what an earlier run left (resumed)
    out = disk / ("old" if command == "sft resume" else "new")
    where = out if command == "sft resume" else disk
    args = {"sft": ["sft", "--model", llama_dir, "--dataset", chat_file],
            "prepare-checkpoint": ["prepare-checkpoint", "--model", llama_dir],
            "export-hf": ["export-hf", "--checkpoint", disk / "old"]}[command.split()[0]]
    refuse_writes_under(monkeypatch, disk, code)
    monkeypatch.setattr(finetune.data, "load_rows", lambda *a, **k: pytest.fail("the data was loaded first"))
    result = invoke(*args, "-o", out)
    assert result.exit_code == 2, (result.output, result.exception)
    what = f"output_dir {out}" if command.startswith("sft") else f"--output-dir {out} (written beside it, then renamed)"
    assert result.stderr == f"error: {what}: cannot write in {where}: {cause}\n"
    assert not (disk / "new").exists()


def test_os_errors_about_our_files_are_one_line_naming_the_file(tmp_path, capsys):
    """Wherever they occur (launch.guarded); a failed write() names no file: metrics.jsonl adds its own."""
    from finetune.launch import guarded
    from finetune.metrics import MetricsLogger

    class FullDisk:
        name = str(tmp_path / "metrics.jsonl")

        def write(self, text):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    logger = MetricsLogger(tmp_path)
    logger.file = FullDisk()
    with pytest.raises(SystemExit) as exit_:
        guarded(logger.log, False, {"step": 1, "loss": 1.0})
    assert exit_.value.code == 1
    assert capsys.readouterr().err == f"error: {tmp_path / 'metrics.jsonl'}: No space left on device (ENOSPC)\n"
    with pytest.raises(OSError):  # --debug: the traceback
        guarded(logger.log, True, {"step": 1, "loss": 1.0})


def edited_model(src, dst, file: str, content: str):
    shutil.copytree(src, dst)
    if file == "config.json":  # hand-edited: one value transformers' validation rejects
        config = json.loads((dst / file).read_text())
        content = json.dumps({**config, **json.loads(content)})
    (dst / file).write_text(content)
    return dst


BAD_MODEL_FILES = [
    ("config.json", '{"hidden_size": -5}', "cannot load model '{model}': StrictDataclassClassValidationError: Class "
     "validation error for validator 'validate_architecture': ValueError: The hidden size (-5) is not a multiple of "
     "the number of attention heads (4)."),
    ("tokenizer.json", '{"version": "1.0", "model": {"type": "BPE", "vocab": 5}}',
     "cannot load the tokenizer of '{model}': KeyError: 'added_tokens'"),
    ("generation_config.json", '{"max_new_tokens": -3}', "cannot load the generation config of '{model}': ValueError: "
     "`max_new_tokens` must be greater than 0, but is -3."),
    ("generation_config.json", '{"max_new', "cannot load the generation config of '{model}': OSError: It looks like "
     "the config file at '{model}/generation_config.json' is not a valid JSON file."),
]


@pytest.mark.parametrize("command, file, content, expect", [  # each command with each file it reads
    (command, *case) for case in BAD_MODEL_FILES for command in ("plan", "sft", "prepare-checkpoint")
    if (case[0], command) not in {("tokenizer.json", "plan"), ("generation_config.json", "plan"),
                                  ("generation_config.json", "sft")}])
def test_a_model_file_transformers_rejects_is_one_line(command, file, content, expect, llama_dir, chat_file,
                                                       tmp_path):
    """A validation error of a dependency is one line (a generation config is read by prepare-checkpoint and
    export-hf only, and never replaced by a derived one when the file is there but bad)."""
    model = edited_model(llama_dir, tmp_path / "model", file, content)
    args = {"plan": ["plan", "--model", model], "sft": ["sft", "--model", model, "--dataset", chat_file],
            "prepare-checkpoint": ["prepare-checkpoint", "--model", model]}[command]
    result = invoke(*args, *(["-o", tmp_path / "out"] if command != "plan" else []))
    assert result.exit_code == 2, (result.output, result.exception)
    assert result.stderr == f"error: {expect.format(model=model)}\n"


@pytest.mark.parametrize("command, text", [("sft", "where metrics, config and checkpoints go"),
                                           ("prepare-checkpoint", "the prepared checkpoint dir to write"),
                                           ("export-hf", "the Hugging Face model dir to write")])
def test_each_command_describes_its_own_output_dir(command, text, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # one help line per option
    [line] = [line for line in invoke(command, "--help").stdout.splitlines() if "--output-dir" in line]
    assert text in line


@pytest.mark.parametrize("rank, printed", [("0", True), ("1", False)])
def test_a_failed_save_is_printed_by_rank_0_alone(rank, printed, monkeypatch, capsys):
    """Every rank stops on a failed save (DCP gathers the failures): one `error:` line, not one per rank."""
    from finetune.run.saving import SaveError
    from finetune.launch import guarded

    def fail():
        raise SaveError("cannot save checkpoint x")
    monkeypatch.setenv("RANK", rank)
    with pytest.raises(SystemExit) as exit_:
        guarded(fail, False)
    assert exit_.value.code == 1 and capsys.readouterr().err == ("error: cannot save checkpoint x\n" if printed else "")
