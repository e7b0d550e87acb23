#!/usr/bin/env bash
# The demo command: set up (venv, install, Redis), start a worker on the default model,
# send requests of mixed priority and stream the answers; stops what it started.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_setup.sh"
python scripts/demo.py "$@"
