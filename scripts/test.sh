#!/usr/bin/env bash
# The test command: set up (venv, install, Redis) and run the whole pytest suite.
# Extra arguments go to pytest, e.g. ./scripts/test.sh -k engine -x
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_setup.sh"
python -m pytest -q "$@"
