"""The core alone (finetune/ without finetune/ext/): `finetune sft` on the embedded default trains, checkpoints,
resumes and exports; a command or key of a missing extension stops in one line (exit 2)."""
from __future__ import annotations

import shutil
from functools import partial

from helpers import REPO, read_metrics, run_cli


def core_copy(root):
    """The repo's core, configs and examples under root (finetune/ext/ left out), importable from there first."""
    for name in ("configs", "examples"):
        shutil.copytree(REPO / name, root / name)
    shutil.copytree(REPO / "finetune", root / "finetune", ignore=shutil.ignore_patterns("ext", "__pycache__"))
    return root


def test_the_core_alone_trains_resumes_and_exports_and_refuses_extensions_in_one_line(tmp_path):
    repo = core_copy(tmp_path / "repo")
    env = {"PYTHONPATH": str(repo)}
    cli = partial(run_cli, cwd=repo, env=env, fresh=True)  # fresh interpreters: this copy's finetune, not the repo's
    run = cli("sft", "train.max_steps=2", "-o", tmp_path / "run", timeout=900)
    assert "needs the extension finetune/ext/evaluate.py" in run.stderr  # the preset's eval.path: skipped
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2]
    resumed = cli("sft", "train.max_steps=3", "-o", tmp_path / "run")
    assert "resumed from" in resumed.stdout and (tmp_path / "run" / "checkpoints" / "step-3").is_dir()
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3]
    export = cli("export-hf", "--checkpoint", tmp_path / "run", "--output-dir", tmp_path / "hf")
    assert (tmp_path / "hf" / "model.safetensors").is_file() and (tmp_path / "hf" / "config.json").is_file()
    assert "the export is not checked" in export.stdout + export.stderr
    out = ["-o", tmp_path / "refused"]
    for args, names in ((["dpo", *out], "finetune dpo needs the extension finetune/ext/dpo.py"),
                        (["sft", "lora.rank=8", *out], "lora.rank=8 needs the extension finetune/ext/lora.py"),
                        (["bench", *out], "finetune bench needs the extension finetune/ext/bench.py"),
                        (["plan"], "finetune plan needs the extension finetune/ext/plan.py"),
                        (["preview-data"], "finetune preview-data needs the extension finetune/ext/preview.py")):
        refused = cli(*args, check=False)
        assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [f"error: {names}, which this "
                                                                                   f"installation lacks"], refused
        assert not (tmp_path / "refused").exists()
    template = repo / "README.md"  # any existing file: the key is refused before it is read
    for key, value, name in (("ac.mode", "op", "sac"), ("data.chat_template", str(template), "chat_template"),
                             ("train.tokens_per_step", 2048, "tokens_per_step"), ("checkpoint.async", True, "saving")):
        text = str(value).lower() if isinstance(value, bool) else value  # TOML's true
        refused = cli("sft", f"{key}={text}", *out, check=False)  # after the preset's eval note
        assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1] == (
            f"error: {key}={value!r} needs the extension finetune/ext/{name}.py, which this installation lacks")
        assert not (tmp_path / "refused").exists()
