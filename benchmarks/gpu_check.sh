#!/usr/bin/env bash
# GPU checks on one CUDA machine with no internet. Missing Python packages travel as wheels in .whl/ (ignored by git):
#   bash benchmarks/gpu_check.sh wheels            HERE (a machine with PyPI): fill .whl/, then carry .whl to the GPU
#   bash benchmarks/gpu_check.sh [stage...]        on the GPU machine; logs and tables under ${OUT:-/tmp/gpu}
# Stages (each under the device's 10-minute limit on an H100):
#   env      versions, the GPU, whether torch has varlen_attn
#   tests    python3 -m pytest tests/test_gpu.py (varlen == unpacked in bf16; the defaults learn; compile+Liger+varlen)
#   sft      the embedded default in bf16
#   bench    `finetune bench` of the 886M Llama, 8 packed rows x 2048, one point per VARIANTS entry (default: the
#            auto defaults and the old defaults, sdpa without Liger or compile) at RATIOS (default 0); MFU in
#            torchtitan's convention. VARIANTS="auto sdpa liger compile liger+compile varlen varlen+liger
#            varlen+compile" measures every combination (three calls' worth: split it)
#   peers    benchmarks/compare_peers.py on CUDA, ONE alternating round (finetune defaults, TRL, HF Trainer) added to
#            the rounds in outputs/peers/compare_peers.json when there is one (a machine starts bare: bring back
#            $OUT/peers/compare_peers.json into outputs/peers/ and carry outputs/peers), written to $OUT/peers/
#   offload  `finetune bench` of the 886M Llama on one long packed row (SEQ, default 32768), every block checkpointed,
#            ac.offload=false / true alternating twice: peak memory and step time with and without (issue 24)
#   lora8b   benchmarks/gpu_points.py lora8b: an 8B-class model with LoRA, against plan's memory figure
#   full     benchmarks/gpu_points.py full: the largest full fine-tune plan says fits one GPU, against plan
# The issue-22 "Done when" in five calls: `env tests`, `bench`, `peers`, `peers` (+ `lora8b`, `full` for the points).
set -uo pipefail
OUT=${OUT:-/tmp/gpu}; mkdir -p "$OUT"
WHEELS="transformers==5.23.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 liger-kernel==0.8.5 trl==1.16.0"
if [ "${1:-}" = wheels ]; then  # pure-Python wheels; the image has torch, triton, accelerate, peft, tokenizers
  mkdir -p .whl  # /.whl/ is in .gitignore
  exec python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any -d .whl $WHEELS
fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 WANDB_MODE=disabled
if [ -z "${NO_WHL:-}" ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD || exit 1
fi
FT="python3 -m finetune"
m1b() {  # the 886M Llama-shaped model (random weights) of the bench stages
  [ -d /tmp/m1b ] || python3 - <<'PY'
import sys; sys.path.insert(0, "benchmarks")
from load_and_export import make_model_dir
from pathlib import Path
print("params", make_model_dir(Path("/tmp/m1b"), layers=16, hidden=2048, intermediate=5632, vocab=32000))
PY
}
stages=${*:-env tests bench}
for s in $stages; do case $s in
env)
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch,transformers,peft,accelerate,datasets,triton;print('torch',torch.__version__,'cuda',torch.version.cuda,'transformers',transformers.__version__,'peft',peft.__version__,'datasets',datasets.__version__,'triton',triton.__version__)"
  python3 -c "import importlib.metadata as m;print({p: m.version(p) for p in ('liger-kernel','trl','pyarrow','fsspec')})"
  python3 -c "import inspect, torch.nn.attention.varlen as v;print('varlen_attn', inspect.signature(v.varlen_attn))"
  python3 -c "import importlib.util as u;print('flash_attn', u.find_spec('flash_attn') is not None)";;
tests)
  python3 -m pytest -q -x tests/test_gpu.py 2>&1 | tee $OUT/tests.log | tail -15;;
sft)
  /usr/bin/time -v $FT sft -o /tmp/gpu-sft-bf16 train.mixed_precision=bf16 2>&1 | grep -vE "^\s+(Average|Exit|Page|Swaps|File|Socket|Signals|Voluntary|Involuntary|Minor|Major|System time|User time|Percent)" | tee $OUT/sft-bf16.log | tail -25;;
bench)
  m1b
  common="--model /tmp/m1b --dataset examples/data/tiny_chat.jsonl --steps 8 --warmup 3 data.packing=true data.max_seq_len=2048 train.micro_batch_size=8 train.mixed_precision=bf16"
  for name in ${VARIANTS:-auto sdpa}; do
    attn=sdpa; liger=false; comp=false
    case $name in auto) attn=auto; liger=auto; comp=auto;; *varlen*) attn=varlen;; esac
    case $name in *liger*) liger=true;; esac
    case $name in *compile*) comp=true;; esac
    echo "== bench $name (model.attn_implementation=$attn model.liger=$liger model.compile=$comp)"
    $FT bench $common --sac-ratios ${RATIOS:-0} -o /tmp/bench-$name model.attn_implementation=$attn \
      model.liger=$liger model.compile=$comp 2>&1 | tail -8
    cp /tmp/bench-$name/bench.md $OUT/bench-${name//+/_}.md 2>/dev/null
  done;;
peers)
  mkdir -p /tmp/peers && cp outputs/peers/compare_peers.json /tmp/peers/ 2>/dev/null
  python3 benchmarks/compare_peers.py --only peers --device cuda --rounds 1 --steps ${STEPS:-8} --warmup 3 \
    --systems defaults,trl,hf --append --output-dir /tmp/peers 2>&1 | tee -a $OUT/peers.log | tail -12
  mkdir -p $OUT/peers && cp /tmp/peers/compare_peers.json $OUT/peers/;;
offload)
  m1b
  for round in 1 2; do for off in false true; do
    $FT bench --model /tmp/m1b --dataset examples/data/tiny_chat.jsonl --steps 6 --warmup 2 --sac-ratios 1 \
      data.packing=true data.max_seq_len=${SEQ:-32768} train.micro_batch_size=1 train.mixed_precision=bf16 \
      ac.offload=$off -o /tmp/offload-$off-$round 2>&1 | tail -4
    cp /tmp/offload-$off-$round/bench.md $OUT/offload-$off-$round.md 2>/dev/null
  done; done;;
lora8b|full)
  python3 benchmarks/gpu_points.py $s --output-dir /tmp/points 2>&1 | tee $OUT/$s.log | grep -v "^step"
  cp /tmp/points/gpu_points.json $OUT/$s.json 2>/dev/null;;
esac; done
