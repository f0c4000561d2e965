"""Issue 7: the API protos pass `buf lint` with the rules of protos/buf.yaml.

Offline: buf would fetch googleapis from the Buf Schema Registry, so protoc (grpc_tools,
with the same include paths the Python stubs are generated with) builds a Buf-readable
image of encoderd.v1 and its imports, and buf lints our files in it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from support.node import node_client_dir

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "protos"))
import generate  # noqa: E402  (protos/generate.py: the include paths and the .proto list)


def build_image(out: Path) -> Path:
    from grpc_tools import protoc

    protos = sorted(str(p.relative_to(generate.PROTO_ROOT)) for p in generate.PACKAGE_DIR.glob("*.proto"))
    args = [
        "protoc",
        *(f"-I{d}" for d in generate.include_dirs()),
        "--include_imports",
        "--include_source_info",
        f"--descriptor_set_out={out}",
        *protos,
    ]
    assert protoc.main(args) == 0, "protoc could not compile the protos"
    return out


def test_buf_lint_is_clean(tmp_path):
    buf = node_client_dir() / "node_modules" / ".bin" / "buf"  # pinned in clients/node's devDependencies
    image = build_image(tmp_path / "encoderd.binpb")
    result = subprocess.run(
        [
            str(buf),
            "lint",
            f"{image}#format=binpb",
            "--path",
            "encoderd",
            "--config",
            str(ROOT / "protos" / "buf.yaml"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, f"buf lint findings:\n{result.stdout}{result.stderr}"
