import importlib
import sys

from bench import BENCHMARKS


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in BENCHMARKS:
        print(f"usage: ops/bench NAME [ARGS]   where NAME is one of: {', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    importlib.import_module(BENCHMARKS[argv[0]]).main(argv[1:])
    return 0


raise SystemExit(main(sys.argv[1:]))
