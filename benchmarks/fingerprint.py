"""A checkout's behaviour, fingerprinted, to show a refactor changes none of it: the losses, checkpoint tensors and
export files of sft (full, tied, LoRA with its adapter export, MoE, cp 2, HSDP 2, fp8 emulated) and dpo runs of 3 steps
on tiny models, preview-data --json over the examples with three chat templates, and the one-line errors of bad input.
usage: uv run python benchmarks/fingerprint.py REPO OUT.json (REPO: a checkout, e.g. a `git worktree add` of an older
commit; this checkout's environment runs it); compare two OUT files with `python benchmarks/fingerprint.py --diff A B`
(finetune_export.json records paths and a time: left out)."""
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

if sys.argv[1] == "--diff":
    a, b = (json.loads(Path(f).read_text()) for f in sys.argv[2:4])
    for x in (a, b):
        for run in x.values():
            for part in ("export", "adapter"):
                if isinstance(run.get(part), dict):
                    run[part].pop("finetune_export.json", None)
    for k in sorted(set(a) | set(b)):
        print(("same  " if a.get(k) == b.get(k) else "DIFF  ") + k)
    raise SystemExit(0 if a == b else 1)
REPO, OUT = Path(sys.argv[1]).resolve(), Path(sys.argv[2])
MODELS = Path(tempfile.gettempdir()) / "finetune-fingerprint-models"
PY = sys.executable
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def models():
    if (MODELS / "done").exists():
        return
    from conftest import make_model_dir
    make_model_dir(MODELS / "llama", "llama3", "llama", tied=False, num_layers=2)
    make_model_dir(MODELS / "qwen", "chatml", "qwen2", tied=True, num_layers=2)
    make_model_dir(MODELS / "qwen3", "qwen3", "qwen2", tied=True, num_layers=2)
    make_model_dir(MODELS / "mixtral", "llama3", "mixtral", tied=False, num_layers=2)
    (MODELS / "done").write_text("")


def cli(*args, nproc=1):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    extra = ["--nproc-per-node", str(nproc)] if nproc > 1 and args[0] in ("sft", "dpo") else []
    p = subprocess.run([PY, "-m", "finetune", *args, *extra], cwd=REPO, env=env, capture_output=True, text=True)
    return p


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()[:16]


def tensors_of_checkpoint(d: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    import torch
    try:
        # fp8 checkpoints pickle torchao's weight wrapper: readable only once torchao is imported (whatever else this
        # process imported before), so that two fingerprints read them alike
        import torchao.float8  # noqa: F401
    except ImportError:
        pass
    try:
        with tempfile.TemporaryDirectory() as t:
            dcp_to_torch_save(str(d), f"{t}/x.pt")
            sd = torch.load(f"{t}/x.pt", weights_only=False)
    except BaseException as e:  # fp8's torchao tensor subclasses (DCP's CheckpointException): the raw files then
        return {"unreadable": type(e).__name__, **{p.name: sha(p.read_bytes()) for p in sorted(d.glob("*.distcp"))}}
    out = {}
    def walk(prefix, v):
        if isinstance(v, torch.Tensor):
            out[prefix] = sha(v.contiguous().view(-1).view(torch.uint8).numpy().tobytes()) + str(v.dtype)
        elif isinstance(v, dict):
            for k in sorted(v, key=str):
                walk(f"{prefix}.{k}", v[k])
        elif isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                walk(f"{prefix}.{i}", x)
        else:
            out[prefix] = repr(v)
    walk("", sd)
    return out


def files(d: Path) -> dict:
    return {str(p.relative_to(d)): sha(p.read_bytes()) for p in sorted(d.rglob("*")) if p.is_file()
            and p.suffix in (".safetensors", ".json", ".jinja") and "trainer_state" not in p.name}


def run(name, cmd, *over, nproc=1, data="examples/data/tiny_chat.jsonl", model="llama"):
    out = Path(tempfile.mkdtemp()) / name
    p = cli(cmd, "--model", str(MODELS / model), "--dataset", data, "-o", str(out), "train.max_steps=3",
            "checkpoint.export_hf=true", "eval.num_samples=0", "data.max_seq_len=128", *over, nproc=nproc)
    r = {"rc": p.returncode}
    if p.returncode:
        r["err"] = p.stderr[-2000:]
        return r
    r["metrics"] = [{k: m[k] for k in m if k in ("loss", "grad_norm", "num_tokens") or k.startswith("reward")}
                    for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]
    ck = sorted((out / "checkpoints").glob("step-*"))[-1]
    r["checkpoint"] = tensors_of_checkpoint(ck)
    r["export"] = files(out / "hf")
    if "lora.rank=4" in over:
        a = cli("export-hf", "--checkpoint", str(ck), "--output-dir", str(out / "adapter"), "--adapter")
        r["adapter_rc"] = a.returncode
        r["adapter"] = files(out / "adapter") if a.returncode == 0 else a.stderr[-1000:]
    return r


models()
res = {}
RUNS = {"full": (("full", "sft"), {}), "tied": (("tied", "sft"), {"model": "qwen"}),
        "lora": (("lora", "sft", "lora.rank=4"), {}), "moe": (("moe", "sft"), {"model": "mixtral"}),
        "dpo": (("dpo", "dpo"), {"data": "examples/data/tiny_prefs.jsonl"}),
        "cp": (("cp", "sft", "parallel.cp=2"), {"nproc": 2}),
        "hsdp": (("hsdp", "sft", "parallel.dp_replicate=2"), {"nproc": 2}),
        "fp8": (("fp8", "sft", "model.fp8=tensorwise"), {})}
for key, (a, kw) in RUNS.items():
    res[key] = run(*a, **kw)
    print(key, res[key]["rc"], flush=True)
for model in ("llama", "qwen", "qwen3"):
    for data in ("tiny_chat.jsonl", "tools_reasoning.jsonl", "tiny_chat_eval.jsonl"):
        p = cli("preview-data", "--model", str(MODELS / model), "--dataset", f"examples/data/{data}", "--num", "5",
                "--json", "data.max_seq_len=256")
        res[f"preview {model} {data}"] = {"rc": p.returncode, "out": sha(p.stdout.encode()), "err": p.stderr[-300:]}
for bad in (["train.lr=-1"], ["train.nope=1"], ["--model", "/nonexistent"], ["lora.quantize_base=nf8"],
            ["parallel.ep=2"], ["model.fp8=bogus"]):
    p = cli("sft", "--model", str(MODELS / "llama"), "--dataset", "examples/data/tiny_chat.jsonl", *bad)
    res["error " + " ".join(bad)] = {"rc": p.returncode, "err": p.stderr.strip()}
OUT.write_text(json.dumps(res, indent=1, sort_keys=True))
print("ok", {k: v.get("rc") for k, v in res.items()})
