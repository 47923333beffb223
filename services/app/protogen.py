"""Generates the Python code for the `.proto` contracts, or checks it for drift.

    python -m rollwire.services.app.protogen          # regenerate proto/v1/*_pb2*.py{,i}
    python -m rollwire.services.app.protogen --check  # exit 1 if the committed code differs

The `.proto` files live in `proto/v1/`. protoc sees them under the virtual path
`rollwire/proto/v1/`, so the generated modules import each other as
`rollwire.proto.v1.<name>_pb2`, which is where the package installs them.
Generation needs the pinned grpcio-tools from the `dev` extra.
"""

from __future__ import annotations

import argparse
import difflib
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parents[2] / "proto" / "v1"
VIRTUAL_ROOT = "rollwire/proto"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")
INIT_TEXT = (
    '"""Generated gRPC code for rollwire.v1; do not edit. See rollwire.services.app.protogen."""\n'
)


def generate(out_dir: Path, proto_dir: Path = PROTO_DIR) -> dict[str, str]:
    """Runs protoc on every `.proto` file in `proto_dir`; returns {file name: text} of the outputs."""
    import grpc_tools
    from grpc_tools import protoc  # imported here: only the dev extra has it

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    protos = sorted(proto_dir.glob("*.proto"))
    if not protos:
        raise SystemExit(f"no .proto files in {proto_dir}")
    args = [
        "protoc",
        f"-I{VIRTUAL_ROOT}={proto_dir.parent}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(f"{VIRTUAL_ROOT}/v1/{p.name}" for p in protos),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed; see the messages above")
    produced = out_dir / VIRTUAL_ROOT / "v1"
    files = {p.name: p.read_text() for p in sorted(produced.iterdir()) if p.is_file()}
    files["__init__.py"] = INIT_TEXT
    return files


def committed_files(proto_dir: Path = PROTO_DIR) -> dict[str, str]:
    """The generated files as they are on disk."""
    names = [p for p in proto_dir.iterdir() if p.name.endswith(GENERATED_SUFFIXES)]
    files = {p.name: p.read_text() for p in names}
    init = proto_dir / "__init__.py"
    if init.exists():
        files["__init__.py"] = init.read_text()
    return files


def drift(expected: dict[str, str], actual: dict[str, str]) -> list[str]:
    """Describes every difference between freshly generated and committed files."""
    problems = []
    for name in sorted(expected.keys() | actual.keys()):
        if name not in actual:
            problems.append(f"{name}: missing; run `python -m rollwire.services.app.protogen`")
        elif name not in expected:
            problems.append(f"{name}: generated file with no .proto behind it; delete it")
        elif expected[name] != actual[name]:
            diff = difflib.unified_diff(
                actual[name].splitlines(),
                expected[name].splitlines(),
                f"committed/{name}",
                f"regenerated/{name}",
                lineterm="",
                n=1,
            )
            problems.append(f"{name}: differs from its .proto\n" + "\n".join(list(diff)[:40]))
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail on drift instead of writing")
    parser.add_argument("--proto-dir", type=Path, default=PROTO_DIR, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    proto_dir = args.proto_dir.resolve()
    with tempfile.TemporaryDirectory() as tmp:
        expected = generate(Path(tmp), proto_dir)
    if args.check:
        problems = drift(expected, committed_files(proto_dir))
        for problem in problems:
            print(problem, file=sys.stderr)
        return 1 if problems else 0
    for stale in set(committed_files(proto_dir)) - set(expected):
        (proto_dir / stale).unlink()
    for name, text in expected.items():
        (proto_dir / name).write_text(text)
    print(f"wrote {len(expected)} files to {proto_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
