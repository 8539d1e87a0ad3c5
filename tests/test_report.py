"""The run report: reading a run directory, the SVG pieces, escaping of model text, missing
parts as notes, atomic writing, and a headless Chromium load of the page."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import shutil
import struct
import subprocess
import sys
import zlib
from html.parser import HTMLParser
from pathlib import Path

import pytest

from keel import report
from keel.report import heat_colour, load_run, metric_series, nice_ticks, peak_of, write_report
from keel.rundir import read_jsonl

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
from make_run import HOSTILE, make_run  # noqa: E402


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------


def test_read_jsonl_tolerates_torn_lines_and_says_where(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "a"\n[1, 2]\n\n{"step": 3}\n{"step": 4, "reward/me')
    rows, problems = read_jsonl(path)
    assert [r["step"] for r in rows] == [1, 3]
    assert problems == [
        "metrics.jsonl:2: not JSON (JSONDecodeError), skipped",
        "metrics.jsonl:3: a JSON list, not an object, skipped",
        "metrics.jsonl:6: torn last line (JSONDecodeError), skipped",
    ]


def test_metric_series_later_line_wins_and_drops_non_numbers():
    rows = [
        {"step": 2, "a": 1, "phase": "rl"},
        {"step": 1, "a": 5, "b": float("nan")},
        {"step": 2, "a": 3, "b": "text", "c": True},
        {"a": 9},  # no step: ignored
        {"step": "7", "a": 9},  # step not an int: ignored
    ]
    assert metric_series(rows) == {"a": [(1, 5.0), (2, 3.0)], "c": [(2, 1.0)]}


def test_load_run_recomputes_eval_points_missing_from_metrics(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 5, "reward/mean": 0.5}\n')
    (tmp_path / "eval").mkdir()
    rows = [{"task_id": "a", "em": 1, "f1": 1.0, "tools": 2}, {"task_id": "b", "em": 0, "f1": 0.5, "tools": 3},
            {"task_id": "c", "em": 1, "f1": 0.8, "tools": 1}, {"task_id": "d", "em": 1, "f1": 0.3, "tools": 2}]
    (tmp_path / "eval" / "step_000005.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = load_run(tmp_path)
    # EM (1+0+1+1)/4 = 0.75; F1 (1+0.5+0.8+0.3)/4 = 0.65; tools (2+3+1+2)/4 = 2.
    assert run.series["eval/em"] == [(5, 0.75)]
    assert run.series["eval/f1"] == [(5, pytest.approx(0.65))]
    assert run.series["eval/tools_per_question"] == [(5, 2.0)]
    assert "eval/cvt" not in run.series  # not in the files: not invented


def test_missing_run_dir_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"run directory .*nope does not exist"):
        write_report(tmp_path / "nope")


# ---------------------------------------------------------------------------------------------
# SVG pieces
# ---------------------------------------------------------------------------------------------


def test_nice_ticks_by_hand():
    assert nice_ticks(0, 1) == [0, 0.2, 0.4, 0.6, 0.8, 1.0]
    # span 120 / 5 = 24 → smallest nice step ≥ 24 among 10·(1, 2, 2.5, 5) is 25.
    assert nice_ticks(0, 120) == [0, 25, 50, 75, 100]
    assert nice_ticks(3, 3) == [3]


def test_heat_colour_stops():
    assert heat_colour(0.0) == "#ffffff"
    assert heat_colour(0.35) == "#fed976"  # (254, 217, 118)
    assert heat_colour(1.0) == "#54003c"
    # Halfway between stops 0.35 and 0.7: ((254+240)/2, (217+59)/2, (118+32)/2) = (247, 138, 75).
    assert heat_colour(0.525) == "#f78a4b"
    assert heat_colour(7.0) == "#54003c"  # clipped


def test_thin_keeps_spikes():
    assert report.thin([(1, 0), (2, 9), (3, 1), (4, 2), (5, 0), (6, 3)], max_points=4) == [(1, 0), (2, 9), (5, 0), (6, 3)]
    points = [(s, 0.001) for s in range(50_000)]
    points[31_337] = (31_337, 5.0)  # one spike in 50k steps
    kept = report.thin(points)
    assert len(kept) <= report.MAX_POINTS and (31_337, 5.0) in kept
    assert kept == sorted(kept)  # still in step order


def test_peak_is_first_maximum():
    assert peak_of([(10, 0.2), (20, 0.4), (30, 0.4), (40, 0.1)]) == (20, 0.4)
    assert peak_of([]) is None


def test_line_chart_without_data_is_a_note():
    assert report.line_chart("EM", [report.Line("em", [], "#000")]) == '<p class="note">EM: no data yet.</p>'


def test_line_chart_escapes_titles_and_series_names():
    svg = report.line_chart("<b>t</b>", [report.Line('"><script>x</script>', [(0, 1.0), (1, 2.0)], "#000")], markers=[report.Marker(0.5, "<img>")])
    assert "<script>" not in svg and "<img>" not in svg and "<b>" not in svg
    assert "&lt;script&gt;" in svg and "&lt;img&gt;" in svg


# ---------------------------------------------------------------------------------------------
# The whole page
# ---------------------------------------------------------------------------------------------


class TagCollector(HTMLParser):
    """Every start tag with its attributes, and the text of <script> and <title>."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict]] = []
        self.scripts: list[str] = []
        self.title = ""
        self._in = None

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        self._in = tag

    def handle_endtag(self, tag):
        self._in = None

    def handle_data(self, data):
        if self._in == "script":
            self.scripts.append(data)
        elif self._in == "title":
            self.title += data


ALLOWED_TAGS = {
    "html", "head", "meta", "title", "style", "body", "script", "h1", "h2", "h3", "p", "div", "span", "b", "i", "q", "code", "pre",
    "table", "tr", "th", "td", "ul", "li", "details", "summary", "figure", "figcaption", "label", "input",
    "svg", "g", "line", "path", "rect", "circle", "text", "polygon",
}


@pytest.fixture(scope="module")
def hostile_report(tmp_path_factory) -> tuple[Path, str]:
    run_dir = make_run(tmp_path_factory.mktemp("hostile") / "run", hostile=True)
    path = write_report(run_dir)
    return path, path.read_text(encoding="utf-8")


def test_report_has_every_section(hostile_report):
    _, text = hostile_report
    for heading in ("Verdict", "Dev evaluation", "Reward", "Structural states", "KL by token class", "Control-token frequency vs reference", "Trajectories"):
        assert f"<h2>{heading}" in text, heading
    # Fixture: peak at step 80 with round(0.42·40) = 17 of 40 correct → EM 0.425.
    assert "peak EM 0.425 @ 80" in text
    # Both alerts (steps 84+4 = 88 and 84+8 = 92) are marked on the eval chart.
    eval_section = text.split("<h2>Dev evaluation</h2>")[1].split("<h2>")[0]
    assert eval_section.count('<g class="alert">') == 4  # 2 alerts × 2 charts
    assert "spec_gaming_cliff" in text
    assert "metrics.jsonl:127: torn last line" in text  # 120 step lines + 6 eval lines, then the torn one


def test_model_text_cannot_inject_html(hostile_report):
    _, text = hostile_report
    assert HOSTILE not in text
    assert report.escape(HOSTILE) in text  # shown, as text
    parser = TagCollector()
    parser.feed(text)
    tags = {t for t, _ in parser.tags}
    assert tags <= ALLOWED_TAGS, tags - ALLOWED_TAGS
    assert [t for t, _ in parser.tags].count("script") == 1
    assert parser.scripts == [report.SCRIPT]
    event_handlers = [(t, a) for t, attrs in parser.tags for a in attrs if a.lower().startswith("on")]
    assert event_handlers == []
    assert "PWNED" not in parser.title


def test_content_security_policy_allows_exactly_the_inline_script(hostile_report):
    _, text = hostile_report
    parser = TagCollector()
    parser.feed(text)
    csp = next(a["content"] for t, a in parser.tags if t == "meta" and a.get("http-equiv") == "Content-Security-Policy")
    digest = base64.b64encode(hashlib.sha256(parser.scripts[0].encode()).digest()).decode()
    assert f"script-src 'sha256-{digest}'" in csp
    assert "default-src 'none'" in csp
    assert not re.search(r"(src|href)=\"(https?:)?//", text)  # nothing to fetch


def test_viewer_colours_tokens_by_source_and_falls_back_to_turn_texts(hostile_report):
    _, text = hostile_report
    for source in range(3):  # the fixture has prompt, policy and tool tokens
        assert f'<span class="s{source}' in text
    assert '<span class="s1 ctl"' in text  # control tags outlined
    assert "token pieces not stored: showing the assistant turn texts" in text
    assert "get_tail_entities" in text  # tool calls readable


def test_report_shows_what_keel_diagnose_writes(tmp_path):
    from keel.diagnostics.classify import diagnose

    make_run(tmp_path, with_diagnosis=False)
    verdict = diagnose(tmp_path)
    text = write_report(tmp_path).read_text()
    section = text.split("<h2>Verdict</h2>")[1].split("<h2>")[0]
    assert f"Failure mode: <b>{verdict['mode']}</b>" in section
    # Its evidence signals become a table with one row per signal and ✓ / ✗ / – for satisfied.
    signals = verdict["evidence"]["signals"]
    assert signals and section.count("<tr>") >= len(signals)
    for signal in signals:
        assert report.escape(signal["signal"]) in section


def test_empty_run_dir_renders_notes(tmp_path):
    path = write_report(tmp_path)
    text = path.read_text()
    assert "No evaluation yet" in text
    assert "No samples yet" in text
    assert "No diagnosis.json" in text
    assert "No alerts raised." in text
    assert "No config.yaml" in text


def test_bad_pieces_of_a_run_render_as_notes(tmp_path):
    make_run(tmp_path, steps=40, eval_every=20, with_diagnosis=False)
    (tmp_path / "diagnosis.json").write_text("{not json")
    (tmp_path / "alerts.jsonl").write_text('{"kind": "no step"}\n')
    sample = json.loads((tmp_path / "samples" / "step_000040.jsonl").read_text().splitlines()[0])
    sample["pieces"] = sample["pieces"][:-3]  # does not match token_ids
    strange_sources = {"token_ids": [1, 2, 3], "sources": [[1], 9, "tool"], "pieces": ["a", "<b>", "c"]}
    odd = [sample, {"token_ids": "abc", "steps": "x", "reward": "high"}, [1, 2], {"steps": [None, {"call": 3}]}, strange_sources]
    (tmp_path / "samples" / "step_000040.jsonl").write_text("\n".join(json.dumps(o) for o in odd) + "\nnot json\n")
    text = write_report(tmp_path).read_text()
    assert "diagnosis.json: not JSON (JSONDecodeError), ignored" in text
    assert "alerts.jsonl: 1 alert(s) without an integer step, skipped" in text
    assert "token pieces do not match the token ids" in text
    assert "step_000040.jsonl:3: a JSON list, not an object, skipped" in text
    assert "unreadable step" in text
    assert '<span class="sx" title="#1 id 2 · unknown source">&lt;b&gt;</span>' in text  # unknown sources marked


def test_write_is_atomic(tmp_path, monkeypatch):
    make_run(tmp_path, steps=20, eval_every=10)
    first = write_report(tmp_path).read_text()

    def failing_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(report.os, "replace", failing_replace)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.9}\n')
    with pytest.raises(OSError, match="disk full"):
        write_report(tmp_path)
    assert (tmp_path / "report.html").read_text() == first  # the old page is intact
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []


def test_report_of_a_long_run_stays_small(tmp_path):
    make_run(tmp_path, steps=1000, eval_every=50)
    text = write_report(tmp_path).read_text()
    # 1000 steps, at most 120 columns: ceil(1000/120) = 9 steps per column, so 111 columns of 9
    # steps (999) and one of step 1000 = 112 columns; 8 tags + text = 9 rows → 1008 cells,
    # plus the 50 swatches of the colour bar.
    heat = text.split("mean k3 KL per token class × step")[1].split("</svg>")[0]
    assert heat.count("<rect") == 9 * 112 + 50
    assert "steps 1–9:" in heat and "step 1000:" in heat
    assert len(text) < 3_000_000


# ---------------------------------------------------------------------------------------------
# Headless Chromium: the page loads from disk, its script runs, nothing logs, plots render
# ---------------------------------------------------------------------------------------------

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (install with: apt-get install -y chromium)")


def chromium(url: str, tmp: Path, *extra: str) -> tuple[str, list[str]]:
    """Run headless Chromium on a URL; return (stdout, console lines from its log)."""
    args = [
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
        f"--user-data-dir={tmp / 'profile'}", "--enable-logging=stderr", "--v=0", "--hide-scrollbars", *extra, url,
    ]
    done = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    # Chromium logs each console message (any level), uncaught error and CSP violation as
    # `...:CONSOLE(...)] "text", source: ...`. The report's script logs nothing, so any is a failure.
    console = [line for line in done.stderr.splitlines() if ":CONSOLE" in line]
    return done.stdout, console


def png_pixels(path: Path) -> tuple[int, int, list[int]]:
    """Width, height and one grey value per pixel of an 8-bit RGB/RGBA PNG (stdlib only)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos : pos + 8])
        body = data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    width, height, depth, colour, _, _, interlace = header
    assert depth == 8 and colour in (2, 6) and interlace == 0, f"unsupported PNG layout {header}"
    channels = 3 if colour == 2 else 4
    raw = zlib.decompress(idat)
    stride = width * channels
    previous = bytearray(stride)
    grey: list[int] = []
    for row in range(height):
        kind = raw[row * (stride + 1)]
        line = bytearray(raw[row * (stride + 1) + 1 : (row + 1) * (stride + 1)])
        for i in range(stride):
            left = line[i - channels] if i >= channels else 0
            up = previous[i]
            upper_left = previous[i - channels] if i >= channels else 0
            if kind == 1:
                line[i] = (line[i] + left) & 0xFF
            elif kind == 2:
                line[i] = (line[i] + up) & 0xFF
            elif kind == 3:
                line[i] = (line[i] + (left + up) // 2) & 0xFF
            elif kind == 4:
                p = left + up - upper_left
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - upper_left)
                line[i] = (line[i] + (left if pa <= pb and pa <= pc else up if pb <= pc else upper_left)) & 0xFF
        grey += [(line[i] + line[i + 1] + line[i + 2]) // 3 for i in range(0, stride, channels)]
        previous = line
    return width, height, grey


def variance(values: list[int]) -> float:
    mean = sum(values) / len(values)
    return sum((v - mean) ** 2 for v in values) / len(values)


@needs_chromium
def test_console_detector_catches_errors(tmp_path):
    """Negative control: the console check below would see a broken page."""
    page = tmp_path / "broken.html"
    page.write_text('<!doctype html><body><script>console.error("x"); notDefined();</script></body>')
    _, console = chromium(page.as_uri(), tmp_path, "--dump-dom")
    assert len(console) == 2, console


@needs_chromium
def test_report_in_headless_chromium(tmp_path, hostile_report):
    path, _ = hostile_report
    dom, console = chromium(path.as_uri(), tmp_path, "--dump-dom")
    assert console == []
    assert 'data-ready="1"' in dom  # the inline script ran to its end (so the CSP hash matched)
    # 2 eval + 2 reward + 2 states + 2 KL + 1 heatmap + 8 tag frequencies + 4 optimisation = 21.
    assert dom.count('<svg class="chart"') == 21
    assert dom.count("<svg") == path.read_text().count("<svg")  # legend swatches too
    assert "<img" not in dom and "PWNED" not in dom.split("<body")[0]

    shot = tmp_path / "shot.png"
    _, console = chromium(path.as_uri(), tmp_path, f"--screenshot={shot}", "--window-size=1000,1400")
    assert console == []
    width, height, grey = png_pixels(shot)
    assert (width, height) == (1000, 1400)
    assert variance(grey) > 100  # charts and text; a blank page is ~0 (see the control below)
    try:  # equivalence of the stdlib decoder with Pillow's, where Pillow happens to be installed
        import numpy as np
        from PIL import Image

        rgb = np.asarray(Image.open(shot).convert("RGB")).astype(int)
        assert grey == (rgb.sum(axis=2) // 3).ravel().tolist()
    except ImportError:
        pass

    blank = tmp_path / "blank.html"
    blank.write_text("<!doctype html><body></body>")
    blank_shot = tmp_path / "blank.png"
    chromium(blank.as_uri(), tmp_path, f"--screenshot={blank_shot}", "--window-size=1000,1400")
    assert variance(png_pixels(blank_shot)[2]) < 1


def test_figures_are_standalone_svgs_with_their_legends(tmp_path):
    import xml.etree.ElementTree as ET

    from keel.report import write_figures

    run_dir = make_run(tmp_path / "run")
    paths = write_figures(run_dir, tmp_path / "figures")
    names = {p.name for p in paths}
    assert len(names) == len(paths)  # no chart overwrote another (<tool_call> and </tool_call>)
    assert {"eval-tools-per-question-dev.svg", "kl-share-of-kl-carried-by-control-tags.svg", "kl-mean-k3-kl-per-token-class-step.svg",
            "freq-tool-call.svg", "freq-end-tool-call.svg"} <= names
    for p in paths:
        root = ET.parse(p).getroot()  # well-formed XML on its own
        assert root.tag == "{http://www.w3.org/2000/svg}svg", p.name
        assert root.find("{http://www.w3.org/2000/svg}style") is not None, p.name
    # The legend is drawn inside the image: the series names of the eval chart, below the plot.
    svg = (tmp_path / "figures" / "eval-em-f1-cvt-format-validity-dev-greedy.svg").read_text()
    root = ET.fromstring(svg)
    texts = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert {"EM", "F1", "CvT", "format valid"} <= set(texts)
    assert int(root.get("height")) > 220  # the chart's 220 px plus the legend's row
    # A second call replaces the files in place; the CLI writes the page and the same figures.
    again = write_figures(run_dir, tmp_path / "figures")
    assert sorted(again) == sorted(paths)
    import keel.cli

    assert keel.cli.main(["report", str(run_dir), "--figures", str(tmp_path / "cli")]) == 0
    assert sorted(p.name for p in (tmp_path / "cli").iterdir()) == sorted(names)
    assert (run_dir / "report.html").is_file()


def test_figure_names_and_values_are_escaped(tmp_path):
    import xml.etree.ElementTree as ET

    from keel.report import Line, line_chart, standalone_svgs

    fig = line_chart('<b>"KL"</b> & more', [Line("</tool_call> & <x>", [(0, 1.0), (1, 2.0)], "#123456")])
    [(title, svg)] = standalone_svgs(fig)
    assert title == '<b>"KL"</b> & more'
    root = ET.fromstring(svg)
    assert "</tool_call> & <x>" in [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert standalone_svgs('<p class="note">no data yet.</p>') == []
