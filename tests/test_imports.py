"""common/ and producer/ are light Redis clients: importing them must not load torch."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize("modules", ["common", "producer", "common.protocol, common.settings, common.redis, common.local_redis"])
def test_import_is_torch_free(modules):
    code = (
        "import sys\n"
        f"import {modules}\n"
        "import pkgutil, importlib\n"
        "for pkg in ('common', 'producer'):\n"
        "    p = importlib.import_module(pkg)\n"
        "    for m in pkgutil.iter_modules(p.__path__):\n"
        "        importlib.import_module(f'{pkg}.{m.name}')\n"
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"importing {modules} loaded {out.stdout.strip()}"
