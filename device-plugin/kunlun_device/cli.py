"""Console entry point `kunlun-device-plugin` (placeholder until its issue lands)."""

import sys


def main() -> int:
    print("kunlun-device-plugin: not yet available", file=sys.stderr)
    return 2
