"""Old path of the ``kvobs-otel`` command, now ``kvobs_otel.tools.cli``.

Kept for ``python -m kvobs_otel.cli`` (``python -m kvobs_otel`` is the new
spelling) and ``from kvobs_otel.cli import main``.
"""

import sys

from kvobs_otel.tools.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
