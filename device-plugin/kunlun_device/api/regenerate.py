"""Regenerates the committed gRPC code in this folder from its `.proto` files.

Usage: python -m kunlun_device.api.regenerate [OUTPUT_DIR]   (default: this folder)
Needs `grpcio-tools` (a test/dev dependency); a test checks that the committed code is current.
"""

from __future__ import annotations

import sys
from pathlib import Path

API_DIR = Path(__file__).resolve().parent
PROTOS = (
    "deviceplugin_v1beta1.proto",
    "podresources_v1.proto",
    "pluginregistration_v1.proto",
    "dra_v1.proto",
    "dra_v1beta1.proto",
    "drahealth_v1alpha1.proto",
)


def regenerate(output_dir: Path) -> None:
    """Write `<name>_pb2.py`, its type stub `<name>_pb2.pyi` and `<name>_pb2_grpc.py` for each proto
    into `output_dir/kunlun_device/api`.

    Raises:
        RuntimeError: protoc reported an error.
    """
    from grpc_tools import protoc  # test/dev dependency only

    include = API_DIR.parents[1]  # device-plugin/, so imports read `from kunlun_device.api import ...`
    (output_dir / "kunlun_device" / "api").mkdir(parents=True, exist_ok=True)
    for proto in PROTOS:
        args = [
            "protoc",
            f"-I{include}",
            f"--python_out={output_dir}",
            f"--pyi_out={output_dir}",
            f"--grpc_python_out={output_dir}",
            f"kunlun_device/api/{proto}",
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {proto}")


def main() -> int:
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else API_DIR.parents[1]
    regenerate(target)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
