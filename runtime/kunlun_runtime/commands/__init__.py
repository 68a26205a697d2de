"""The subcommands of ``kunlun-runtime`` that live nowhere else (``cli`` lists them all)."""
