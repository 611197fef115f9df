"""Regenerate the Python stubs of every ``proto/v1/*.proto`` (run: ``python proto/generate_stubs.py``).

The .proto files are compiled under the virtual path ``modeserve/proto/v1/`` so the generated
modules import each other as ``modeserve.proto.v1.*``. ``--check`` exits 1 if the stubs on disk
differ from freshly generated ones (a test runs it).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
VIRTUAL = "modeserve/proto"


def generate(out_dir: Path) -> list[Path]:
    """Compile every .proto into ``out_dir`` (flat: v1/*_pb2*.py); return the generated files."""
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).parent / "_proto"
    sources = sorted((PROTO_DIR / "v1").glob("*.proto"))
    with tempfile.TemporaryDirectory() as tmp:
        args = ["protoc", f"-I{VIRTUAL}={PROTO_DIR}", f"-I{include}", f"--python_out={tmp}",
                f"--pyi_out={tmp}", f"--grpc_python_out={tmp}"]
        args += [f"{VIRTUAL}/v1/{p.name}" for p in sources]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed")
        produced = sorted((Path(tmp) / VIRTUAL / "v1").glob("*.py*"))
        (out_dir / "v1").mkdir(parents=True, exist_ok=True)
        for f in produced:
            shutil.copy(f, out_dir / "v1" / f.name)
        return [out_dir / "v1" / f.name for f in produced]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when stale")
    args = parser.parse_args()
    if not args.check:
        for f in generate(PROTO_DIR):
            print(f"wrote {f.relative_to(PROTO_DIR.parent)}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        stale = [f.name for f in generate(Path(tmp)) if not (PROTO_DIR / "v1" / f.name).exists()
                 or (PROTO_DIR / "v1" / f.name).read_bytes() != f.read_bytes()]
    if stale:
        print(f"stale generated stubs: {stale}; run python proto/generate_stubs.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
