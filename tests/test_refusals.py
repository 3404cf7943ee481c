"""Inputs that used to give a traceback, a wrong suggestion or a silent wrong result (issue 31): mixture weights of 0
or near the float maximum, misspelt keys and flags, --max-shard-size as transformers takes it, flex attention on CPU,
eval.num_samples=0."""
from __future__ import annotations

import json

import pytest

from helpers import invoke, sft, write_jsonl


def test_max_shard_size_takes_what_transformers_takes():
    from transformers.utils.hub import convert_file_size_to_int

    from finetune.config import ConfigError, parse_shard_size
    for text in ("5GB", "500MB", "100KB", "2GiB", "500MiB", "64KiB", "64kib", "5gB", "7", "1000000"):
        assert parse_shard_size(text) == convert_file_size_to_int(int(text) if text.isdigit() else text), text
    assert parse_shard_size("1.5GB") == 1_500_000_000 and parse_shard_size("0.5GiB") == 2**29
    assert parse_shard_size("1TB") == 10**12
    with pytest.raises(ConfigError, match=r"--max-shard-size '5Gb': a lowercase b means bits .* write 5GB"):
        parse_shard_size("5Gb")  # transformers: 625,000,000 bytes; whoever typed it likely meant 5 GB
    for bad in ("5XB", "0MB", "-1", "big", "1.5", ""):
        with pytest.raises(ConfigError, match="--max-shard-size must be a positive size"):
            parse_shard_size(bad)


@pytest.mark.parametrize("key, hint", [("lr", "'train.lr'"), ("data.lr", "'train.lr'"), ("trian.lr", "'train.lr'"),
                                       ("seed", "'train.seed'"), ("max_step", "'train.max_steps'"),
                                       ("path", "'model.path' or 'data.path' or 'eval.path'"),
                                       ("train.lrr", "'lr'"), ("trian", "'train'")])
def test_a_misspelt_key_gets_a_suggestion_among_every_sections_keys(key, hint):
    from finetune.config import ConfigError, load_config
    with pytest.raises(ConfigError) as e:
        load_config(None, {key: 1})
    assert f"unknown config key '{key}' (did you mean {hint}?)" in str(e.value)


def test_a_flag_that_is_a_config_key_says_how_to_set_it(tmp_path):
    result = invoke("sft", "--output-dir", tmp_path / "out", "--lr", "1e-4")
    assert result.exit_code == 2
    assert "No such option: --lr (did you mean 'train.lr' as a key=value override?)" in result.output
    assert "--help" not in result.output.split("No such option")[1]  # click alone suggested --help
    result = invoke("export-hf", "--max-shard", "1GB")  # a near flag of the command still wins
    assert result.exit_code == 2 and "--max-shard-size" in result.output


@pytest.mark.parametrize("how", ["weight", "samples", "epochs"])
def test_a_mixture_source_of_weight_0_is_refused_not_trained_in_full(how, tmp_path):
    from finetune.args import build_config
    from finetune.config import ConfigError
    with pytest.raises(ConfigError, match=rf"data.sources\[1\].{how} = 0 would take none of b.jsonl, but an unset "
                                          rf"{how} reads as 0 \(one epoch of it\): remove the source"):
        build_config(None, ["data.path=", f'data.sources=[{{path="a.jsonl", {how}=2}}, {{path="b.jsonl", {how}=0}}]'],
                     check=False)


def test_the_run_config_of_a_mixture_reads_back(tmp_path):
    """config.toml does not write the zeros of unset weights (which would now be refused)."""
    from finetune.args import build_config
    from finetune.config import load_config, to_toml
    cfg = build_config(None, ["data.path=", 'data.sources=[{path="a.jsonl", weight=2}, {path="b.jsonl"}, '
                                            '{path="c.jsonl", epochs=0.5}]'], check=False)
    (tmp_path / "config.toml").write_text(to_toml(cfg))
    assert load_config(tmp_path / "config.toml") == cfg


def test_mixture_weights_near_the_float_maximum():
    from finetune.tools.commands import build_config
    from finetune.config import ConfigError
    from finetune.data import DataError
    from finetune.data.mixture import mixture_sizes
    with pytest.raises(ConfigError, match=r"data.sources: the weights sum past the largest number \(inf\); only "
                                          r"their ratios count"):
        build_config(None, ["data.path=", 'data.sources=[{path="a.jsonl", weight=1.7e308}, '
                                          '{path="b.jsonl", weight=1.7e308}]'], check=False)
    with pytest.raises(ConfigError, match=r"data.sources\[0\].epochs must be <= 1,000,000, got 1e\+300"):
        build_config(None, ["data.path=", 'data.sources=[{path="a.jsonl", epochs=1e300}]'], check=False)
    # one weight near the maximum: its share is computed from the ratio (it overflowed: OverflowError/ValueError)
    assert mixture_sizes([{"path": "a", "weight": 1.7e308}, {"path": "b", "weight": 1.0}], [10, 20]) == [30, 0]
    assert mixture_sizes([{"path": "a", "weight": 1e308}, {"path": "b", "weight": 5e307}], [10, 20]) == [20, 10]
    assert mixture_sizes([{"path": "a", "weight": 1}, {"path": "b", "weight": 3}], [10, 20]) == [8, 22]
    with pytest.raises(DataError, match=r"data.sources\[0\] \(a\): 1e\+10 samples an epoch, more than 4,294,967,296"):
        mixture_sizes([{"path": "a", "samples": 10**10}], [10])


def test_flex_attention_on_cpu_is_refused_at_start_up(tmp_path, llama_dir, chat_file):
    from finetune.attention import check_trainable
    from finetune.config import ConfigError
    check_trainable("flex_attention", "cuda")
    with pytest.raises(ConfigError, match="model.attn_implementation=flex_attention cannot train on cpu: torch's "
                                          "FlexAttention has no backward there; use sdpa"):
        check_trainable("flex_attention", "cpu")
    result = invoke("sft", "--model", llama_dir, "--dataset", chat_file, "--output-dir", tmp_path / "out",
                    "model.attn_implementation=flex_attention")
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == ["error: model.attn_implementation=flex_attention cannot train on "
                                                  "cpu: torch's FlexAttention has no backward there; use sdpa (or "
                                                  "auto) on cpu"]
    assert not (tmp_path / "out").exists()


def test_eval_num_samples_0_means_no_evaluation(tmp_path, llama_dir, chat_file, capfd):
    held_out = write_jsonl(tmp_path / "held_out.jsonl", [json.loads(line) for line in
                                                        chat_file.read_text().splitlines()[:4]])
    records = sft(llama_dir, chat_file, tmp_path / "run", "train.max_steps=1", "data.max_seq_len=128",
                  f"eval.path={held_out}", "eval.num_samples=0")
    assert len(records) == 1 and "eval" not in records[-1]
    assert not (tmp_path / "run" / "eval.json").exists()
    assert "held-out" not in capfd.readouterr().out  # was: "held-out (0 questions): exact match 0.0%"


def test_a_refusal_inside_the_ranks_is_one_line_for_the_run(tmp_path, llama_dir):
    """Bad data is found by the ranks (preflight only opens the file): each used to print its line, then torch's
    launcher its own account ("failed (exitcode: 2) local_rank: 1 ...", "Sending process ... SIGTERM")."""
    from helpers import BASE, run_cli
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                             {"role": "bogus", "content": "x"}]}])
    proc = run_cli("sft", "--model", llama_dir, "--dataset", bad, "--output-dir", tmp_path / "out",
                   "--nproc-per-node", 2, *BASE, "train.max_steps=1", check=False, timeout=600)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [f"error: {bad}:1: unknown role 'bogus' in message 1 (allowed: system, "
                                                "user, assistant, tool; also human, gpt, function_call, observation, "
                                                "function)"]


def test_the_launcher_prints_the_first_ranks_line_and_counts_other_errors(tmp_path, capsys):
    from finetune.run.rank_errors import print_rank_errors
    assert not print_rank_errors(str(tmp_path))  # none left a line (a crash): torch's account stands
    for rank, line in enumerate(["error: a", "error: a", "error: b"]):
        (tmp_path / f"rank{rank:06d}").write_text(line)
    assert print_rank_errors(str(tmp_path))
    assert capsys.readouterr().err == "error: a (1 other rank(s) failed otherwise: --debug shows each)\n"


def test_export_writes_the_runs_chat_template_kwargs_as_the_templates_defaults(tmp_path, llama_dir):
    """vLLM, SGLang, transformers and llama.cpp all render the chat template saved with the model; no file of the
    model holds template variables, so the exported template sets the run's as defaults (a request's own win)."""
    from transformers import AutoTokenizer

    from finetune.hf.template_defaults import template_kwargs_note, with_template_defaults
    from finetune.hf.files import save_hf_files
    from finetune.model import load_hf_config
    msgs = [{"role": "user", "content": "hi"}]
    template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}"
                "<assistant>{% if enable_thinking is defined and enable_thinking is false %}<think></think>{% endif %}"
                "{% endif %}")  # as Qwen3's
    save_hf_files(tmp_path / "hf", str(llama_dir), load_hf_config(str(llama_dir)), False,
                  chat_template=template, template_kwargs={"enable_thinking": False},
                  with_defaults=with_template_defaults)
    exported, trained = AutoTokenizer.from_pretrained(tmp_path / "hf"), AutoTokenizer.from_pretrained(llama_dir)
    trained.chat_template = template

    def render(tok, **kwargs):
        return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **kwargs)
    assert render(exported) == render(trained, enable_thinking=False) != render(trained)  # as the run trained
    assert render(exported, enable_thinking=True) == render(trained, enable_thinking=True)  # a request's value wins
    # it renders no text (a template that starts with a newline too), and sets each named template
    for text in ("{{ messages[0]['content'] }}{{ x | default('-') }}", "\n{{ messages[0]['content'] }}{{ x }}"):
        tok = AutoTokenizer.from_pretrained(llama_dir)
        tok.chat_template = with_template_defaults(text, {"x": [1, {"a": "é\"q"}], "y": None, "bad-name": 1})
        assert tok.apply_chat_template(msgs, tokenize=False) == text.replace("{{ x | default('-') }}", "{{ x }}") \
            .replace("{{ messages[0]['content'] }}", "hi").replace("{{ x }}", "[1, {'a': 'é\"q'}]")
    assert with_template_defaults({"default": "a", "tool_use": "b"}, {"k": 1}) == {
        "default": "{% if k is not defined %}{% set k = 1 %}{% endif %}a",
        "tool_use": "{% if k is not defined %}{% set k = 1 %}{% endif %}b"}
    assert template_kwargs_note({"enable_thinking": False, "bad-name": 1}) == (
        "chat template: the run's data.chat_template_kwargs (enable_thinking=false) are its defaults now (a request's "
        "chat_template_kwargs still override them); bad-name cannot be set in Jinja: pass it with every request")


def fake_step(root, step: int):
    """A complete, intact checkpoint dir as damage() sees it (no tensors): what retention counts."""
    import hashlib
    path = root / f"step-{step}"
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"m" * step)
    (path / "finetune_complete.json").write_text(json.dumps({
        "step": step, "files": {".metadata": step}, "metadata_sha256": hashlib.sha256(b"m" * step).hexdigest(),
        "config": {"model": {"path": "some/model"}}}))
    return path


def test_retention_leaves_a_step_that_an_export_pinned(tmp_path, monkeypatch):
    import shutil

    import finetune.hf.files as export
    from finetune.checkpoint import CheckpointError, prune
    from finetune.run import locks
    from finetune.run.pins import pin_source, release_pin
    root = tmp_path / "run" / "checkpoints"
    first, second = fake_step(root, 1), fake_step(root, 2)
    source = pin_source(str(tmp_path / "run"))  # the newest
    assert source.weights == second
    fake_step(root, 3)
    prune(root, keep=1, locks=locks)  # the run saved step 3: retention keeps 1, but step 2 is being exported
    assert not first.exists() and second.exists()
    release_pin(second)
    prune(root, keep=1, locks=locks)
    assert not second.exists() and sorted(p.name for p in root.iterdir()) == ["step-3"]  # its pin file went too

    real = export.find_source

    def found_then_deleted(checkpoint):  # retention deletes the step between export-hf finding and pinning it
        source = real(checkpoint)
        shutil.rmtree(source.weights)
        if source.weights.name == "step-3":
            fake_step(root, 4)
        return source
    monkeypatch.setattr(export, "find_source", found_then_deleted)
    fake_step(root, 5)
    with pytest.raises(CheckpointError, match=rf"^checkpoint {root / 'step-5'} was deleted by the retention of the "
                                              rf"run saving into {root} \(checkpoint.keep\) before export-hf could "
                                              rf"pin it: export a newer step, or the output dir \(its newest\)$"):
        pin_source(str(root / "step-5"))
    monkeypatch.setattr(export, "find_source", lambda c: (real if (root / "step-4").exists() else
                                                          found_then_deleted)(c))
    assert pin_source(str(tmp_path / "run")).weights == root / "step-4"  # an output dir: its newest again
    release_pin(root / "step-4")


def test_export_of_a_run_whose_retention_runs_meanwhile(tmp_path, llama_dir, chat_file, monkeypatch):
    """The issue's case: export-hf of a run still saving, checkpoint.keep=1: its retention deleted the step being
    read (a FileNotFoundError traceback)."""
    import shutil

    import finetune.export as export
    from finetune.checkpoint import prune
    from finetune.run import locks
    run = tmp_path / "run"
    sft(llama_dir, chat_file, run, "train.max_steps=1", "data.max_seq_len=128", "checkpoint.keep=1")
    root, opened = run / "checkpoints", export.open_dcp

    def open_while_the_run_saves(weights):
        stored, load = opened(weights)

        def load_as_the_run_saves(name):
            if not (root / "step-2").exists():
                shutil.copytree(root / "step-1", root / "step-2")  # the run saved a newer step, then pruned
                prune(root, keep=1, locks=locks)
            return load(name)
        return stored, load_as_the_run_saves
    monkeypatch.setattr(export, "open_dcp", open_while_the_run_saves)
    export.export_hf(str(run), str(tmp_path / "hf"), verify=False)
    assert (tmp_path / "hf" / "model.safetensors").is_file() and (root / "step-1").is_dir()
    prune(root, keep=1, locks=locks)  # unpinned now: the next retention deletes it
    assert not (root / "step-1").exists()


def test_max_seq_len_search_claims_only_what_it_measured(llama_dir):
    """Eager attention keeps seq x seq probabilities: bytes grow faster than the line through 1024 and 2048 tokens,
    which claimed ~5x the length that fits, then found nothing that fit in its 16 steps back ("nothing fits 1024
    tokens per rank") while plain `plan` fit 8,192. Now: doubling, then bisection, on measured bytes."""
    from finetune.config import load_config
    from finetune.tools.plan import SAFETY, load_arch, run_plan, run_seq_search
    gpu_bytes = 16 * 2**30
    cfg = load_config(None, {"model.path": str(llama_dir), "data.path": "-", "model.attn_implementation": "eager"})
    result = run_seq_search(cfg, load_arch(cfg, None), 1, 1, gpu_bytes, [0.0])
    best, measured = result["best"], result["measured"]["0.0"]
    assert best is not None and best["max_seq_len"] >= 8192, result["max_seq_len"]
    longest, usable = best["max_seq_len"], gpu_bytes * (1 - SAFETY)
    assert measured[str(longest)] == best["total"] <= usable < measured[str(longest + 1024)]  # both measured
    assert result["max_seq_len"] == {"0.0": {"1": longest}}
    for seq, fits in ((longest, True), (longest + 1024, False)):  # plain plan agrees
        cfg.data.max_seq_len = seq
        assert run_plan(cfg, load_arch(cfg, None), 1, 1, gpu_bytes, [0.0], [1])["points"][0]["fits"] is fits


@pytest.mark.parametrize("override, line", [
    ("train.eps=-1", "train.eps must be > 0, got -1.0"), ("train.eps=0", "train.eps must be > 0, got 0.0"),
    ("train.seed=-1", "train.seed must be in [0, 2**63), got -1"),
    (f"train.seed={2**63}", f"train.seed must be below 2**63 in size, got {2**63}"),
    (f"train.max_steps={2**64}", f"train.max_steps must be below 2**63 in size, got {2**64}")])
def test_numbers_torch_and_numpy_refuse_are_refused_at_start_up(override, line):
    """Issue 53 item 8: these failed after the model and data had loaded, in a 67-82-line traceback."""
    from finetune.args import build_config
    from finetune.config import ConfigError
    with pytest.raises(ConfigError) as e:
        build_config(None, [override], check=False)
    assert str(e.value) == line


def test_a_negative_seed_is_one_line_before_loading(tmp_path, llama_dir, chat_file):
    result = invoke("sft", "--model", llama_dir, "--dataset", chat_file, "--output-dir", tmp_path / "out",
                    "train.max_steps=1", "data.max_seq_len=64", "train.seed=-1")
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == ["error: train.seed must be in [0, 2**63), got -1"]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flag, hint", [
    ("--epochs", "'train.max_steps' as a key=value override"), ("--steps", "'train.max_steps' as a key=value "
                                                                          "override"),
    ("--learning-rate", "'train.lr' as a key=value override"), ("--out", "--output-dir"),
    ("--output", "--output-dir"), ("--nproc", "--nproc-per-node"), ("--gpus", "--nproc-per-node")])
def test_a_flag_of_another_tool_gets_the_key_or_flag_of_its_meaning(flag, hint):
    """Issue 53 item 9: by spelling, --epochs and --steps got train.eps (the optimizer's epsilon), --out lora.dropout,
    --nproc data.num_proc."""
    result = invoke("sft", flag, "3")
    assert result.exit_code == 2
    assert f"No such option: {flag} (did you mean {hint}?)" in " ".join(result.output.replace("│", "").split())


@pytest.mark.parametrize("key, hint", [("epochs", "train.max_steps"), ("train.epochs", "train.max_steps"),
                                       ("out", "output_dir"), ("nproc", "--nproc-per-node")])
def test_a_key_of_another_tool_gets_the_key_of_its_meaning(key, hint):
    from finetune.config import ConfigError, load_config
    with pytest.raises(ConfigError, match=rf"unknown config key '{key}' \(did you mean '{hint}'\?\)"):
        load_config(None, {key: 1})
