"""`python -m kvlab.bench {core,memory,kernel,engine,viz,events,routing,trace,offload,vs-vllm,all}` — speed and paper figures.

Every benchmark prints ratios measured in one run (this machine's speed drifts), never
absolute thresholds checked by tests.
"""

from __future__ import annotations

import importlib
import sys

SUITES = ("core", "memory", "kernel", "engine", "viz", "events", "routing", "trace", "offload", "vs-vllm")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    names = SUITES if args[0] == "all" else (args[0],)
    for name in names:
        if name not in SUITES:
            print(f"unknown suite {name!r}; choose one of {', '.join(SUITES)} or 'all'", file=sys.stderr)
            return 2
        try:
            mod = importlib.import_module(f"kvlab.bench.{name.replace('-', '_')}")
        except ModuleNotFoundError as e:
            if e.name != f"kvlab.bench.{name.replace('-', '_')}":
                raise
            print(f"[{name}] not available yet")
            continue
        mod.main(args[1:])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
