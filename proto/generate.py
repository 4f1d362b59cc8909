"""Regenerate the committed gRPC stubs in pdserve/v1 from proto/pdserve/v1/*.proto.

python proto/generate.py            # write the stubs
python proto/generate.py --check    # exit 1 if the committed stubs differ (used by a test)
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
OUT_DIR = ROOT / "pdserve" / "v1"
HAND_WRITTEN = {"convert.py"}  # beside the stubs, not generated: proto <-> pdserve dataclasses
INIT_DOC = (
    '"""Generated gRPC stubs (proto/generate.py); never edit by hand.\n\n'
    'convert.py, beside them, is hand-written: protobuf <-> pdserve dataclasses."""\n'
)


def generate(out_root: Path) -> Path:
    from grpc_tools import protoc

    protos = sorted(
        str(p.relative_to(PROTO_DIR)) for p in (PROTO_DIR / "pdserve" / "v1").glob("*.proto")
    )
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    out = out_root / "pdserve" / "v1"
    (out / "__init__.py").write_text(INIT_DOC)
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        names = sorted(p.name for p in fresh.iterdir() if p.is_file())
        if args.check:
            committed = sorted(
                p.name
                for p in OUT_DIR.glob("*")
                if p.is_file() and p.suffix in (".py", ".pyi") and p.name not in HAND_WRITTEN
            )
            same = names == committed and all(
                filecmp.cmp(fresh / n, OUT_DIR / n, shallow=False) for n in names
            )
            if not same:
                print(
                    "pdserve/v1 differs from proto/: run python proto/generate.py", file=sys.stderr
                )
                return 1
            return 0
        OUT_DIR.mkdir(parents=True, exist_ok=True)
        for n in names:
            shutil.copyfile(fresh / n, OUT_DIR / n)
    print(f"wrote {len(names)} files to {OUT_DIR.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
