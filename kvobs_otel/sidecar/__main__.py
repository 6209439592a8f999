"""``python -m kvobs_otel.sidecar RFD SHMFD``: started by ``link.py``."""

import sys

from kvobs_otel.sidecar.main import main

sys.exit(main(sys.argv[1:]))
