"""``python -m kunlun_runtime``: the same as the ``kunlun-runtime`` command."""

import sys

from kunlun_runtime.commands.cli import main

sys.exit(main())
