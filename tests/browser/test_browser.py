"""The player in a real browser: JupyterLab + headless Chromium, driven by Playwright.

Unit tests check what the views *draw* as data; only a browser shows that the widgets
actually render: that the plotly and ipywidgets front-end extensions load, that the six
figures appear without a traceback, and that pressing the player's Step button round-trips
through the kernel and redraws a plot.

The test starts its own JupyterLab on a free port with a random token, on a temporary
root directory holding a copy of ``player_demo.ipynb``, with user settings and
workspaces in temporary directories too (news fetching and update checks off, notebook
windowing off so every output is rendered), so it changes nothing on the machine. It uses
Debian's Chromium (``apt-get install chromium``); it never downloads a browser. The
screenshot goes to ``test-artifacts/browser_player.png``.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = Path("/usr/bin/chromium")
HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
ARTIFACTS = REPO / "test-artifacts"
NOTEBOOK = HERE / "player_demo.ipynb"
# The player's six default views, in display order, by the start of their titles.
EXPECTED_TITLES = ["Block pool", "Free queue", "Block tables", "Hash chains", "Timeline", "Attention read"]
EXPECTED_PLOTS = len(EXPECTED_TITLES)

pytestmark = [pytest.mark.browser, pytest.mark.slow]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_server_config(config_dir: Path) -> None:
    """Server config for this run only (JUPYTER_CONFIG_DIR points here).

    Websocket keep-alive pings are off: on a busy two-core machine a ping can go
    unanswered for the default 90 s, and the server then drops the kernel connection in
    the middle of the test. The connection is local; nothing needs detecting.
    """
    config_dir.mkdir(parents=True, exist_ok=True)
    (config_dir / "jupyter_server_config.json").write_text(json.dumps({"ServerApp": {"tornado_settings": {"ws_ping_interval": 0}}}))


def _write_settings(settings_dir: Path) -> None:
    """User settings for this server only: no news/update fetches, no virtual scrolling."""
    files = {
        "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false", "checkForUpdates": False},
        # "full" windowing detaches cells outside the viewport; the test counts every plot.
        "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    }
    for rel, content in files.items():
        path = settings_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(content))


def _wait_for_server(url: str, proc: subprocess.Popen, log: Path, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"jupyter lab exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"jupyter lab did not answer {url} within {timeout:.0f} s:\n{log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen) -> None:
    """Stop the server and its kernels (they share its process group)."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=15)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)


ALL_CELLS_RAN = """() => {
    const prompts = [...document.querySelectorAll('.jp-CodeCell .jp-InputArea-prompt')];
    const ind = document.querySelector('.jp-Notebook-ExecutionIndicator');
    return prompts.length > 0 && prompts.every(p => /\\[\\d+\\]/.test(p.textContent))
        && ind !== null && ind.getAttribute('data-status') === 'idle';
}"""
KERNEL_READY = """() => {
    const ind = document.querySelector('.jp-Notebook-ExecutionIndicator');
    return ind !== null && ind.getAttribute('data-status') === 'idle'
        && document.querySelector('.jp-Dialog') === null;
}"""


def _kernel_idle(base: str, token: str, notebook: str) -> bool:
    """Does the server report an idle kernel for ``notebook``? (The DOM's status can read
    "Idle" before any kernel exists.)"""
    try:
        with urllib.request.urlopen(f"{base}/api/sessions?token={token}", timeout=5) as r:
            sessions = json.loads(r.read())
    except OSError:
        return False
    return any(s.get("path", "").endswith(notebook) and (s.get("kernel") or {}).get("execution_state") == "idle" for s in sessions)


def _wait_until(page, js: str, timeout_s: float, what: str, also=lambda: True) -> None:
    """Poll ``js`` in the page; accept JupyterLab's "Select Kernel" dialog if it appears.

    The dialog shows up when the notebook opens before the kernel specs have loaded (a
    race on a busy machine); its default button starts the notebook's own kernel.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        dialog = page.locator(".jp-Dialog .jp-mod-accept")
        if dialog.count():
            dialog.first.click()
        if page.evaluate(js) and also():
            return
        page.wait_for_timeout(500)
    raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def _plot_titles(page) -> list[str]:
    """Every plotly figure's title, in page order ("" for a figure without one)."""
    return page.evaluate(
        "() => [...document.querySelectorAll('.js-plotly-plot')].map(p => (p.querySelector('.gtitle') || {}).textContent || '')"
    )


def _titles_ok(page, step: int) -> bool:
    """All six figures drawn, in order, each titled with ``step`` -- a figure whose widget
    failed to initialise has no title, and one that missed an update shows the old step."""
    got = _plot_titles(page)
    at_step = re.compile(rf"\bstep {step}(?!\d)")
    return len(got) == EXPECTED_PLOTS and all(g.startswith(w) and at_step.search(g) for g, w in zip(got, EXPECTED_TITLES))


def _run_all(page) -> None:
    page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
    page.locator("li[data-command='runmenu:run-all']").click()


@contextlib.contextmanager
def lab_page(tmp_path: Path, files: dict[Path, str], first: str) -> Iterator[tuple[Any, Any, str, str, Path]]:
    """JupyterLab on a temporary root holding ``files`` (source -> relative path), Chromium
    open on ``first`` with its kernel idle. Yields (page, playwright module, base url,
    token, log); on failure saves ``test-artifacts/browser_failure_<first>.png``."""
    if not CHROMIUM.exists():
        pytest.skip("Debian's Chromium is not installed (/usr/bin/chromium); `apt-get install -y chromium` to run this test")
    playwright_sync = pytest.importorskip("playwright.sync_api")
    root = tmp_path / "root"
    for src, rel in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src, root / rel)
    settings, workspaces, runtime = tmp_path / "settings", tmp_path / "workspaces", tmp_path / "runtime"
    _write_settings(settings)
    _write_server_config(tmp_path / "config")
    workspaces.mkdir()
    token, port = secrets.token_hex(16), _free_port()
    env = dict(
        os.environ,
        JUPYTER_RUNTIME_DIR=str(runtime),
        JUPYTER_CONFIG_DIR=str(tmp_path / "config"),
        IPYTHONDIR=str(tmp_path / "ipython"),
        JUPYTERLAB_SETTINGS_DIR=str(settings),
    )
    jupyter = Path(sys.executable).with_name("jupyter")
    cmd = [
        str(jupyter), "lab", "--allow-root", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
        f"--ServerApp.token={token}", f"--ServerApp.root_dir={root}", "--ServerApp.port_retries=0",
        f"--LabApp.user_settings_dir={settings}", f"--LabApp.workspaces_dir={workspaces}",
    ]
    log = tmp_path / "jupyter.log"
    ARTIFACTS.mkdir(exist_ok=True)
    with open(log, "w") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=root, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_for_server(f"{base}/api/status?token={token}", proc, log)
        with playwright_sync.sync_playwright() as pw:
            browser = pw.chromium.launch(
                executable_path=str(CHROMIUM),
                args=["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                      "--disable-sync", "--disable-component-update", "--disable-dev-shm-usage"],
            )
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 2300})
                try:
                    page.set_default_timeout(60_000)
                    page.goto(f"{base}/lab/tree/{first}?token={token}")
                    page.wait_for_selector(".jp-NotebookPanel .jp-Cell", state="attached")
                    # The kernel must be up before "Run all", or the run is queued behind its start.
                    page.wait_for_timeout(1000)
                    name = Path(first).name
                    _wait_until(page, KERNEL_READY, 120, "the kernel to start", also=lambda: _kernel_idle(base, token, name))
                    page.wait_for_timeout(1000)  # the page's websocket to the kernel
                    yield page, playwright_sync, base, token, log
                except BaseException:
                    # Keep the evidence: what the page looked like, and the server's log.
                    page.screenshot(path=str(ARTIFACTS / f"browser_failure_{Path(first).stem}.png"))
                    print(log.read_text()[-4000:])
                    raise
            finally:
                browser.close()
    finally:
        _stop(proc)


def _assert_no_errors(page) -> None:
    errors = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
    tracebacks = [t for t in errors.all_text_contents() if "Traceback" in t or "Error" in t]
    outputs = page.locator(".jp-OutputArea-output").all_text_contents()
    bad = [t for t in outputs if "Traceback" in t or "Error displaying widget" in t or "Failed to initialize" in t]
    assert not tracebacks and not bad, f"error output in the notebook: {(tracebacks + bad)[0][:2000]}"


@pytest.mark.timeout(420)
def test_player_renders_and_steps(tmp_path: Path) -> None:
    shot = ARTIFACTS / "browser_player.png"
    with lab_page(tmp_path, {NOTEBOOK: NOTEBOOK.name}, NOTEBOOK.name) as (page, playwright_sync, _, _, _):
        page_errors: list[str] = []
        page.on("pageerror", lambda e: page_errors.append(str(e)))
        _run_all(page)
        # Done when every code cell has a number ([1], [2], ...) and the kernel is idle again.
        # Generous: plotly's first import alone takes ~7 s of CPU, and CI machines are shared.
        _wait_until(page, ALL_CELLS_RAN, 240, "every cell to run")
        try:
            page.wait_for_function(f"() => document.querySelectorAll('.js-plotly-plot').length >= {EXPECTED_PLOTS}", timeout=60_000)
            _wait_until(page, "() => true", 60, "the six figures to draw their titles", also=lambda: _titles_ok(page, 0))
        except (TimeoutError, playwright_sync.TimeoutError):
            # anywidget gives a widget 2 s to load its JavaScript; on an overloaded
            # machine the first figure can miss that (the notebook warms plotly up to
            # avoid it). Then, and only then, run the notebook once more.
            if not any("Failed to initialize model" in e for e in page_errors):
                raise
            _run_all(page)
            _wait_until(page, ALL_CELLS_RAN, 240, "every cell to run (second run)")
            _wait_until(page, "() => true", 60, "the six figures (second run)", also=lambda: _titles_ok(page, 0))
        _assert_no_errors(page)
        assert page.locator(".js-plotly-plot").count() == EXPECTED_PLOTS, _plot_titles(page)
        assert "player ready" in page.locator(".jp-OutputArea-output").all_text_contents()[-1]

        # Step: the click goes to the kernel, which redraws every figure in place.
        for step in (1, 2):
            page.locator(".kvlab-player button", has_text="Step ▶").click()
            _wait_until(page, "() => true", 30, f"the figures to show step {step}", also=lambda s=step: _titles_ok(page, s))
        pool_title = _plot_titles(page)[0]
        assert "3 shared" in pool_title, pool_title  # step 2: req1 shares blocks 1-3 with req0
        page.wait_for_timeout(500)  # let plotly finish its transition before the picture
        page.locator(".kvlab-player").first.screenshot(path=str(shot))
    assert shot.exists()


# Every plotly figure on screen (not in a collapsed widget) has drawn its plot area.
DRAWN = """() => {
    const shown = [...document.querySelectorAll('.js-plotly-plot')].filter(p => p.offsetParent !== null);
    return shown.length > 0 && shown.every(p => p.querySelector('.main-svg') !== null);
}"""


@pytest.mark.timeout(600)
@pytest.mark.parametrize("lesson", ["00_start_here.ipynb", "04_refcounts_and_eviction.ipynb", "10_kv_events_on_the_wire.ipynb"])
def test_lesson_renders_every_widget(tmp_path: Path, lesson: str) -> None:
    """A learner's first contact: run all cells of a lesson; every output renders, no error."""
    src = REPO / "notebooks" / lesson
    with lab_page(tmp_path, {src: f"notebooks/{lesson}"}, f"notebooks/{lesson}") as (page, _, _, _, _):
        _run_all(page)
        _wait_until(page, ALL_CELLS_RAN, 420, "every cell of the lesson to run")
        _wait_until(page, DRAWN, 90, "every plotly figure to draw")
        _assert_no_errors(page)
        assert page.locator(".js-plotly-plot").count() >= 1, "a lesson without a single picture"
        assert page.locator(".jp-OutputArea-output .widget-button, .jp-OutputArea-output .js-plotly-plot").count() >= 1
        page.screenshot(path=str(ARTIFACTS / f"browser_{Path(lesson).stem}.png"), full_page=True)


LEARNER_ANSWER = """def find_longest_cache_hit(block_hashes, num_tokens, block_size, cached):
    n = 0
    for h in block_hashes[: (num_tokens - 1) // block_size]:
        if h not in cached:
            break
        n += 1
    return n
"""


@pytest.mark.timeout(420)
def test_learner_fills_an_exercise_and_the_check_passes(tmp_path: Path) -> None:
    """Open an exercise as a new user would: run it (stubs say "not implemented yet"), type
    an answer into the solution cell, run it and the check below it: the check passes."""
    nb = "exercises/ex_prefix_cache.ipynb"
    with lab_page(tmp_path, {REPO / nb: nb}, nb) as (page, _, _, _, _):
        _run_all(page)
        _wait_until(page, ALL_CELLS_RAN, 240, "the exercise notebook to run with its stubs")
        _assert_no_errors(page)
        cells = page.locator(".jp-Notebook .jp-CodeCell")
        idx = next(i for i in range(cells.count()) if "def find_longest_cache_hit" in cells.nth(i).locator(".jp-InputArea").inner_text())
        check_cell = cells.nth(idx + 1)
        assert "not implemented yet" in check_cell.locator(".jp-OutputArea").inner_text()
        editor = cells.nth(idx).locator(".cm-content")
        editor.click()
        page.keyboard.press("Control+A")
        page.keyboard.press("Delete")
        page.keyboard.insert_text(LEARNER_ANSWER)
        page.keyboard.press("Shift+Enter")  # run the answer; the focus moves to the check cell
        page.keyboard.press("Shift+Enter")  # run the check
        _wait_until(page, "() => true", 60, "the check to pass",
                    also=lambda: "✔ PASS longest_hit" in check_cell.locator(".jp-OutputArea").inner_text())
        page.screenshot(path=str(ARTIFACTS / "browser_exercise.png"))
