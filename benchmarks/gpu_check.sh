#!/usr/bin/env bash
# GPU path check on one CUDA machine with no internet: bf16 SFT of the embedded default, then `finetune bench` of a
# random ~1.1B Llama (packed 2048-token rows) with sdpa, Liger and regional compile. Missing wheels travel in .whl/.
#   bash benchmarks/gpu_check.sh [stage...]     stages: env sft bench (default: all); logs under ${OUT:-/tmp/gpu}
set -uo pipefail
OUT=${OUT:-/tmp/gpu}; mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 WANDB_MODE=disabled
if [ -z "${NO_WHL:-}" ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD || exit 1
fi
FT="python3 -m finetune"
stages=${*:-env sft bench}
for s in $stages; do case $s in
env)
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch,transformers,peft,accelerate,datasets,triton;print('torch',torch.__version__,'cuda',torch.version.cuda,'transformers',transformers.__version__,'peft',peft.__version__,'datasets',datasets.__version__,'triton',triton.__version__)"
  python3 -c "import liger_kernel,importlib.metadata as m;print('liger-kernel',m.version('liger-kernel'))"
  python3 -c "import importlib.util as u;print('flash_attn', u.find_spec('flash_attn') is not None)";;
sft)
  for mp in bf16; do
    /usr/bin/time -v $FT sft -o /tmp/gpu-sft-$mp train.mixed_precision=$mp 2>&1 | grep -vE "^\s+(Average|Exit|Page|Swaps|File|Socket|Signals|Voluntary|Involuntary|Minor|Major|System time|User time|Percent)" | tee $OUT/sft-$mp.log | tail -25
  done;;
bench)
  [ -d /tmp/m1b ] || python3 - <<'PY'
import sys; sys.path.insert(0, "benchmarks")
from load_and_export import make_model_dir
from pathlib import Path
print("params", make_model_dir(Path("/tmp/m1b"), layers=16, hidden=2048, intermediate=5632, vocab=32000))
PY
  common="--model /tmp/m1b --dataset examples/data/tiny_chat.jsonl --steps 8 --warmup 3 data.packing=true data.max_seq_len=2048 train.micro_batch_size=8 train.mixed_precision=bf16"
  for name in ${VARIANTS:-base liger compile liger+compile}; do
    case $name in base) ov="";; liger) ov="model.liger=true";; compile) ov="model.compile=true";;
      liger+compile) ov="model.liger=true model.compile=true";; esac
    echo "== bench $name ($ov)"
    $FT bench $common --sac-ratios ${RATIOS:-0,0.5,1} -o /tmp/bench-$name $ov 2>&1 | tail -12
    cp /tmp/bench-$name/bench.md $OUT/bench-${name/+/_}.md 2>/dev/null
  done;;
esac; done
