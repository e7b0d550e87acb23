#!/usr/bin/env bash
# The CUDA checks, as one prepared run for a machine with a GPU (about 10 minutes):
#   1. greedy parity on the GPU: tiny Llama/Qwen2/Qwen3/Mistral in float64 (exact), then the
#      default SmolLM2 model in bfloat16 against generate, near ties allowed;
#   2. the engine's start on CUDA (SmolLM2, bfloat16): whether the compiled forward
#      (worker/compiled.py) comes up there, its compile time, and a restart's;
#   3. the benchmark on CUDA in bfloat16: SmolLM2 and the small config, 256 concurrent
#      requests, tokenq's engine (its fast path: the compiled forward, merged q/k/v and
#      gate/up GEMMs) against the same engine with the fast path off, HF static batching and
#      the ideal forward; the GPU's GEMM peak and each system's MFU in the same table.
# The design, and what is not built yet (CUDA graphs, a GPU paged kernel): docs/cuda.md.
# Results go to $OUT (default ./cuda-results): device.txt, parity.txt, engine-start.txt,
# bench.md, bench.json, bench.png.
# A torch that already imports (the machine's CUDA build) is kept by the set-up.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_setup.sh"
OUT="${OUT:-$ROOT/cuda-results}"
mkdir -p "$OUT"
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name(0))" | tee "$OUT/device.txt"
python scripts/bench_parity.py --device cuda --bf16 2>&1 | tee "$OUT/parity.txt"
for run in first restart; do
  python - <<'PY' 2>&1 | grep -E "compiled forward|decode attention|forward:|started" | sed "s/^/$run: /" | tee -a "$OUT/engine-start.txt"
import logging, time
logging.basicConfig(level=logging.INFO, format="%(message)s")
t = time.time()
from worker.engine import Engine
from worker.config import EngineConfig
from worker.models import load
model, tok = load("smollm2", device="cuda", dtype="bfloat16")
Engine(model, tok, EngineConfig(num_pages=512))
print(f"engine started in {time.time() - t:.1f} s")
PY
done
python scripts/bench.py --device cuda --dtype bfloat16 --configs smollm2,small --systems engine,engine-eager,ideal,hf-static \
  --requests 256 --max-num-seqs 256 --max-num-batched-tokens 8192 --hf-batch 16 --sweeps '' --no-progress \
  --json "$OUT/bench.json" --plot "$OUT/bench.png" 2>&1 | tee "$OUT/bench.md"
