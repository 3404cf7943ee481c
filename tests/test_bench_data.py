"""The benchmarks' inputs and evidence: the realistic chat rows come out the same for a seed with the length profile
of SFT chat data; RESULTS.md's generated tables are made from the JSON lines, leaving the typed text alone; the GPU
stages dry-run on CPU up to their first CUDA call."""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(BENCHMARKS.parent / "examples" / "tiny-llama")


def test_chat_rows_are_reproducible_and_have_a_long_tail(tok, tmp_path):
    from chat_data import make_rows, write_rows
    a, b = write_rows(tmp_path / "a.jsonl", tok, 300, seed=0), write_rows(tmp_path / "b.jsonl", tok, 300, seed=0)
    assert a.read_bytes() == b.read_bytes()
    assert make_rows(tok, 5, seed=1) != make_rows(tok, 5, seed=0)
    rows = [json.loads(x) for x in a.read_text().splitlines()]
    lengths = [len(tok(tok.apply_chat_template(r["messages"], tokenize=False), add_special_tokens=False)["input_ids"])
               for r in rows]
    assert 300 <= statistics.median(lengths) <= 1200, statistics.median(lengths)
    assert max(lengths) > 2500 and sum(n > 1500 for n in lengths) >= 15
    assert max(lengths) <= 8192 + 200  # the cap, give or take the template
    assert any(len(r["messages"]) > 2 for r in rows) and all(r["messages"][-1]["role"] == "assistant" for r in rows)


def test_tables_are_generated_from_the_json_lines_and_the_typed_text_stays(tmp_path, monkeypatch):
    import results
    monkeypatch.setenv("FINETUNE_COMMIT", "abcdef0123")
    bench = {"model": "/tmp/m1b", "device": "cpu", "points": [
        {"ac_ratio": 0.0, "fp8": "off", "step_time_s": 2.0, "step_times_s": [9.0, 2.0, 1.5, 3.0],
         "tokens_per_s": 1234.5, "mfu": 0.4312, "mfu_ran": 0.4011, "peak_mem_mb": 2048.0, "other": "not kept"}]}
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    lines = results.append("fp8", results.bench_records(tmp_path / "bench.json", "off"), "finetune bench X", tmp_path)
    results.append("fp8", [{"variant": "tensorwise", "error": "out of memory"}], "finetune bench Y", tmp_path)
    stored = [json.loads(x) for x in (tmp_path / "fp8.jsonl").read_text().splitlines()]
    assert stored[0] == lines[0] and len(stored) == 2
    assert stored[0]["commit"] == "abcdef0123" and stored[0]["command"] == "finetune bench X"
    assert stored[0]["step_times_s"] == [9.0, 2.0, 1.5, 3.0] and "other" not in stored[0]

    md = tmp_path / "RESULTS.md"
    md.write_text("# Results\n\nhand-typed history\n")
    assert results.write_tables(md, tmp_path)
    text = md.read_text()
    assert text.startswith("# Results\n\nhand-typed history\n") and results.BEGIN in text and results.END in text
    row = next(x for x in text.splitlines() if "| off |" in x)
    assert "abcdef0" in row and "43.1%" in row and "40.1%" in row and "1,234" in row
    assert "2.5 (1.5-9, n=4)" in row  # the per-step list: median (min-max, n)
    assert "out of memory" in text and "`finetune bench Y`" in text
    md.write_text(text + "\ntyped after\n")
    assert not results.write_tables(md, tmp_path)  # the same lines: the same tables, the rest untouched
    assert md.read_text().endswith("\ntyped after\n")


def test_gpu_stages_dry_run_on_cpu_up_to_their_first_cuda_call(tmp_path):
    """Every stage of issue 50's GPU figures, in order, builds its inputs and prints its commands, then stops in one
    line where CUDA is first needed; nothing is written to the results."""
    stages = ["peers", "fp8", "moe30b", "profile", "offload131k", "lora8b", "full"]
    out = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_figures.py"), *stages, "--dry-run", "--rows", "40",
                          "--work", str(tmp_path / "work"), "--results-dir", str(tmp_path / "results")],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    stops = [x.split(":")[0] for x in out.stdout.splitlines() if "needs a CUDA device from here on" in x]
    assert stops == stages, out.stdout
    assert "--fp8 off,tensorwise,rowwise" in out.stdout and "data.max_seq_len=131072" in out.stdout
    assert "--systems defaults,trl" in out.stdout and "model.experts_implementation=grouped_mm" in out.stdout
    assert (tmp_path / "work" / "llama3-8b-8layers" / "config.json").exists()  # the 8B slice's config, no weights
    assert not (tmp_path / "work" / "llama3-8b-8layers" / "model.safetensors.index.json").exists()
    assert not (tmp_path / "results").exists()


def test_ep_bytes_counts_what_its_formula_predicts_on_2_ranks(tmp_path):
    """benchmarks/ep_bytes.py's counts (RESULTS.md's table at 8 ranks) equal its formula: FSDP alone and ep 2 on 2
    gloo ranks, 2 layers of 128 experts, 32 tokens a rank, bf16 (the experts' all-gather halves, the all-to-all
    appears)."""
    from ep_bytes import SIZES, count_step, formula, make_model
    from helpers import run_ranks
    make_model(tmp_path, 2)
    for ep in (1, 2):
        ranks = run_ranks(count_step, 2, str(tmp_path), ep, 32)
        # the all-to-all's bytes follow the routing on each rank (the rows its experts received); their mean does not
        mean = {k: sum(c.get(k, [0, 0])[1] for c in ranks) / 2 for k in ("all-gather", "reduce-scatter", "all-to-all")}
        assert mean == formula(SIZES, 2, ep, 2, 32), (ep, ranks)
