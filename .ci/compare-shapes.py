#!/usr/bin/env python3
"""Compare the recovery-trace shapes tests/test_trace_shapes.py wrote for each
vLLM release: every case must have the same shape on every release that ran
it. Usage: compare-shapes.py DIR. Prints one line (and the differences);
exit 0 same, 1 different, 2 nothing to compare."""

from __future__ import annotations

import difflib
import json
import sys
from collections import defaultdict
from pathlib import Path


def main(directory: str) -> int:
    runs: dict[str, dict[str, str]] = defaultdict(dict)
    for path in sorted(Path(directory).glob("*.json")):
        case, runner, version = path.name[: -len(".json")].split(".", 2)
        runs[f"{case} ({runner})"][version] = json.dumps(json.loads(path.read_text()),
                                                          indent=1, sort_keys=True)
    compared = {k: v for k, v in runs.items() if len(v) > 1}
    if not compared:
        print("trace shapes: nothing to compare (fewer than two releases ran the cases)")
        return 2
    differ = []
    for case, by_version in sorted(compared.items()):
        (ref_version, ref), *others = sorted(by_version.items(), reverse=True)
        for version, shape in others:
            if shape != ref:
                differ.append(case)
                diff = difflib.unified_diff(ref.splitlines(), shape.splitlines(),
                                            f"vLLM {ref_version}", f"vLLM {version}",
                                            lineterm="", n=2)
                print(f"-- {case}: vLLM {version} differs from {ref_version}")
                print("\n".join(list(diff)[:80]))
    versions = sorted({v for by in compared.values() for v in by}, reverse=True)
    verdict = "same" if not differ else f"DIFFERENT in {len(set(differ))}"
    print(f"trace shapes: {verdict} across vLLM {', '.join(versions)} "
          f"({len(compared)} case(s) run on two or more releases)")
    return 1 if differ else 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1]))
