#!/usr/bin/env bash
# GPU checks on one CUDA machine with no internet. Missing Python packages travel as wheels in .whl/ (ignored by git):
#   bash benchmarks/gpu_check.sh wheels            HERE (a machine with PyPI): fill .whl/, then carry .whl to the GPU
#   bash benchmarks/gpu_check.sh --list            the stages and their expected time on one H100
#   bash benchmarks/gpu_check.sh [stage...]        on the GPU machine; logs and results under ${OUT:-/tmp/gpu}, each
#                                                  written as it comes (a call cut off at its limit keeps what it had)
# Each stage fits one 10-minute call on an H100 (estimates; what ran, and its figures: benchmarks/RESULTS.md). Without
# CUDA a stage stops, in one line, where CUDA is first needed (a dry run). The figures of issue 50 first, in order,
# one call each (benchmarks/gpu_figures.py; JSON lines to benchmarks/results/<stage>.jsonl, packed into
# $OUT/results.tgz at the end: untar it here, commit, `python3 benchmarks/results.py tables`):
#   FINETUNE_COMMIT=<hash> bash benchmarks/gpu_check.sh peers | fp8 | moe30b | profile | offload131k | lora8b | full
# then the checks of the GPU path:
#   env varlen evalcompile opac flce | offload | tests-a | tests-b | tests-c | bench | moe | moesft | qlora
set -uo pipefail
STAGES=(
  "peers        9 min  gpu_figures.py: finetune defaults vs TRL at its fastest, alternated, realistic rows, MFU"
  "fp8          8 min  gpu_figures.py: model.fp8 off / tensorwise / rowwise at Llama-3-8B widths (8 layers, 2.8B)"
  "moe30b       8 min  gpu_figures.py: grouped_mm vs eager experts at Qwen3-30B-A3B widths (4 layers, 3.1B), recompiles"
  "profile      4 min  gpu_figures.py: the defaults (886M), one step under torch.profiler: device time by kind"
  "offload131k  6 min  gpu_figures.py: 886M at 131,072-token packed rows, all blocks AC, compiled: ac.offload off / on"
  "lora8b       6 min  gpu_figures.py -> gpu_points.py lora8b: 8B + LoRA r16 at plan's point vs plan's memory"
  "full         8 min  gpu_figures.py -> gpu_points.py full: the largest full fine-tune plan says fits, vs plan"
  "env          1 min  versions, the GPU, torch's varlen_attn signature"
  "varlen       1 min  varlen path vs a per-sample fp32 reference: GQA 32/8 d128, MHA d64 at 4k, window 256, d16, fp32 cast"
  "evalcompile  2 min  held-out eval (loss + generate) on compiled blocks compiles 0 graphs; training then compiles"
  "opac         1 min  op-level AC: varlen attention runs in backward 0 times (block AC: once a block)"
  "flce         1 min  Liger fused loss: lm_head gradient error, accum_dtype None vs float32, V/H 32000/2048, 128256/4096"
  "offload      8 min  2-block packed-tensor count (0 parameters), then 886M at SEQ=32768: offload off/on, compile off/on"
  "tests-a      5 min  tests/test_gpu.py: varlen/flex/flash packed = unpacked; the auto defaults learn"
  "tests-b      6 min  tests/test_gpu.py: Liger, compile+AC, varlen, all together = the plain path"
  "tests-c      4 min  tests/test_gpu.py: bench sweeps a compiled checkpointed model; offload on streams = without"
  "sft          3 min  the embedded default config in bf16"
  "bench        6 min  finetune bench, 886M Llama, 8 packed rows x 2048: VARIANTS (default: auto and sdpa; +fp8: model.fp8=tensorwise)"
  "moe          3 min  finetune bench, a random 892M Qwen3-MoE (8 layers, 64 experts of 512, 8 a token): grouped_mm vs eager"
  "moesft       2 min  finetune sft, a random 193M Qwen3-MoE of 12 layers (> dynamo's recompile limit), compiled blocks: recompiles"
  "qlora        5 min  tests/test_gpu.py -k host_offload (1 min); qlora_gpu.py: Llama-3-70B widths, 8 and 4 layers, QLoRA vs bf16 LoRA r16 vs plan (4 min)"
)
if [ "${1:-}" = --list ]; then printf '%s\n' "${STAGES[@]}"; exit 0; fi
set -uo pipefail
OUT=${OUT:-/tmp/gpu}; mkdir -p "$OUT"
WHEELS="transformers==5.23.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 liger-kernel==0.8.5 trl==1.16.0 torchao==0.18.0"
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
export FINETUNE_COMMIT=${FINETUNE_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
model_dir() {  # model_dir PATH 'ARGS': a random model at PATH (once), load_and_export.make_model_dir(PATH, ARGS)
  [ -d "$1" ] || python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path
from load_and_export import make_model_dir; print('params', make_model_dir(Path('$1'), $2))"
}
m1b() {  # the 886M Llama-shaped model of the bench stages
  model_dir /tmp/m1b "layers=16, hidden=2048, intermediate=5632, vocab=32000"
}
cuda() {  # the dry-run stop: without CUDA a stage ends here, in one line
  python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" && return 0
  echo "$1: needs a CUDA device from here on (dry run: stops here)"; return 1
}
stages=${*:-env varlen evalcompile opac flce}
for s in $stages; do case $s in
env)
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch,transformers,peft,accelerate,datasets,triton;print('torch',torch.__version__,'cuda',torch.version.cuda,'transformers',transformers.__version__,'peft',peft.__version__,'datasets',datasets.__version__,'triton',triton.__version__)"
  python3 -c "import importlib.metadata as m;print({p: m.version(p) for p in ('liger-kernel','trl','pyarrow','fsspec')})"
  python3 -c "import inspect, torch.nn.attention.varlen as v;print('varlen_attn', inspect.signature(v.varlen_attn))"
  python3 -c "import importlib.util as u;print('flash_attn', u.find_spec('flash_attn') is not None)";;
varlen|evalcompile|opac|flce)
  python3 benchmarks/gpu_stages.py $s --out $OUT 2>&1 | tee -a $OUT/$s.log | tail -12;;
tests-a|tests-b|tests-c)
  cuda $s || continue
  k=$(case $s in tests-a) echo "varlen_and_flex or auto_defaults";; tests-b) echo kernels_and_compile;;
      *) echo "bench or ac_offload";; esac)
  python3 -m pytest -q -x tests/test_gpu.py -k "$k" -p no:cacheprovider 2>&1 | tee -a $OUT/$s.log | tail -15;;
sft)
  cuda $s || continue
  $( [ -x /usr/bin/time ] && echo /usr/bin/time -v) $FT sft -o /tmp/gpu-sft-bf16 train.mixed_precision=bf16 2>&1 | grep -vE "^\s+(Average|Exit|Page|Swaps|File|Socket|Signals|Voluntary|Involuntary|Minor|Major|System time|User time|Percent)" | tee $OUT/sft-bf16.log | tail -25;;
bench)
  cuda $s || continue
  m1b
  common="--model /tmp/m1b --dataset examples/data/tiny_chat.jsonl --steps 8 --warmup 3 data.packing=true data.max_seq_len=2048 train.micro_batch_size=8 train.mixed_precision=bf16"
  for name in ${VARIANTS:-auto sdpa}; do
    attn=sdpa; liger=false; comp=false
    case $name in auto*) attn=auto; liger=auto; comp=auto;; *varlen*) attn=varlen;; esac
    case $name in *liger*) liger=true;; esac
    case $name in *compile*) comp=true;; esac
    fp8=off; case $name in *fp8*) fp8=tensorwise;; esac
    echo "== bench $name (model.attn_implementation=$attn model.liger=$liger model.compile=$comp model.fp8=$fp8)"
    $FT bench $common --sac-ratios ${RATIOS:-0} -o /tmp/bench-$name model.attn_implementation=$attn \
      model.liger=$liger model.compile=$comp model.fp8=$fp8 2>&1 | tee -a $OUT/bench.log | tail -8
    cp /tmp/bench-$name/bench.md $OUT/bench-${name//+/_}.md 2>/dev/null
  done;;
moe)
  cuda $s || continue
  model_dir /tmp/moe "8, 1024, 4096, 32000, arch='qwen3_moe', num_key_value_heads=4, head_dim=64,
    max_position_embeddings=4096, moe_intermediate_size=512, num_experts=64, num_experts_per_tok=8"
  for impl in grouped_mm eager; do
    $FT bench --model /tmp/moe --dataset examples/data/tiny_chat.jsonl --steps 6 --warmup 2 --sac-ratios 0 \
      data.packing=true data.max_seq_len=2048 train.micro_batch_size=8 train.mixed_precision=bf16 \
      model.experts_implementation=$impl -o /tmp/moe-$impl 2>&1 | tee -a $OUT/moe.log | tail -4
  done;;
moesft)
  cuda $s || continue
  model_dir /tmp/moe12 "12, 512, 2048, 32000, arch='qwen3_moe', num_key_value_heads=4, head_dim=64,
    max_position_embeddings=4096, moe_intermediate_size=256, num_experts=32, num_experts_per_tok=4,
    output_router_logits=True"
  TORCH_LOGS=recompiles $FT sft --model /tmp/moe12 --dataset examples/data/tiny_chat.jsonl -o /tmp/sft-moe12 \
    train.max_steps=10 data.packing=true data.max_seq_len=2048 train.micro_batch_size=4 train.mixed_precision=bf16 \
    model.compile=true eval.path= 2>&1 | tee $OUT/moesft.log | grep -E "step  |Recompiling|guard failure|    - |recompile_limit"
  echo "recompiles: $(grep -c 'Recompiling function' $OUT/moesft.log) (one for the packed rows' dynamic shapes is expected; one a layer is the bug of bcfc2cc)";;
peers|fp8|moe30b|profile|offload131k|lora8b|full)
  python3 benchmarks/gpu_figures.py $s --work /tmp/gpu-figures 2>&1 | tee -a $OUT/$s.log | tail -25
  tar -czf $OUT/results.tgz benchmarks/results 2>/dev/null;;
offload)
  python3 benchmarks/gpu_stages.py offload --out $OUT 2>&1 | tee -a $OUT/offload.log | tail -3
  cuda $s || continue
  m1b
  for comp in ${OFFLOAD_COMPILE:-false true}; do for off in false true; do  # 6 timed steps each, all blocks AC
    $FT bench --model /tmp/m1b --dataset examples/data/tiny_chat.jsonl --steps 6 --warmup 2 --sac-ratios 1 \
      data.packing=true data.max_seq_len=${SEQ:-32768} train.micro_batch_size=1 train.mixed_precision=bf16 \
      model.compile=$comp ac.offload=$off -o /tmp/offload-$comp-$off 2>&1 | tee -a $OUT/offload.log | tail -4
    cp /tmp/offload-$comp-$off/bench.md $OUT/offload-compile_$comp-offload_$off.md 2>/dev/null
  done; done;;
qlora)
  # pytest: 2 spawned processes, each building a 4-layer 256-wide model twice (~30 s with CUDA and imports). The
  # script: 8 layers of 70B widths written once (18 GB of bf16: 8 x 1.7 GB + 4.2 GB embedding and lm_head, ~30 s),
  # 4 plans on the CPU meanwhile, then 2 rounds of 4 builds (QLoRA, LoRA at 8 and 4 layers: 18 and 11 GB read from
  # the page cache and put on the GPU, ~10 s a build at 2 GB/s) of 8 steps of 2,048 tokens (~1 s each, dequantizing)
  cuda $s || continue
  python3 -m pytest -q -x tests/test_gpu.py -k host_offload -p no:cacheprovider 2>&1 | tee -a $OUT/qlora.log | tail -8
  HF_DATASETS_DISABLE_PROGRESS_BARS=1 python3 benchmarks/qlora_gpu.py --layers ${QLORA_LAYERS:-8} \
    --out $OUT/qlora_gpu.json --work /tmp/qlora_gpu 2>&1 | tee -a $OUT/qlora.log \
    | grep --line-buffered -vE "^(kernels: |lora: rank|qlora: [0-9]+ frozen|W[0-9]{4} )";;
*) echo "unknown stage '$s' (bash benchmarks/gpu_check.sh --list)"; exit 2;;
esac; done
