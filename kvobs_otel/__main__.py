"""``python -m kvobs_otel``: the ``kvobs-otel`` command (kvobs_otel/tools/cli.py).

Importing ``kvobs_otel`` itself never imports the tools; only running the
package as a program does.
"""

import sys

from kvobs_otel.tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
