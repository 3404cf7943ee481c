"""Behaviour-equivalence harness: drives only the public CLI (`python -m finetune ...`, this checkout's interpreter)
and writes OUT_DIR/manifest.json, {case: sha256 digest or small JSON value}, with the raw outputs beside it (raw/,
runs/). Two checkouts are equivalent on these cases when their manifests are equal:

    python benchmarks/equivalence.py --build-models /work/baseline/models     # once: the fixed inputs (seed 0)
    python benchmarks/equivalence.py OUT_DIR --models /work/baseline/models    # per checkout, from its root
    python benchmarks/equivalence_compare.py OUT_A OUT_B                       # exit 1 if any case differs

Cases: preview-data (--json and text) over the example data, packing on/off, mixtures, streaming, the DPO preset's
pairs, and tiny offline models built with the tests' tokenizers (tests/_tokenizers.py) and chat templates
(tests/test_templates.py); plan --json; sft (full, LoRA, tied, modules_to_save, a resume, other architectures),
export-hf (merged, --adapter, float32), prepare-checkpoint, dpo (precomputed and adapter references, SimPO), and
sft on 2 ranks with parallel.cp=2 and on 4 ranks with HSDP (dp_replicate=2). Recorded: exit codes, normalised
stdout/stderr digests, metrics.jsonl without its timing fields (exact floats), eval.json, and the sha256 of every
file written (exported safetensors, index, config, tokenizer, adapter, .distcp shards, .metadata, markers with
their wall-clock "time" dropped). Paths are written as $ROOT (the checkout), $OUT and $MODELS before hashing.

preview-data and plan run in one interpreter (runpy of the `finetune` package as `python -m finetune` does, one
case after the other: the import of torch/transformers is paid once); --fresh runs each in its own process.
Training, export and prepare run as their own processes (ranks through the CLI's launcher).
`--only REGEX` keeps the matching cases (a partial manifest; compare it with equivalence_compare.py --common; a case
that reads another's output needs that one too). `--jobs 2` runs independent chains of cases side by side.
Environment: offline, OMP_NUM_THREADS=1, TOKENIZERS_PARALLELISM=false, a fresh datasets cache under OUT_DIR
(removed at the end).

Determinism (93647d2, CPU, torch gloo): two runs (--jobs 2 and --jobs 1) give equal manifests, every float and
every shard bit for bit, the 2- and 4-rank runs included; --fresh gives what the shared interpreter gives. What
differed before normalising, and is normalised here: DCP's .metadata (a random StorageMeta.save_id and the
checkpoint path, with the pid of prepare-checkpoint's staging dir) and the checkpoint marker's sha256/size of it;
the markers' and exports' wall-clock "time"; tokens/s, memory and seconds in metrics.jsonl and on the console.
About 13 minutes of CPU (15 s of it per process is importing torch/transformers).
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path.cwd().resolve()
PY = sys.executable
PARTIAL = re.compile(r"(\.partial-)\d+")
VOLATILE_METRICS = re.compile(r"(per_s|time|mem|mfu)")  # wall-clock and memory fields of metrics.jsonl

# ----------------------------------------------------------------------------- fixed inputs (built once)

TEMPLATE_SOURCES = ("tests/_tokenizers.py", "tests/test_templates.py")
MODEL_SPECS = {  # name: (tokenizer family, arch, tied, layers); as tests/conftest.py's fixtures
    "llama": ("llama3", "llama", False, 4),        # llama_dir
    "qwen_tied": ("chatml", "qwen2", True, 3),     # qwen_tied_dir
    "qwen_sys": ("chatml_default_system", "qwen2", False, 2),
    "qwen3": ("qwen3", "qwen2", True, 2),
    "neox": ("chatml", "gpt_neox", False, 2),      # lm_head stored as embed_out
    "mixtral": ("chatml", "mixtral", False, 2),    # experts fused in memory, per expert on disk
    "gemma2": ("chatml", "gemma2", True, 2),       # soft-capping: eager/sdpa attention
}


def template_constants() -> dict[str, str]:
    """The chat templates the tests carry: top-level string constants of TEMPLATE_SOURCES, evaluated from their
    syntax tree (no import of the test modules, so no import of finetune), with the tests' message helpers."""
    ns: dict = {}
    out = {}
    for rel in TEMPLATE_SOURCES:
        tree = ast.parse((ROOT / rel).read_text())
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name in ("user", "assistant", "call", "tool"):
                exec(compile(ast.Module([node], []), rel, "exec"), ns)
            if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
                continue
            name = node.targets[0].id
            try:
                value = eval(compile(ast.Expression(node.value), rel, "eval"), ns)
            except Exception:
                continue
            ns[name] = value
            if isinstance(value, str) and ("{%" in value or "{{" in value) and name.isupper():
                out[name] = value
    out["_ROWS"] = {k: ns[k] for k in ("THINK_OPEN_ROW",) if k in ns}
    return out


def build_models(dest: Path) -> None:
    """Tiny random bf16 models (tests/conftest.py make_model_dir, seed 0) with every tokenizer family of
    tests/_tokenizers.py, the tests' templates as .jinja files and small data files, plus MANIFEST.json (sha256 of
    every file) so that a run can check its inputs."""
    sys.path.insert(0, str(ROOT / "tests"))
    from _tokenizers import FAMILIES, build_tokenizer
    from conftest import make_chat_rows, make_model_dir
    dest.mkdir(parents=True, exist_ok=True)
    for name, (family, arch, tied, layers) in MODEL_SPECS.items():
        make_model_dir(dest / name, family, arch, tied=tied, num_layers=layers, seed=0)
    assert set(FAMILIES) <= {s[0] for s in MODEL_SPECS.values()}, "a tokenizer family without a model"
    consts = template_constants()
    rows = consts.pop("_ROWS")
    tdir = dest / "templates"
    tdir.mkdir(exist_ok=True)
    for name, text in consts.items():
        (tdir / f"{name.lower()}.jinja").write_text(text)
    # a tokenizer whose chat_template is a dict (default + tool_use), as test_arguments_as_the_tool_use_template_wants
    if "RAW_ARGS_TOOL_USE" in consts and "CHATML" in consts:
        make_model_dir(dest / "qwen3_tooluse", "qwen3", "qwen2", tied=True, num_layers=2, seed=0)
        tok = build_tokenizer("qwen3")
        tok.chat_template = {"default": consts["CHATML"], "tool_use": consts["RAW_ARGS_TOOL_USE"]}
        tok.save_pretrained(dest / "qwen3_tooluse")
    ddir = dest / "data"
    ddir.mkdir(exist_ok=True)
    with open(ddir / "chat.jsonl", "w") as f:
        for row in make_chat_rows(96):
            f.write(json.dumps(row) + "\n")
    with open(ddir / "rows.jsonl", "w") as f:
        for row in rows.values():
            f.write(json.dumps({"messages": row}) + "\n")
        f.write(json.dumps({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello",
                                                                             "reasoning_content": "Greet."}]}) + "\n")
    with open(ddir / "tools_noschema.jsonl", "w") as f:  # tool calls and reasoning without the tools column
        for line in (ROOT / "examples/data/tools_reasoning.jsonl").read_text().splitlines():
            row = json.loads(line)
            row.pop("tools", None)
            f.write(json.dumps(row) + "\n")
    files = {str(p.relative_to(dest)): sha256_file(p) for p in sorted(dest.rglob("*"))
             if p.is_file() and p.name != "MANIFEST.json"}
    (dest / "MANIFEST.json").write_text(json.dumps(files, indent=1, sort_keys=True) + "\n")
    print(f"built {len(files)} files into {dest}")


# ----------------------------------------------------------------------------- helpers

def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def dcp_metadata_text(path: Path) -> str:
    """A DCP .metadata's content without what differs between identical saves (StorageMeta's random save_id; its
    checkpoint_id is the path, normalised by the caller): sorted reprs of the tensors' metadata and storage."""
    import pickle

    import torch.distributed.checkpoint  # noqa: F401  (the pickled classes)
    md = pickle.loads(path.read_bytes())
    lines = [f"version {md.version!r}", f"planner_data {md.planner_data!r}"]
    lines += sorted(f"state {k!r}: {v!r}" for k, v in md.state_dict_metadata.items())
    lines += sorted(f"storage {k!r}: {v!r}" for k, v in (md.storage_data or {}).items())
    sm = md.storage_meta
    if sm is not None:
        lines.append(f"storage_meta checkpoint_id={str(sm.checkpoint_id)!r} load_id={sm.load_id!r} "
                     f"modules={sm.modules!r}")
    return "\n".join(lines) + "\n"


def child_cpu() -> float:
    import resource
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def sha(text: str | bytes) -> str:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()


class Harness:
    def __init__(self, out: Path, models: Path, fresh: bool, only: str | None, jobs: int = 1):
        self.out, self.models, self.fresh, self.jobs = out, models, fresh, jobs
        self.only = re.compile(only) if only else None
        self.manifest: dict = {}
        self.timings: dict = {}  # wall seconds per case
        self.cpu: dict = {}  # cpu seconds (user + sys of the processes it started) per case or batch
        self.raw = out / "raw"
        self.runs = out / "runs"
        self.raw.mkdir(parents=True, exist_ok=True)
        self.runs.mkdir(parents=True, exist_ok=True)
        self.env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                        TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1", NO_COLOR="1", PYTHONHASHSEED="0",
                        WANDB_MODE="disabled", HF_DATASETS_CACHE=str(out / "_datasets_cache"))
        self.env.pop("WANDB_API_KEY", None)

    def wanted(self, name: str) -> bool:
        return not self.only or bool(self.only.search(name))

    def norm(self, text: str) -> str:
        """Paths that differ between checkouts and output dirs, as placeholders."""
        for path, tag in ((self.out, "$OUT"), (self.models, "$MODELS"), (ROOT, "$ROOT")):
            text = text.replace(str(path), tag)
        return PARTIAL.sub(r"\1<pid>", text)  # staging dirs (.<name>.partial-<pid>) in DCP metadata

    def record(self, key: str, value) -> None:
        self.manifest[key] = value

    def record_text(self, key: str, text: str, keep: int = 0) -> None:
        """A text as itself when short (keep chars), else its digest."""
        text = self.norm(text)
        self.record(key, text if len(text) <= keep else "sha256:" + sha(text))

    # ------------------------------------------------------------------- in-process batches of CLI calls

    BATCH = r'''
import json, os, runpy, sys, time, traceback
cases, raw = json.load(open(sys.argv[1])), sys.argv[2]
for name, argv in cases:
    t = time.time()
    fo = os.open(os.path.join(raw, name + ".out"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    fe = os.open(os.path.join(raw, name + ".err"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush(); sys.stderr.flush()
    keep1, keep2 = os.dup(1), os.dup(2)
    os.dup2(fo, 1); os.dup2(fe, 2)
    sys.argv = ["finetune"] + argv
    try:
        runpy.run_module("finetune", run_name="__main__", alter_sys=True)
        rc = 0
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        rc = "exception"
    sys.stdout.flush(); sys.stderr.flush()
    os.dup2(keep1, 1); os.dup2(keep2, 2)
    for fd in (fo, fe, keep1, keep2):
        os.close(fd)
    print(json.dumps([name, rc, round(time.time() - t, 2)]), flush=True)
'''

    def cli_batch(self, cases: list[tuple[str, list[str]]]) -> None:
        """Run `python -m finetune ARGV` for each case (one interpreter unless --fresh); record rc, stdout, stderr."""
        cases = [(n, a) for n, a in cases if self.wanted(n)]
        if not cases:
            return
        files = [(n.replace("/", "__"), n, a) for n, a in cases]
        cpu, t0 = child_cpu(), time.time()
        if self.fresh:
            results = []
            for fname, name, argv in files:
                t = time.time()
                with open(self.raw / f"{fname}.out", "wb") as fo, open(self.raw / f"{fname}.err", "wb") as fe:
                    rc = subprocess.run([PY, "-m", "finetune", *argv], cwd=ROOT, env=self.env, stdout=fo,
                                        stderr=fe).returncode
                results.append([fname, rc, round(time.time() - t, 2)])
        else:
            spec = self.out / f"_batch_{files[0][1].split('/')[0]}.json"
            spec.write_text(json.dumps([[f, a] for f, _, a in files]))
            proc = subprocess.run([PY, "-c", self.BATCH, str(spec), str(self.raw)], cwd=ROOT, env=self.env,
                                  stdout=subprocess.PIPE, text=True)
            results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("[")]
            spec.unlink()
            if proc.returncode:
                print(f"warning: batch interpreter exited {proc.returncode}", file=sys.stderr)
        kind = cases[0][0].split("/")[0]
        if self.jobs == 1:
            self.cpu[f"batch:{kind}"] = round(child_cpu() - cpu, 2)
        print(f"  {kind} batch: {len(cases)} calls, {time.time() - t0:.0f}s", flush=True)
        done = {r[0]: r for r in results}
        for fname, name, argv in files:
            if fname not in done:
                self.record(f"{name}:rc", "not run (batch died)")
                continue
            _, rc, secs = done[fname]
            self.timings[name] = secs
            self.record(f"{name}:rc", rc)
            out = (self.raw / f"{fname}.out").read_text(errors="replace")
            err = (self.raw / f"{fname}.err").read_text(errors="replace")
            self.record_text(f"{name}:stdout", out)
            if "--json" in argv and rc == 0:
                self.record(f"{name}:lines", len(out.splitlines()))
            self.record_text(f"{name}:stderr", err, keep=400)

    # ------------------------------------------------------------------- commands in their own processes

    def cli(self, name: str, argv: list[str], stdout_norm=None) -> int:
        """`python -m finetune ARGV` as its own process (the launcher starts ranks from it); stdout/stderr kept raw,
        recorded normalised (stdout_norm: a function removing timings)."""
        t, cpu = time.time(), child_cpu()
        fname = name.replace("/", "__")
        proc = subprocess.run([PY, "-m", "finetune", *argv], cwd=ROOT, env=self.env, capture_output=True, text=True)
        secs = round(time.time() - t, 2)
        self.timings[name] = secs
        if self.jobs == 1:  # the cpu of this process's children: per case only when one runs at a time
            self.cpu[name] = round(child_cpu() - cpu, 2)
        (self.raw / f"{fname}.out").write_text(proc.stdout)
        (self.raw / f"{fname}.err").write_text(proc.stderr)
        self.record(f"{name}:rc", proc.returncode)
        out = stdout_norm(proc.stdout) if stdout_norm else proc.stdout
        (self.raw / f"{fname}.out.norm").write_text(self.norm(out))
        self.record_text(f"{name}:stdout", out)
        if proc.returncode:
            self.record_text(f"{name}:stderr", proc.stderr[-2000:], keep=400)
            print(f"  {name}: exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        print(f"  {name}: rc {proc.returncode}, {secs}s" + (f" ({self.cpu[name]}s cpu)" if name in self.cpu else ""),
              flush=True)
        return proc.returncode

    def record_files(self, name: str, root: Path, pattern: str = "*") -> None:
        """sha256 of every file under root (JSON files: parsed, wall-clock 'time' dropped, paths normalised)."""
        if not root.exists():
            self.record(f"{name}:files", "missing")
            return
        for p in sorted(root.rglob(pattern)):
            if not p.is_file() or p.name.startswith(".finetune") or p.suffix == ".lock":
                continue
            rel = p.relative_to(root)
            if p.name == ".metadata":
                self.record(f"{name}/{rel}", "sha256:" + sha(self.norm(dcp_metadata_text(p))))
                continue
            if p.suffix == ".json":
                try:
                    data = json.loads(p.read_text())
                    if isinstance(data, dict):
                        data.pop("time", None)
                        if p.name == "finetune_complete.json":  # of .metadata, which holds a random save id
                            data.pop("metadata_sha256", None)
                            data.get("files", {}).pop(".metadata", None)
                    self.record(f"{name}/{rel}", "sha256:" + sha(self.norm(json.dumps(data, sort_keys=True))))
                    continue
                except ValueError:
                    pass
            self.record(f"{name}/{rel}", "sha256:" + sha256_file(p))

    def record_run(self, name: str, out: Path) -> None:
        """metrics.jsonl (timing fields dropped), eval.json, config.toml, checkpoints and exports of a run dir."""
        metrics = out / "metrics.jsonl"
        if metrics.exists():
            rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
            self.record(f"{name}:metrics", [{k: v for k, v in r.items() if not VOLATILE_METRICS.search(k)}
                                            for r in rows])
        if (out / "eval.json").exists():
            self.record(f"{name}:eval", json.loads((out / "eval.json").read_text()))
        if (out / "config.toml").exists():
            self.record_text(f"{name}:config.toml", (out / "config.toml").read_text())
        for sub in ("checkpoints", "hf"):
            if (out / sub).exists():
                self.record_files(f"{name}/{sub}", out / sub)
        if (out / "ref_logps.pt").exists():
            self.record(f"{name}/ref_logps.pt", "sha256:" + sha256_file(out / "ref_logps.pt"))

    def train(self, name: str, task: str, argv: list[str], nproc: int = 1, out: Path | None = None) -> Path:
        out = out or self.runs / name.replace("/", "__")
        if not self.wanted(name):
            return out
        if out.exists():
            shutil.rmtree(out)
        flags = ["--nproc-per-node", str(nproc)] if nproc > 1 else []
        self.cli(name, [task, "-o", str(out), *flags, *argv], stdout_norm=strip_timings)
        self.record_run(name, out)
        return out

    def export(self, name: str, ckpt: Path, argv: list[str]) -> None:
        if not self.wanted(name):
            return
        dest = self.runs / name.replace("/", "__")
        if dest.exists():
            shutil.rmtree(dest)
        self.cli(name, ["export-hf", "--checkpoint", str(ckpt), "--output-dir", str(dest), *argv],
                 stdout_norm=strip_timings)
        self.record_files(name, dest)


TIMING_RES = [
    (re.compile(r"\d+ tok/s \(\d+/device\)"), "<tok/s>"),
    (re.compile(r"mem \d+ MB"), "mem <MB>"),
    (re.compile(r"MFU [\d.]+%"), "MFU <%>"),
    (re.compile(r"peak RSS( so far)? \d+ MB"), r"peak RSS\1 <MB>"),
    (re.compile(r"\d+(\.\d+)?s\b"), "<s>"),
]


def strip_timings(text: str) -> str:
    for rx, sub in TIMING_RES:
        text = rx.sub(sub, text)
    return text


# ----------------------------------------------------------------------------- the cases

EX = "examples/data"


def preview_cases(models: Path) -> list[tuple[str, list[str]]]:
    P = ["preview-data"]
    cases = []

    def both(name, argv, text=True):
        cases.append((f"preview/{name}/json", P + argv + ["--json"]))
        if text:
            cases.append((f"preview/{name}/text", P + argv))

    # the embedded tiny model (configs/tiny.toml)
    both("tiny/default", [])
    for f in ("tiny_chat", "tiny_chat_eval"):
        for packing in ("true", "false"):
            both(f"tiny/{f}/packing={packing}", ["--dataset", f"{EX}/{f}.jsonl", "-n", "50",
                                                f"data.packing={packing}"])
    both("tiny/tiny_chat/max_seq_len=64", ["--dataset", f"{EX}/tiny_chat.jsonl", "-n", "50", "data.max_seq_len=64"],
         text=False)
    cases.append(("preview/tiny/tools_reasoning/error/text", P + ["--dataset", f"{EX}/tools_reasoning.jsonl"]))
    cases.append(("preview/tiny/tools_reasoning/drop/text", P + ["--dataset", f"{EX}/tools_reasoning.jsonl",
                                                                 "data.on_unsupported=drop"]))
    mix = f'data.sources=[{{path="{EX}/tiny_chat.jsonl",weight=2}},{{path="{EX}/tiny_chat_eval.jsonl"}}]'
    both("tiny/mixture/weights", ["-n", "50", mix, "data.path="])
    mix2 = (f'data.sources=[{{path="{EX}/tiny_chat_eval.jsonl",samples=300}},'
            f'{{path="{EX}/tiny_chat.jsonl",epochs=0.5}}]')
    both("tiny/mixture/samples_epochs", ["-n", "50", mix2, "data.path="])
    both("tiny/streaming", ["-n", "50", "data.streaming=true"])
    both("tiny/streaming/packing=false", ["-n", "50", "data.streaming=true", "data.packing=false"], text=False)
    # preference pairs with the dpo preset (and the sft preset, which shows them as it reads them)
    for f in ("tiny_prefs", "tiny_prefs_eval"):
        for packing in ("true", "false"):
            both(f"dpo_preset/{f}/packing={packing}", ["--config", "configs/tiny_dpo.toml", "--dataset",
                                                      f"{EX}/{f}.jsonl", "-n", "50", f"data.packing={packing}"])
    both("tiny/tiny_prefs", ["--dataset", f"{EX}/tiny_prefs.jsonl", "-n", "20"])
    # the tests' tokenizers (one model per family)
    for m in ("llama", "qwen_tied", "qwen_sys", "qwen3"):
        for f, path in (("tiny_chat_eval", f"{EX}/tiny_chat_eval.jsonl"), ("chat", f"{models}/data/chat.jsonl")):
            both(f"{m}/{f}", ["--model", f"{models}/{m}", "--dataset", path, "-n", "50"])
    for packing in ("true", "false"):
        both(f"qwen3/tools_reasoning/packing={packing}", ["--model", f"{models}/qwen3", "--dataset",
                                                          f"{EX}/tools_reasoning.jsonl", "-n", "50",
                                                          "data.max_seq_len=1024", f"data.packing={packing}"])
    both("qwen3/tools_reasoning/streaming", ["--model", f"{models}/qwen3", "--dataset", f"{EX}/tools_reasoning.jsonl",
                                             "-n", "50", "data.max_seq_len=1024", "data.streaming=true"], text=False)
    both("qwen3/tools_reasoning/max_seq_len=256", ["--model", f"{models}/qwen3", "--dataset",
                                                   f"{EX}/tools_reasoning.jsonl", "-n", "50",
                                                   "data.max_seq_len=256"], text=False)
    both("qwen3_tooluse/tools_reasoning", ["--model", f"{models}/qwen3_tooluse", "--dataset",
                                           f"{EX}/tools_reasoning.jsonl", "-n", "50", "data.max_seq_len=1024",
                                           "data.on_unsupported=drop"])
    # the tests' chat templates (data.chat_template) over tool/reasoning rows, with the qwen3-like tokenizer
    for tpl in sorted((models / "templates").glob("*.jinja")):
        base = ["--model", f"{models}/qwen3", f"data.chat_template={tpl}", "data.max_seq_len=1024", "-n", "50"]
        cases.append((f"preview/template/{tpl.stem}/tools/error", P + base + ["--dataset",
                                                                                f"{EX}/tools_reasoning.jsonl"]))
        both(f"template/{tpl.stem}/noschema/drop", base + ["--dataset", f"{models}/data/tools_noschema.jsonl",
                                                           "data.on_unsupported=drop", "data.packing=false"])
        both(f"template/{tpl.stem}/rows", base + ["--dataset", f"{models}/data/rows.jsonl",
                                                  "data.on_unsupported=drop", "data.packing=false"], text=False)
    enable = models / "templates" / "enable_thinking.jinja"
    if enable.exists():
        for v in ("false", "true"):
            both(f"template/enable_thinking/kwargs={v}",
                 ["--model", f"{models}/qwen3", f"data.chat_template={enable}", "--dataset",
                  f"{EX}/tools_reasoning.jsonl", "data.max_seq_len=1024", "-n", "50", "data.packing=false",
                  f"data.chat_template_kwargs.enable_thinking={v}"])
    # a template from a tokenizer dir
    both("template/tokenizer_dir", ["--model", f"{models}/qwen3", f"data.chat_template={models}/llama",
                                    "--dataset", f"{EX}/tiny_chat_eval.jsonl", "-n", "20"], text=False)
    return cases


def plan_cases(models: Path) -> list[tuple[str, list[str]]]:
    base = ["plan", "--nproc-per-node", "2", "--sac-ratios", "0,1", "--micro-batch-sizes", "1,2", "--gpu-memory",
            "1GB"]
    return [("plan/tiny/json", base + ["--json"]),
            ("plan/llama_hsdp/json", base[:1] + ["--model", f"{models}/llama", "--nnodes", "2", "--nproc-per-node",
                                                 "2", "--sac-ratios", "0.5", "--micro-batch-sizes", "1",
                                                 "--gpu-memory", "1GB", "--json", "parallel.dp_replicate=2"])]


def chains(h: Harness) -> list:
    """The cases as chains of steps: a chain runs in order (later steps read earlier outputs); chains are
    independent of each other (--jobs runs that many at a time)."""
    M = h.models
    STEPS = ["train.max_steps=3", "train.log_interval=1", "checkpoint.export_hf=true", "train.mixed_precision=fp32"]
    TEST_DATA = ["--dataset", f"{M}/data/chat.jsonl", "eval.path=", "train.micro_batch_size=4", "train.lr=1e-3"]
    tiny = h.runs / "sft__tiny_full"
    lora = h.runs / "sft__llama_lora"
    qfull = h.runs / "sft__qwen_tied_full"
    prep = h.runs / "prepare__llama"
    DPO = ["train.max_steps=3", "train.log_interval=1", "eval.num_samples=16", "train.mixed_precision=fp32"]
    RANKS = ["train.max_steps=3", "train.log_interval=1", "eval.path=", "train.mixed_precision=fp32",
             "checkpoint.export_hf=true"]

    def prepare():
        if h.wanted("prepare/llama"):
            shutil.rmtree(prep, ignore_errors=True)
            h.cli("prepare/llama", ["prepare-checkpoint", "--model", f"{M}/llama", "--output-dir", str(prep)],
                  stdout_norm=strip_timings)
            h.record_files("prepare/llama", prep)

    return [
        # ranks: context parallelism and HSDP (first: the longest chain)
        [lambda: h.train("ranks/cp2", "sft", RANKS + ["parallel.cp=2"], nproc=2),
         lambda: h.train("ranks/hsdp_2x2", "sft", RANKS + ["parallel.dp_replicate=2", "train.micro_batch_size=2"],
                         nproc=4)],
        # preview-data and plan, each a batch in one interpreter
        [lambda: h.cli_batch(preview_cases(M)), lambda: h.cli_batch(plan_cases(M))],
        # the embedded model; exact resume from its final checkpoint (step 3 -> 4, another dir); dpo from its
        # export (README)
        [lambda: h.train("sft/tiny_full", "sft", STEPS + ["eval.num_samples=8"]),
         lambda: h.train("sft/tiny_resume", "sft", ["--resume-from", str(tiny / "checkpoints" / "step-3"),
                                                    "eval.path=", "train.log_interval=1",
                                                    "train.mixed_precision=fp32", "train.max_steps=4"]),
         lambda: h.train("dpo/from_sft", "dpo", ["--model", str(tiny / "hf"), *DPO, "checkpoint.export_hf=true"]),
         lambda: h.train("sft/tiny_full_nopack", "sft", STEPS + ["data.packing=false", "eval.path=",
                                                                 "train.max_steps=2"])],
        # LoRA (export-hf --adapter), tied + modules_to_save, tied full (bf16, ac; export fp32 in 100KB shards)
        [lambda: h.train("sft/llama_lora", "sft", ["--model", f"{M}/llama", *TEST_DATA, *STEPS, "lora.rank=8"]),
         lambda: h.export("export/llama_lora_adapter", lora, ["--adapter"]),
         lambda: h.train("sft/qwen_tied_lora_mts", "sft", ["--model", f"{M}/qwen_tied", *TEST_DATA, *STEPS,
                                                           "lora.rank=8", 'lora.modules_to_save=["lm_head"]']),
         lambda: h.train("sft/qwen_tied_full", "sft", ["--model", f"{M}/qwen_tied", *TEST_DATA, *STEPS,
                                                       "train.mixed_precision=bf16", "ac.ratio=0.5"]),
         lambda: h.export("export/qwen_tied_full_fp32_sharded", qfull, ["--dtype", "float32", "--max-shard-size",
                                                                        "100KB"])],
        # other architectures' load/export paths; prepare-checkpoint and sft from the prepared dir
        [*[(lambda arch=arch: h.train(f"sft/{arch}_full", "sft", ["--model", f"{M}/{arch}", *TEST_DATA, *STEPS,
                                                                  "train.max_steps=2"]))
           for arch in ("neox", "mixtral", "gemma2")],
         prepare,
         lambda: h.train("sft/llama_from_prepared", "sft", ["--model", str(prep), *TEST_DATA, *STEPS,
                                                            "train.max_steps=2"])],
        # dpo: LoRA with the adapters as reference, SimPO
        [lambda: h.train("dpo/lora_adapters_ref", "dpo", [*DPO, "lora.rank=8", "eval.path="]),
         lambda: h.train("dpo/simpo", "dpo", [*DPO, "dpo.loss=simpo", "dpo.beta=2.0", "eval.path=",
                                              "train.max_steps=2"])],
    ]


def run_all(h: Harness, jobs: int) -> None:
    def run(chain):
        for step in chain:
            step()
    todo = chains(h)
    if jobs <= 1:
        for chain in todo:
            run(chain)
        return
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(jobs) as pool:
        for f in [pool.submit(run, c) for c in todo]:
            f.result()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", nargs="?", type=Path, help="where manifest.json, raw/ and runs/ go")
    ap.add_argument("--models", type=Path, help="the fixed inputs (--build-models); default: built into "
                                                "OUT_DIR/models")
    ap.add_argument("--build-models", type=Path, metavar="DIR", help="only build the fixed inputs into DIR")
    ap.add_argument("--fresh", action="store_true", help="preview-data/plan: one process per case")
    ap.add_argument("--only", help="regex: run only the matching cases (and what they read must be there)")
    ap.add_argument("--jobs", type=int, default=1, help="independent chains of cases run at a time (default 1)")
    args = ap.parse_args()
    if not (ROOT / "pyproject.toml").is_file() or not (ROOT / "examples").is_dir():
        ap.error(f"run from the root of a checkout of finetune (cwd {ROOT})")
    if args.build_models:
        build_models(args.build_models.resolve())
        return 0
    if not args.out_dir:
        ap.error("OUT_DIR is required")
    out = args.out_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    models = args.models.resolve() if args.models else out / "models"
    if not args.models and not (models / "MANIFEST.json").exists():
        subprocess.run([PY, __file__, "--build-models", str(models)], cwd=ROOT, check=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false"))
    listed = json.loads((models / "MANIFEST.json").read_text())
    bad = [k for k, v in listed.items() if not (models / k).exists() or sha256_file(models / k) != v]
    if bad:
        sys.exit(f"error: {models} differs from its MANIFEST.json: {bad[:5]}")
    h = Harness(out, models, args.fresh, args.only, args.jobs)
    t0 = time.time()
    git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    try:
        run_all(h, args.jobs)
    finally:
        shutil.rmtree(out / "_datasets_cache", ignore_errors=True)
        total = round(time.time() - t0, 1)
        h.record("_inputs/models_manifest", "sha256:" + sha(json.dumps(listed, sort_keys=True)))
        (out / "manifest.json").write_text(json.dumps(dict(sorted(h.manifest.items())), indent=1) + "\n")
        (out / "run_info.json").write_text(json.dumps({
            "commit": git, "dirty": bool(dirty), "root": str(ROOT), "python": PY, "models": str(models),
            "fresh": args.fresh, "only": args.only, "jobs": args.jobs, "seconds": total,
            "cpu_seconds": round(child_cpu(), 1),
            "timings": h.timings, "cpu": h.cpu}, indent=1) + "\n")
    kinds: dict = {}
    for key in h.manifest:
        if key.endswith(":rc"):
            kinds[key.split("/")[0]] = kinds.get(key.split("/")[0], 0) + 1
    failed = {k: v for k, v in h.manifest.items() if k.endswith(":rc") and v not in (0, 1, 2)}
    print(f"{len(h.manifest)} manifest entries; CLI calls by kind {kinds}; {total}s wall, "
          f"{child_cpu():.0f}s cpu -> {out / 'manifest.json'}")
    if failed:
        print(f"calls that crashed: {failed}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
