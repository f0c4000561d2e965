"""Regenerate the Python modules of the encoderd.v1 API from the .proto files.

    python protos/generate.py            # write encoderd/v1/*_pb2*.py beside the protos
    python protos/generate.py --check    # exit 1 when the checked-in modules are stale

The generated modules are checked in so that `pip install -e .` needs no build
step; tests/unit/test_protos_current.py runs --check so they never drift.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PACKAGE_DIR = PROTO_ROOT / "encoderd" / "v1"


def include_dirs() -> list[str]:
    """grpc_tools bundles google/protobuf/*; google/api/* comes from googleapis-common-protos."""
    import google.api
    import grpc_tools

    googleapis_root = Path(google.api.__path__[0]).parent.parent
    return [str(PROTO_ROOT), str(googleapis_root), str(Path(grpc_tools.__file__).parent / "_proto")]


def generate(out_dir: Path) -> None:
    from grpc_tools import protoc

    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PACKAGE_DIR.glob("*.proto"))
    args = ["protoc", *(f"-I{d}" for d in include_dirs()),
            f"--python_out={out_dir}", f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", *protos]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


def generated_names(directory: Path) -> set[str]:
    return {p.name for p in directory.glob("*_pb2*.py*")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only compare, write nothing")
    check = parser.parse_args().check
    if not check:
        generate(PROTO_ROOT)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        fresh_dir = Path(tmp) / "encoderd" / "v1"
        names = generated_names(fresh_dir)
        stale = [n for n in names if not (PACKAGE_DIR / n).exists() or not filecmp.cmp(fresh_dir / n, PACKAGE_DIR / n, shallow=False)]
        stale += sorted(generated_names(PACKAGE_DIR) - names)
    if stale:
        print("stale generated modules (run python protos/generate.py):", ", ".join(sorted(stale)), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
