"""``kvobs-otel report``: recorded recovery episodes as one self-contained HTML page.

- ``page``: the page itself (summary, legend, one section per episode);
- ``plots``: recovery-latency histogram and transfer-throughput plots;
- ``timeline``: one episode as a lane-per-participant timeline;
- ``svg``: scales, axes and number formatting shared by the drawings.
"""

from kvobs_otel.tools.report.page import render_report, write_report

__all__ = ["render_report", "write_report"]
