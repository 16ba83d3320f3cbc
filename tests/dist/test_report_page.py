"""`hpml-compile report RUN --html`: the page of a 2-rank run opens in headless Chromium, charts drawn, no errors;
and `run --metrics-port`: the endpoint scraped during that run parses as Prometheus text.

A CLI run of a 2-stage gpt-tiny build, its metrics endpoint scraped while it
runs; the report writes the page, which headless Chromium (Debian's
``chromium``) loads from a file (no network); a probe added to a copy of the
page collects console errors and counts the drawn plotly charts, and
Chromium also saves a screenshot.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from hpml_compile.cli import main

pytestmark = [pytest.mark.dist, pytest.mark.slow]
CLI = [sys.executable, "-m", "hpml_compile"]
CHARTS = 6  # gantt, steps, utilization, bandwidth, memory over the run, memory by part
PROBE = """<script>
window.__errors = [];
window.addEventListener('error', e => window.__errors.push(String(e.message)));
const __ce = console.error;
console.error = function () { window.__errors.push(Array.from(arguments).join(' ')); __ce.apply(console, arguments); };
window.addEventListener('load', () => setTimeout(() => {
  const d = document.createElement('pre'); d.id = 'probe';
  d.textContent = JSON.stringify({errors: window.__errors,
    charts: document.querySelectorAll('.js-plotly-plot .main-svg').length > 0
      ? new Set([...document.querySelectorAll('.js-plotly-plot')].filter(p => p.querySelector('.main-svg'))).size : 0,
    sections: [...document.querySelectorAll('section')].map(s => s.id),
    plan_svg: !!document.querySelector('#plan svg')});
  document.body.appendChild(d);
}, 1000));
</script>"""


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-rank CLI run; ``scrape.txt`` beside it: the metrics endpoint's last answer naming both ranks."""
    tmp = tmp_path_factory.mktemp("page")
    assert main(["compile", "gpt-tiny", "--cluster", "local-cpu-2", "--solver", "uniform", "-o", str(tmp / "b")]) == 0
    port = _free_port()
    # long enough (~2-4 s of steps) for the scraper, polling every 0.3 s, to see both ranks' rows while it runs
    proc = subprocess.Popen([*CLI, "run", str(tmp / "b"), "--steps", "100", "--run-dir", str(tmp / "run"),
                             "--no-tensorboard", "--no-report", "--metrics-port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    scraped = ""
    deadline = time.monotonic() + 400
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
                if 'rank="0"' in body and 'rank="1"' in body:
                    scraped = body
            except OSError:
                pass  # not serving yet, or just ended
            time.sleep(0.3)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    (tmp / "scrape.txt").write_text(scraped)
    (tmp / "stderr.txt").write_text(err)
    return tmp / "run"


def test_metrics_endpoint_scraped_during_the_run_parses(run: Path) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    text = (run.parent / "scrape.txt").read_text()
    assert text, "the endpoint never answered with both ranks while the job ran"
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("hpml_step_ms", "hpml_cpu_utilization", "hpml_host_steal_ratio", "hpml_peak_memory_bytes"):
        samples = families[name].samples
        assert {s.labels["rank"] for s in samples} == {"0", "1"}, (name, samples)
        assert {s.labels["device"] for s in samples} == {"cpu0", "cpu1"}
        assert all(s.value >= 0 for s in samples)
    assert all(s.value > 0 for s in families["hpml_step_ms"].samples)
    assert families["hpml_predicted_step_ms"].samples[0].value > 0


def test_page_is_self_contained_with_every_section(run: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    page = tmp_path / "report.html"
    assert main(["report", str(run), "--html", str(page), "--no-export"]) == 0
    text = page.read_text()
    for section in ("summary", "plan", "gantt", "steps", "utilization", "bandwidth", "memory"):
        assert f'<section id="{section}">' in text
    # no network: nothing is fetched from elsewhere (plotly's JavaScript is inlined)
    assert not re.search(r"<script[^>]+src=|<link[^>]+href=\"?http", text)
    assert "predicted (simulator)" in text and "bottleneck" in text.lower()
    memory = text[text.index('<section id="memory">'):]
    assert "At the peak, by part" in memory
    for part in ("parameters", "gradients", "optimizer state", "activations", "beyond the tensors"):
        assert f'"name":"{part}' in memory, part
    # each rank measured, each beside the memory model's prediction for its device
    assert all(f"{d} measured" in memory and f"{d} predicted" in memory for d in _devices(run))
    other = tmp_path / "notes.html"
    other.write_text("<p>mine</p>")
    capsys.readouterr()
    assert main(["report", str(run), "--html", str(other), "--no-export"]) == 2
    assert "notes.html exists and is not a page hpml-compile wrote" in capsys.readouterr().err
    assert other.read_text() == "<p>mine</p>"


def test_page_opens_in_headless_chromium(run: Path, tmp_path: Path) -> None:
    browser = _chromium()
    if browser is None:
        pytest.skip("no Chromium here (Debian: apt-get install chromium); the page's structure is checked above")
    page = tmp_path / "report.html"
    assert main(["report", str(run), "--html", str(page), "--no-export"]) == 0
    probed = tmp_path / "probed.html"
    probed.write_text(page.read_text().replace("<head>", "<head>" + PROBE, 1))
    flags = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--virtual-time-budget=20000", "--window-size=1280,4000"]
    dom = subprocess.run([*flags, "--dump-dom", probed.as_uri()], capture_output=True, text=True, timeout=180)
    found = re.search(r'<pre id="probe">(.*?)</pre>', dom.stdout, re.S)
    assert found, (dom.stdout[-2000:], dom.stderr[-2000:])
    probe = json.loads(found.group(1).replace("&quot;", '"').replace("&amp;", "&"))
    assert probe["errors"] == [], probe["errors"]
    assert probe["charts"] == CHARTS, probe
    assert probe["sections"] == ["summary", "plan", "gantt", "steps", "utilization", "bandwidth", "memory"]
    shot = tmp_path / "report.png"
    subprocess.run([*flags, f"--screenshot={shot}", page.as_uri()], capture_output=True, timeout=180)
    assert shot.is_file() and shot.stat().st_size > 20_000  # a page with charts, not a blank one


def _devices(run: Path) -> list[str]:
    plan = json.loads((run / "plan.json").read_text())
    return [d for st in plan["stages"] for d in st["devices"]]
