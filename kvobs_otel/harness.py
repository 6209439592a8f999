"""Old path of the real-vLLM CPU harness, now ``kvobs_otel.tools.harness``.

Kept because recipes used it (``from kvobs_otel.harness import Harness``,
``"spec_module_path": "kvobs_otel.harness.cpu_backend"``): this name and every
``kvobs_otel.harness.X`` are the modules of ``kvobs_otel.tools.harness``.
"""

import sys

from kvobs_otel._old_paths import alias_package

sys.modules[__name__] = alias_package(__name__, "kvobs_otel.tools.harness")
