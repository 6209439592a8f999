"""B6 child: the process's memory layout, chosen before vLLM, torch or
kvobs-otel is imported (benchmarks/b6_counted.py imports this first).

What a counted step costs depends on where objects sit, not only on what
runs: CPython's type-attribute cache is indexed by the attribute name's
address, so which lookups of a step evict each other, and pay a walk of the
class's MRO next time, follows from where the interned names were allocated.
Between layouts the serving thread's count of identical code moves by
several thousand instructions per step; within one layout it is exact. So
B6 fixes the layout: the command line has the same length in every process
(``--job`` names a fixed-length file holding the rest), and ``--layout K``
puts K objects of every small-object size class ahead of everything the
imports allocate, shifting each class's addresses by K slots. Each variant is
counted under the same layouts, and compared layout by layout.
"""

from __future__ import annotations

import sys

# The small-object allocator's size classes hold objects of up to 512 bytes
# in steps of 16; a bytes object of n bytes takes 33 + n (n >= 1: bytes(0)
# is a shared constant). Names are str objects of 49 bytes and more.
_SIZES = range(1, 480, 16)


def _layout(argv: list[str]) -> int:
    try:
        return int(argv[argv.index("--layout") + 1])
    except (ValueError, IndexError):
        return 0


LAYOUT = _layout(sys.argv)
_PAD = [bytes(n) for _ in range(LAYOUT) for n in _SIZES]
