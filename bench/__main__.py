"""`python -m bench <suite> [options]`: run one benchmark suite (see bench/<suite>.py)."""
from __future__ import annotations

import importlib
import sys

SUITES = ("codegen", "tune", "space", "network", "transfer", "first_round", "storage", "pipeline", "ceiling", "search",
          "timing", "retrain")


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in SUITES:
        print(f"usage: python -m bench {{{','.join(SUITES)}}} [options]", file=sys.stderr)
        return 2
    module = importlib.import_module(f"bench.{argv[0]}")
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
