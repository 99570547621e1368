"""Regenerates the gRPC modules in this folder from proto/pagedserve/v1/*.proto."""
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[2]
PROTOS = ("pagedserve/v1/sampling.proto", "pagedserve/v1/engine.proto", "pagedserve/v1/executor.proto")


def generate(out_dir: Path) -> None:
    include = str(Path(protoc.__file__).parent / "_proto")
    for proto in PROTOS:
        args = ["protoc", f"-I{ROOT / 'proto'}", f"-I{include}", f"--python_out={out_dir}",
                f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", str(ROOT / "proto" / proto)]
        if protoc.main(args) != 0:
            sys.exit(f"protoc failed on {proto}")


if __name__ == "__main__":
    generate(ROOT)
