"""The HTML report (``kvobs-otel report``): built from a real demo run's spans,
checked as HTML, and looked at in headless Chromium."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import zlib
from html.parser import HTMLParser
from pathlib import Path

import pytest

from kvobs_otel.tools.analysis.episodes import rebuild
from kvobs_otel.tools.otlp_file import FileSpan, read_spans
from kvobs_otel.tools.report import render_report, write_report

pytestmark = pytest.mark.vllm

CHROMIUM = "/usr/bin/chromium"
WINDOW = (1400, 2000)
HOSTILE = "<script>x</script>"

# HTML elements with no end tag; SVG elements are closed explicitly or with "/>".
VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source",
        "track", "wbr"}


# -- fixtures ------------------------------------------------------------------

@pytest.fixture(scope="module")
def demo_output(demo_run) -> Path:
    """The output of a real ``kvobs-otel demo --requests 8`` run (conftest)."""
    proc, out = demo_run
    assert proc.returncode == 0, f"demo failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    assert out.exists() and out.stat().st_size > 0
    return out


@pytest.fixture(scope="module")
def demo_spans(demo_output: Path) -> list[FileSpan]:
    return read_spans(str(demo_output))


@pytest.fixture(scope="module")
def demo_html(demo_spans: list[FileSpan]) -> str:
    return render_report(demo_spans)


# -- HTML inspection -------------------------------------------------------------

class Page(HTMLParser):
    """Collects what the assertions need and checks that tags balance."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.errors: list[str] = []
        self.tags: set[str] = set()
        self.attrs: list[tuple[str, str, str]] = []  # (tag, name, value)
        self.svgs: list[dict[str, str]] = []
        self.ids: set[str] = set()
        self.lane_labels: dict[str, list[str]] = {}  # timeline id -> labels
        self._timeline: str | None = None
        self._capture: list[str] | None = None  # text of the current class="..." element
        self._capture_depth = 0
        self.captured: dict[str, list[str]] = {}
        self._capture_class = ""

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self._start(tag, attrs)
        if tag not in VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self._start(tag, attrs)

    def _start(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        self.tags.add(tag)
        self.attrs.extend((tag, k, v) for k, v in a.items())
        if "id" in a:
            self.ids.add(a["id"])
        if tag == "svg":
            self.svgs.append(a)
            if "timeline" in a.get("class", "").split():
                self._timeline = a.get("id", "")
                self.lane_labels[self._timeline] = []
        classes = a.get("class", "").split()
        if self._capture is None and {"lane-label", "problems", "pct-label"} & set(classes):
            self._capture, self._capture_depth = [], len(self.stack)
            self._capture_class = next(c for c in classes
                                       if c in ("lane-label", "problems", "pct-label"))

    def handle_endtag(self, tag: str) -> None:
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"unexpected </{tag}> (open: {self.stack[-3:]})")
            return
        self.stack.pop()
        if self._capture is not None and len(self.stack) == self._capture_depth:
            text = "".join(self._capture).strip()
            self.captured.setdefault(self._capture_class, []).append(text)
            if self._capture_class == "lane-label" and self._timeline is not None:
                self.lane_labels[self._timeline].append(text)
            self._capture = None
        if tag == "svg":
            self._timeline = None

    def handle_data(self, data: str) -> None:
        if self._capture is not None and self.stack and self.stack[-1] != "title":
            self._capture.append(data)


def parse(html: str) -> Page:
    p = Page()
    p.feed(html)
    p.close()
    assert not p.errors, p.errors[:5]
    assert not p.stack, f"unclosed tags: {p.stack}"
    return p


def timelines(p: Page) -> list[dict[str, str]]:
    return [s for s in p.svgs if "timeline" in s.get("class", "").split()]


def lanes(p: Page, timeline_id: str) -> list[str]:
    """Lane labels of one timeline (a detail panel repeats them)."""
    return list(dict.fromkeys(p.lane_labels[timeline_id]))


def svg_text(html: str, timeline_id: str) -> str:
    start = html.index(f'id="{timeline_id}"')
    return html[start:html.index("</svg>", start)]


def assert_self_contained(p: Page, html: str) -> None:
    for tag, name, value in p.attrs:
        if name in ("src", "href", "xlink:href", "action", "srcset", "poster", "data"):
            v = value.strip().lower()
            assert not v.startswith(("http:", "https:", "//", "data:", "javascript:")), \
                f"<{tag} {name}={value!r}>"
            assert name == "href" and v.startswith("#"), f"<{tag} {name}={value!r}>"
    assert not {"script", "link", "img", "iframe", "object", "embed"} & p.tags, p.tags
    assert "url(" not in html and "@import" not in html


# -- synthetic spans (for what the demo does not produce) -----------------------

_T0 = 1_750_000_000_000_000_000


def span(name: str, trace: str, sid: str, start_ms: float, end_ms: float, *,
         rank: int | None = None, error: bool = False, **attrs: object) -> FileSpan:
    res = {"service.name": "kvobs-otel", "kvobs.role": "worker" if rank is not None
           else "scheduler"}
    if rank is not None:
        res["kvobs.rank"] = rank
        attrs["kvobs__rank"] = rank
    return FileSpan(name=name, trace_id=trace, span_id=sid, parent_span_id="",
                    start_ns=_T0 + int(start_ms * 1e6), end_ns=_T0 + int(end_ms * 1e6),
                    attributes={k.replace("__", "."): v for k, v in attrs.items()},
                    resource=res, error=error)


def synthetic() -> list[FileSpan]:
    """Three episodes: an incomplete receipt (ERROR) for a hostile request id,
    one that finished before resuming (no restore), and a recovered one."""
    bad = [
        span("kv.recovery", "t1", "r1", 0, 5000, error=True, kvobs__request__id=HOSTILE,
             kvobs__recovery__epoch=1, kvobs__outcome="receipt_incomplete",
             kvobs__receipt__expected_ranks=2, kvobs__restore__job_ids=[3],
             kvobs__preserve__job_ids=[2]),
        span("kv.job", "t1", "j2", -3, 1, kvobs__job__id=2, kvobs__job__role="preserve",
             kvobs__outcome="complete", kvobs__receipt__ranks=[0, 1]),
        span("kv.transfer", "t1", "x1", 0.2, 0.6, rank=0, kvobs__job__id=2,
             kvobs__direction="d2h", kvobs__bytes=65536, kvobs__outcome="ok"),
        span("kv.transfer", "t1", "x2", 0.3, 0.9, rank=1, kvobs__job__id=2,
             kvobs__direction="d2h", kvobs__bytes=65536, kvobs__outcome="ok"),
        span("kv.job", "t1", "j3", 40, 5000, error=True, kvobs__job__id=3,
             kvobs__job__role="restore", kvobs__outcome="receipt_incomplete",
             kvobs__receipt__ranks=[0], kvobs__receipt__missing_ranks=[1]),
        span("kv.transfer", "t1", "x3", 41, 41.5, rank=0, kvobs__job__id=3,
             kvobs__direction="h2d", kvobs__bytes=65536, kvobs__outcome="ok",
             kvobs__request__id=HOSTILE),
    ]
    finished = [
        span("kv.recovery", "t2", "r2", 100, 130, kvobs__request__id="req-&-'quoted'\"",
             kvobs__recovery__epoch=1, kvobs__outcome="finished_before_resume",
             kvobs__receipt__expected_ranks=2, kvobs__restore__job_ids=[],
             kvobs__preserve__job_ids=[5]),
        span("kv.job", "t2", "j5", 99, 102, kvobs__job__id=5, kvobs__job__role="preserve",
             kvobs__outcome="complete", kvobs__receipt__ranks=[0, 1]),
        span("kv.transfer", "t2", "x5", 100.5, 101, rank=0, kvobs__job__id=5,
             kvobs__direction="d2h", kvobs__bytes=32768, kvobs__outcome="ok"),
        span("kv.transfer", "t2", "x6", 100.5, 101.2, rank=1, kvobs__job__id=5,
             kvobs__direction="d2h", kvobs__bytes=32768, kvobs__outcome="ok"),
    ]
    good = [
        span("kv.recovery", "t3", "r3", 200, 260, kvobs__request__id="ok-1",
             kvobs__recovery__epoch=2, kvobs__outcome="recovered",
             kvobs__receipt__expected_ranks=2, kvobs__restore__job_ids=[7]),
        span("kv.job", "t3", "j7", 250, 252, kvobs__job__id=7, kvobs__job__role="restore",
             kvobs__outcome="complete", kvobs__receipt__ranks=[0, 1]),
        span("kv.transfer", "t3", "x7", 250.2, 251, rank=0, kvobs__job__id=7,
             kvobs__direction="h2d", kvobs__bytes=16384, kvobs__outcome="ok"),
        span("kv.transfer", "t3", "x8", 250.3, 251.5, rank=1, kvobs__job__id=7,
             kvobs__direction="h2d", kvobs__bytes=16384, kvobs__outcome="ok"),
        span("kv.admission", "t3", "a7", 252.5, 253),
        span("kv.first_compute", "t3", "f0", 254, 257, rank=0),
        span("kv.first_compute", "t3", "f1", 254, 259, rank=1),
    ]
    return bad + finished + good


# -- tests on the real demo output -------------------------------------------------

def test_demo_report_has_a_timeline_per_episode_with_every_lane(
        demo_spans: list[FileSpan], demo_html: str) -> None:
    episodes = rebuild(demo_spans)
    assert episodes, "the demo produced no recovery episode"
    p = parse(demo_html)
    tl = timelines(p)
    assert len(tl) == len(episodes)
    for svg in tl:
        assert lanes(p, svg["id"]) == ["scheduler", "rank 0", "rank 1"]
    for i in range(1, len(episodes) + 1):
        assert f"episode-{i}" in p.ids
    # Each episode's request id is in its heading, in start order.
    heads = [demo_html.index(f'id="episode-{i}"') for i in range(1, len(episodes) + 1)]
    assert heads == sorted(heads)


def test_demo_report_has_legend_plots_and_no_external_resource(
        demo_spans: list[FileSpan], demo_html: str) -> None:
    p = parse(demo_html)
    assert "legend" in p.ids
    for kind in ("k-episode", "k-restore", "k-h2d", "k-admission", "k-first_compute"):
        assert f'class="span {kind}' in demo_html, kind
    assert 'class="receipt"' in demo_html  # receipt completion markers
    classes = [s.get("class", "") for s in p.svgs]
    assert any("latency-histogram" in c for c in classes)
    assert any("throughput-scatter" in c for c in classes)
    assert any("throughput-spread" in c for c in classes)
    assert "latency-plot" in p.ids and "throughput-plot" in p.ids
    labels = p.captured.get("pct-label", [])
    assert any(t.startswith("p50 ") for t in labels) and any(t.startswith("p99 ") for t in labels)
    # Both directions and both ranks made it into the throughput plots.
    for key in ("d2h", "h2d"):
        assert f"<td>{key}</td>" in demo_html
    assert "No recovery episodes" not in demo_html
    assert_self_contained(p, demo_html)


def test_write_report_writes_the_page(demo_spans: list[FileSpan], tmp_path: Path) -> None:
    out = tmp_path / "report.html"
    write_report(demo_spans, str(out))
    text = out.read_text(encoding="utf-8")
    assert text.startswith("<!DOCTYPE html>")
    assert len(timelines(parse(text))) == len(rebuild(demo_spans))


# -- synthetic cases -------------------------------------------------------------

def test_request_ids_and_title_are_escaped() -> None:
    html = render_report(synthetic(), title="<marquee>t</marquee> & co")
    p = parse(html)
    assert HOSTILE not in html
    assert "&lt;script&gt;x&lt;/script&gt;" in html
    assert "script" not in p.tags and "marquee" not in p.tags
    assert "&lt;marquee&gt;t&lt;/marquee&gt; &amp; co" in html
    assert "req-&amp;-&#x27;quoted&#x27;&quot;" in html
    assert_self_contained(p, html)


def test_problems_errors_and_an_episode_without_restore() -> None:
    spans = synthetic()
    episodes = rebuild(spans)
    html = render_report(spans)
    p = parse(html)
    assert len(timelines(p)) == len(episodes) == 3
    problems = p.captured.get("problems", [])
    bad = next(e for e in episodes if e.request_id == HOSTILE)
    # Only the receipt_incomplete one: finishing before resume is no fault.
    assert len(problems) == 1
    assert any("receipt roster [0], missing ranks [1]" in t for t in problems)
    assert all(pr in " ".join(problems) for pr in bad.problems)
    assert 'class="span k-episode error"' in html and 'class="span k-restore error"' in html
    # The incomplete restore job gets no receipt-complete marker; the good one does.
    assert 'class="receipt"' not in svg_text(html, "timeline-1")
    assert 'class="receipt"' in svg_text(html, "timeline-3")
    # The episode that never restored still has its lanes and its preserve transfers.
    assert lanes(p, "timeline-2") == ["scheduler", "rank 0", "rank 1"]
    assert svg_text(html, "timeline-2").count('class="span k-d2h') >= 2
    assert 'k-restore' not in svg_text(html, "timeline-2")


def test_episodes_over_the_cap_are_counted_and_incomplete_ones_kept() -> None:
    html = render_report(synthetic(), max_episodes=1)
    p = parse(html)
    assert len(timelines(p)) == 1
    assert "left-out" in p.ids
    assert "Showing 1 of 3 episodes (2 left out: 2 complete)" in html
    assert "&lt;script&gt;" in html  # the incomplete (hostile) one is the one kept


def test_default_cap_is_200_timelines() -> None:
    spans = []
    for i in range(230):
        t, base = f"c{i}", i * 10.0
        spans += [
            span("kv.recovery", t, "r", base, base + 5, kvobs__request__id=f"q{i}",
                 kvobs__recovery__epoch=1, kvobs__outcome="recovered",
                 kvobs__receipt__expected_ranks=1, kvobs__restore__job_ids=[i]),
            span("kv.job", t, "j", base + 1, base + 2, kvobs__job__id=i,
                 kvobs__job__role="restore", kvobs__outcome="complete",
                 kvobs__receipt__ranks=[0]),
            span("kv.transfer", t, "x", base + 1.1, base + 1.5, rank=0, kvobs__job__id=i,
                 kvobs__direction="h2d", kvobs__bytes=4096 * (1 + i % 7), kvobs__outcome="ok"),
            span("kv.admission", t, "a", base + 2.5, base + 3),
            span("kv.first_compute", t, "f", base + 3.5, base + 4.5, rank=0),
        ]
    assert all(e.complete for e in rebuild(spans))
    html = render_report(spans)
    p = parse(html)
    assert len(timelines(p)) == 200
    assert "Showing 200 of 230 episodes (30 left out: 30 complete)" in html
    assert "q199" in html and "q200</code>" not in html  # the earliest are kept
    assert "230 recovered episodes" in html  # the plots count every episode


def test_empty_source_gives_a_clear_page() -> None:
    html = render_report([])
    p = parse(html)
    assert "no-episodes" in p.ids and "No recovery episodes" in html
    assert not timelines(p)
    assert "no recovered episodes" in html and "no transfers with bytes" in html
    assert_self_contained(p, html)


def test_rank_from_resource_and_unknown_lanes() -> None:
    spans = synthetic()
    for s in spans:  # ranks only on the resource, as a worker without the attribute
        s.attributes.pop("kvobs.rank", None)
    spans.append(span("kv.first_compute", "t3", "f9", 255, 256))  # no rank at all
    spans[-1].resource.pop("kvobs.role")
    html = render_report(spans)
    p = parse(html)
    assert lanes(p, "timeline-3") == ["scheduler", "rank 0", "rank 1", "rank ?"]


# -- looking at it ---------------------------------------------------------------

def _chromium() -> str:
    if shutil.which(CHROMIUM) or os.path.exists(CHROMIUM):
        return CHROMIUM
    if os.geteuid() == 0:  # as .ci/setup-servers.sh does: install Debian's package
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True,
                       timeout=600)
        r = subprocess.run(["apt-get", "install", "-y", "-qq", "chromium"], env=env,
                           capture_output=True, text=True, timeout=1200)
        if r.returncode == 0 and os.path.exists(CHROMIUM):
            return CHROMIUM
        pytest.fail(f"headless Chromium is needed and 'apt-get install -y chromium' failed:\n"
                    f"{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    pytest.fail("headless Chromium is needed for the report screenshot test: run "
                "'sudo apt-get install -y chromium' (Debian's package)")


def _screenshot(chromium: str, html: Path, png: Path, profile: Path) -> None:
    cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
           "--no-first-run", "--disable-background-networking", "--disable-component-update",
           "--disable-sync", f"--user-data-dir={profile}",
           f"--window-size={WINDOW[0]},{WINDOW[1]}", f"--screenshot={png}", f"file://{html}"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0 and png.exists(), f"chromium failed ({r.returncode}): {r.stderr}"


def _png_info(png: Path) -> tuple[int, int, bytes]:
    """(width, height, decompressed image data) from the PNG's own chunks."""
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, size = 8, b"", None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        crc = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])[0]
        assert zlib.crc32(kind + body) == crc, f"bad CRC in {kind!r}"
        if kind == b"IHDR":
            size = struct.unpack(">II", body[:8])
        elif kind == b"IDAT":
            idat += body
        elif kind == b"IEND":
            break
        pos += 12 + length
    assert size is not None, "no IHDR"
    return size[0], size[1], zlib.decompress(idat)


def test_screenshot_of_the_demo_report(demo_html: str, tmp_path: Path) -> None:
    chromium = _chromium()
    report, blank = tmp_path / "report.html", tmp_path / "blank.html"
    report.write_text(demo_html, encoding="utf-8")
    blank.write_text("<!DOCTYPE html><html><head><meta charset='utf-8'></head><body></body>"
                     "</html>", encoding="utf-8")
    shots = {}
    for name, page in (("report", report), ("blank", blank)):
        png = tmp_path / f"{name}.png"
        _screenshot(chromium, page, png, tmp_path / f"profile-{name}")
        w, h, raw = _png_info(png)
        assert (w, h) == WINDOW
        shots[name] = (png.stat().st_size, raw)
    keep = os.environ.get("KVOBS_REPORT_SCREENSHOT")
    if keep:  # for a person to look at
        shutil.copy(tmp_path / "report.png", keep)
    # A blank page compresses to almost nothing; the report carries text, bars and
    # plots, so its PNG is many times larger and its image data far less uniform.
    (rep_size, rep_raw), (blank_size, blank_raw) = shots["report"], shots["blank"]
    assert rep_size > 8 * blank_size, (rep_size, blank_size)
    rep_distinct = len(set(rep_raw[::7]))
    assert rep_distinct > 4 * max(len(set(blank_raw[::7])), 1) and rep_distinct > 64


def test_a_tiered_episode_has_a_lane_per_secondary_tier_and_its_wait() -> None:
    # vLLM's TieringOffloadingSpec: the episode's promotion from fs, the wait
    # it caused on the scheduler, then the GPU <- CPU restore.
    tiered = [
        span("kv.recovery", "t4", "r4", 0, 80, kvobs__request__id="tiered",
             kvobs__recovery__epoch=1, kvobs__outcome="recovered",
             kvobs__receipt__expected_ranks=2, kvobs__restore__job_ids=[9],
             kvobs__tier__job_ids=[1]),
        span("kv.wait", "t4", "w4", 5, 60, kvobs__wait__reasons=["promotion"],
             kvobs__wait__passes=4, kvobs__outcome="answered"),
        span("kv.tier.job", "t4", "p4", 6, 58, kvobs__tier__job__id=1, kvobs__tier__index=0,
             kvobs__tier__type="fs", kvobs__tier__job__kind="promotion", kvobs__tier__chunks=3,
             kvobs__bytes=24576, kvobs__outcome="ok"),
        span("kv.job", "t4", "j9", 61, 63, kvobs__job__id=9, kvobs__job__role="restore",
             kvobs__outcome="complete", kvobs__receipt__ranks=[0, 1]),
        span("kv.transfer", "t4", "x9", 61, 62, rank=0, kvobs__job__id=9,
             kvobs__direction="h2d", kvobs__bytes=16384, kvobs__outcome="ok"),
        span("kv.transfer", "t4", "xa", 61, 62.5, rank=1, kvobs__job__id=9,
             kvobs__direction="h2d", kvobs__bytes=16384, kvobs__outcome="ok"),
        span("kv.admission", "t4", "a9", 63, 64),
        span("kv.first_compute", "t4", "fa", 65, 70, rank=0),
        span("kv.first_compute", "t4", "fb", 65, 72, rank=1),
    ]
    html = render_report(tiered)
    p = parse(html)
    (svg,) = timelines(p)
    assert lanes(p, svg["id"]) == ["scheduler", "tier 0 (fs)", "rank 0", "rank 1"]
    assert "promotion: secondary tier" in html and "kv.wait" in html
    assert "waited for ['promotion']" in html or "waited for [&#x27;promotion&#x27;]" in html
