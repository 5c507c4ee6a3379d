"""`python -m llama_tp.kernels [build [--force] | status | selftest]`: build the native
kernels against the installed MLX, say which path quantized products take, or check
every SIMD kernel against the scalar one. Exits 1 when the native path is off."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m llama_tp.kernels", description=__doc__)
    p.add_argument("command", nargs="?", default="status", choices=["build", "status", "selftest"])
    p.add_argument("--force", action="store_true", help="build again (after a failed build)")
    args = p.parse_args(argv)
    from . import native
    from .build import BuildError, build

    if args.command == "build":
        try:
            path = build(force=args.force)
        except BuildError as e:
            print(f"llama_tp.kernels: {e}", file=sys.stderr)
            return 1
        print(path)
    st = native.status()
    if args.command == "selftest" and st.native:
        report, ok = native.ext().selftest(1e-5)
        print(report, end="")
        print("ok" if ok else "FAILED")
        return 0 if ok else 1
    print(f"quantized products on the CPU: {st.describe()}")
    return 0 if st.native else 1


if __name__ == "__main__":
    sys.exit(main())
