"""Console entry point `kunlun-operator` (placeholder until its issue lands)."""

import sys


def main() -> int:
    print("kunlun-operator: not yet available", file=sys.stderr)
    return 2
