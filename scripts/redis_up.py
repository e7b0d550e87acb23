"""Print shell exports for a reachable Redis, starting one if none answers (used by _setup.sh)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common.local_redis import ensure  # noqa: E402

url, server = ensure()
print(f"export TOKENQ_REDIS_URL='{url}'")
if server is not None:  # left running: the calling script stops it on exit
    print(f"export TOKENQ_STARTED_REDIS_PID={server.proc.pid}")
    print(f"echo 'started redis-server on {url} (pid {server.proc.pid})' >&2")
