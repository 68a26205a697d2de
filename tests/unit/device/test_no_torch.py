"""kunlun_device never pulls in torch (nor the runtime or operator), even when fully imported."""

from __future__ import annotations

import subprocess
import sys


def test_importing_every_module_loads_no_torch() -> None:
    code = (
        "import sys, pkgutil, importlib, kunlun_device\n"
        "for m in pkgutil.walk_packages(kunlun_device.__path__, 'kunlun_device.'):\n"
        "    importlib.import_module(m.name)\n"
        "banned = {'torch', 'kunlun_runtime', 'kunlun_operator'}\n"
        "print(sorted(n for n in sys.modules if n.split('.')[0] in banned))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
