"""The pictures in a real browser: JupyterLab + headless Chromium, driven by Playwright.

Unit tests check what the views *draw* as data; only a browser shows that the widgets
actually render: that the plotly and ipywidgets front-end extensions load, that the
figures appear without a traceback, and that pressing the player's Step button round-trips
through the kernel and redraws a plot. Here:

* every lesson, Run All on the learner's working copy, every prediction locked: every output
  renders, no error, no raw widget repr, and every cell marked ``# NBVAL_CHECK_OUTPUT``
  reproduces its stored output (checked_outputs.py: nbval's check, made on this run -- the
  lessons run once in ``make test``, here);
* the player: six figures, Step redraws them, the stop button (■ jumped to step 0) is gone;
* a saved lesson reopened (its widgets' models gone) and a never-run lesson: still
  pictures instead of "Error displaying widget" or ``VBox(children=…``;
* a learner filling in an exercise;
* ``kvlab.export_html`` offline: every request except ``file://`` is blocked, the page is
  stepped through, the pictures change;
* the views under Chromium's colour-vision-deficiency emulation (CDP
  ``Emulation.setEmulatedVisionDeficiency``), screenshots kept for a person to look at.

One JupyterLab serves the module's tests on each pytest-xdist worker that runs them (on a free port, a random token, a temporary root
holding copies of the lessons, exercises and ``player_demo.ipynb`` and the learner's working
copies under ``my-kvlab/`` (as ``make lab`` prepares them), with user settings and
workspaces in temporary directories: news fetching and update checks off, notebook
windowing off so every output is rendered), so it changes nothing on the machine; each test
shuts its notebook's kernel down. It uses Debian's Chromium (``apt-get install chromium``);
it never downloads a browser. Screenshots go to ``test-artifacts/``.
"""

from __future__ import annotations

import contextlib
import http.client
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

import checked_outputs
from kvlab import workspace

CHROMIUM = Path("/usr/bin/chromium")
HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
ARTIFACTS = REPO / "test-artifacts"
NOTEBOOK = HERE / "player_demo.ipynb"
CAPSTONE_DEMO = HERE / "capstone_demo.ipynb"  # the capstone's Player, run beside six busy processes
# The player's six default views, in display order, by the start of their titles.
EXPECTED_TITLES = ["Block pool", "Free queue", "Block tables", "Hash chains", "Timeline", "Attention read"]
EXPECTED_PLOTS = len(EXPECTED_TITLES)

# Under pytest-xdist (`make test`) each worker that runs browser tests starts its own
# JupyterLab and Chromium (the module-scoped `lab` fixture), so the tests need not stay together.
pytestmark = [pytest.mark.browser, pytest.mark.slow]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_server_config(config_dir: Path, sockets: Path) -> None:
    """Server config for this run only (JUPYTER_CONFIG_DIR points here).

    Websocket keep-alive pings are off: on a busy two-core machine a ping can go
    unanswered for the default 90 s, and the server then drops the kernel connection in
    the middle of the test. The connection is local; nothing needs detecting.

    Kernels talk to the server over Unix sockets under ``sockets`` (ZeroMQ's ipc transport)
    instead of five TCP ports each: Jupyter picks a kernel's TCP ports by binding and
    releasing them, and a test on another worker bound one of them before the kernel did
    (seen once: the kernel died with "Address already in use" and the lesson never started).
    """
    config_dir.mkdir(parents=True, exist_ok=True)
    sockets.mkdir(parents=True, exist_ok=True)
    config = {
        "ServerApp": {"tornado_settings": {"ws_ping_interval": 0}},
        "KernelManager": {"transport": "ipc", "ip": str(sockets / "kernel")},
    }
    (config_dir / "jupyter_server_config.json").write_text(json.dumps(config))


def _write_settings(settings_dir: Path) -> None:
    """User settings for this server only: no news/update fetches, no virtual scrolling."""
    files = {
        "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false", "checkForUpdates": False},
        # "full" windowing detaches cells outside the viewport; the test counts every plot.
        "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
        # A saved lesson keeps its widgets' state: the answers behind the prediction locks live
        # in Output widgets, and the lessons' checked outputs are read from there
        # (checked_outputs.py). A learner's Lab keeps the default (off); the test that
        # reopens a saved lesson removes the state first.
        "@jupyter-widgets/jupyterlab-manager/plugin.jupyterlab-settings": {"saveState": True},
    }
    for rel, content in files.items():
        path = settings_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(content))


class _PortTaken(Exception):
    """Another process took the port between ``_free_port`` and the server's bind."""


def _wait_for_server(url: str, proc: subprocess.Popen, log: Path, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            text = log.read_text()
            if "already in use" in text:
                raise _PortTaken(text[-500:])
            raise RuntimeError(f"jupyter lab exited with {proc.returncode}:\n{text[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except http.client.HTTPException as e:
            # Not an HTTP answer: some other program listens there (seen once: a ZeroMQ socket
            # of a test on another worker bound the port first); the server cannot bind it.
            raise _PortTaken(repr(e)) from e
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


# Every wait below is for a state, bounded; on a machine busy with other jobs the states come
# later, so the bounds are stretched by this factor (KVLAB_PATIENCE, default 3). A bound is
# never a verdict on speed: reaching the state is the test.
PATIENCE = float(os.environ.get("KVLAB_PATIENCE", "3"))


def _wait_until(page, js: str, timeout_s: float, what: str, also=lambda: True, seen=None) -> None:
    """Poll ``js`` in the page; accept JupyterLab's "Select Kernel" dialog if it appears.
    ``seen()``, if given, says in the timeout message what the page showed instead.

    The dialog shows up when the notebook opens before the kernel specs have loaded (a
    race on a busy machine); its default button starts the notebook's own kernel.
    """
    timeout_s *= PATIENCE
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        dialog = page.locator(".jp-Dialog .jp-mod-accept")
        if dialog.count():
            dialog.first.click()
        if page.evaluate(js) and also():
            return
        # Twice a second: each look is a round trip through Playwright's driver into the page
        # (and, for the kernel's state, the server) that competes with the work being waited
        # for on two cores; a slower pace leaves each wait idle for longer after its state came.
        page.wait_for_timeout(500)
    raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}" + (f"; the page shows {seen()}" if seen else ""))


def _settle(page, promise_js: str, timeout_s: float, what: str) -> None:
    """Start ``promise_js`` (an expression giving a promise) in the page and wait until it
    has settled, by polling a flag it sets: a promise handed back through page.evaluate can be
    dropped by the page before it settles, and Playwright then fails with "Resulting promise
    was garbage collected" (seen at JupyterLab's ``restored`` in a quiet CI run)."""
    page.evaluate(f"() => {{ window.__kvlabSettled = false; ({promise_js}).then(() => {{ window.__kvlabSettled = true; }}); }}")
    _wait_until(page, "() => window.__kvlabSettled === true", timeout_s, what)


def _run_all(page) -> None:
    page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
    page.locator("li[data-command='runmenu:run-all']").click()


class Lab:
    """One JupyterLab server and one Chromium for the whole module."""

    def __init__(self, tmp: Path, home: Path | None = None) -> None:
        if not CHROMIUM.exists():
            pytest.skip("Debian's Chromium is not installed (/usr/bin/chromium); `apt-get install -y chromium` to run this test")
        self.pw_mod = pytest.importorskip("playwright.sync_api")
        self.root = tmp / "root"
        for folder in ("notebooks", "exercises"):
            shutil.copytree(REPO / folder, self.root / folder)
        for demo in (NOTEBOOK, CAPSTONE_DEMO):
            shutil.copy(demo, self.root / demo.name)
        # The learner's working copies, as `make lab` prepares them (outputs cleared).
        workspace.prepare(REPO, self.root / WORKDIR)
        settings, workspaces, runtime = tmp / "settings", tmp / "workspaces", tmp / "runtime"
        _write_settings(settings)
        _write_server_config(tmp / "config", tmp / "sockets")
        workspaces.mkdir()
        self.token = secrets.token_hex(16)
        # The kernels' learner record (KVLAB_HOME): this server's own, emptied as each notebook
        # opens -- a lesson that an earlier test ran here would otherwise come back with its
        # predictions already locked (they are restored from the record).
        self.home = home or tmp / "kvlab-home"
        env = dict(
            os.environ,
            JUPYTER_RUNTIME_DIR=str(runtime),
            JUPYTER_CONFIG_DIR=str(tmp / "config"),
            IPYTHONDIR=str(tmp / "ipython"),
            JUPYTERLAB_SETTINGS_DIR=str(settings),
            KVLAB_HOME=str(self.home),
        )
        # The kernels run as a learner's do: the root conftest forces KVLAB_PREDICT=plain for
        # nbval, but here every "predict, then run" answer must stay behind its lock.
        env.pop("KVLAB_PREDICT", None)
        jupyter = Path(sys.executable).with_name("jupyter")
        cmd = [
            str(jupyter),
            "lab",
            "--allow-root",
            "--no-browser",
            "--ip=127.0.0.1",
            f"--ServerApp.token={self.token}",
            f"--ServerApp.root_dir={self.root}",
            "--ServerApp.port_retries=0",
            f"--LabApp.user_settings_dir={settings}",
            f"--LabApp.workspaces_dir={workspaces}",
            # window.jupyterapp: the lessons open, save and close through Lab's own commands in
            # one page, instead of loading the whole application again for each (5 s of CPU).
            "--LabApp.expose_app_in_browser=True",
        ]
        self.log = tmp / "jupyter.log"
        ARTIFACTS.mkdir(exist_ok=True)
        self._pages = 0
        self._lesson_page: Any = None
        for attempt in range(3):
            port = _free_port()  # free now; another process may still take it before the bind
            with open(self.log, "w") as logf:
                self.proc = subprocess.Popen(
                    [*cmd, f"--port={port}"], stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=self.root, start_new_session=True
                )
            self.base = f"http://127.0.0.1:{port}"
            try:
                _wait_for_server(f"{self.base}/api/status?token={self.token}", self.proc, self.log)
                break
            except _PortTaken:
                _stop(self.proc)
                if attempt == 2:
                    raise
            except BaseException:
                _stop(self.proc)
                raise
        try:
            self._pw = self.pw_mod.sync_playwright().start()
            self.browser = self._pw.chromium.launch(executable_path=str(CHROMIUM), args=BROWSER_ARGS)
        except BaseException:
            _stop(self.proc)
            raise

    def close(self) -> None:
        try:
            self._drop_lesson_page()
            self.browser.close()
            self._pw.stop()
        finally:
            _stop(self.proc)

    def _api(self, method: str, path: str) -> Any:
        req = urllib.request.Request(f"{self.base}{path}?token={self.token}", method=method)
        with urllib.request.urlopen(req, timeout=10) as r:
            body = r.read()
        return json.loads(body) if body else None

    def shutdown_kernels(self) -> None:
        """Stop every kernel: the next test starts from a quiet machine."""
        for s in self._api("GET", "/api/sessions"):
            self._api("DELETE", f"/api/sessions/{s['id']}")

    @contextlib.contextmanager
    def notebook(self, rel: str, *, run_kernel: bool = True) -> Iterator[Any]:
        """A page on ``rel``, its kernel idle (``run_kernel``); on failure a screenshot
        ``test-artifacts/browser_failure_<name>.png`` and the server log's tail."""
        (self.home / "progress.json").unlink(missing_ok=True)
        page = self._new_page()
        try:
            page.goto(self._fresh_workspace(f"/tree/{rel}"))
            page.wait_for_selector(".jp-NotebookPanel .jp-Cell", state="attached")
            if run_kernel:
                page.wait_for_timeout(1000)
                self._wait_for_kernel(page, Path(rel).name)
            yield page
        except BaseException:
            self._report_failure(page, rel)
            raise
        finally:
            page.close()
            self.shutdown_kernels()

    @contextlib.contextmanager
    def working_copy(self, lesson: str) -> Iterator[Any]:
        """The learner's working copy of ``lesson`` open in the page kept for lessons, its
        kernel idle. Lab is loaded once; each lesson opens through ``docmanager:open`` and is
        closed (its kernel shut down) afterwards. On failure: a screenshot, the server log's
        tail, and the page is dropped (the next lesson gets a fresh one)."""
        (self.home / "progress.json").unlink(missing_ok=True)
        if self._lesson_page is None:
            page = self._new_page()
            page.goto(self._fresh_workspace(""))
            _wait_until(page, "() => !!(window.jupyterapp && window.jupyterapp.shell)", 60, "JupyterLab to load")
            _settle(page, "window.jupyterapp.restored", 60, "JupyterLab to restore its layout")
            self._lesson_page = page
        page = self._lesson_page
        try:
            path = f"{WORKDIR}/notebooks/{lesson}"
            for attempt in (1, 2):  # a second try if the first open never settled
                page.evaluate(OPEN_NOTEBOOK, path)
                try:
                    _wait_until(page, "() => true", 60, f"{lesson} to open", also=lambda: page.evaluate(NOTEBOOK_OPEN, path))
                    break
                except TimeoutError:
                    if attempt == 2:
                        raise
            page.wait_for_selector(".jp-NotebookPanel .jp-Cell", state="attached")
            self._wait_for_kernel(page, lesson)
            yield page
            page.evaluate("() => { const w = window.__kvlabNotebook; window.__kvlabNotebook = null; w.dispose(); }")
        except BaseException:
            self._report_failure(page, lesson)
            self._drop_lesson_page()
            raise
        finally:
            self.shutdown_kernels()

    def _new_page(self) -> Any:
        page = self.browser.new_page(viewport={"width": 1400, "height": 2300})
        page.set_default_timeout(60_000)
        return page

    def _fresh_workspace(self, route: str) -> str:
        """JupyterLab's URL in a workspace of its own (``route``: e.g. ``/tree/<path>``): in the
        last one it would reopen the last test's notebook beside this one, kernel and all."""
        self._pages += 1
        return f"{self.base}/lab/workspaces/t{self._pages}{route}?reset&token={self.token}"

    def _wait_for_kernel(self, page: Any, name: str) -> None:
        """Until the notebook ``name``'s kernel is idle: "Run all" before that would be queued
        behind the kernel's start."""
        _wait_until(page, KERNEL_READY, 120, "the kernel to start", also=lambda: _kernel_idle(self.base, self.token, name))
        page.wait_for_timeout(1000)  # the page's websocket to the kernel

    def _report_failure(self, page: Any, rel: str) -> None:
        page.screenshot(path=str(ARTIFACTS / f"browser_failure_{Path(rel).stem}.png"))
        print(self.log.read_text()[-4000:])

    def save_lesson(self, lesson: str) -> dict:
        """Save the open lesson (with its widgets' state) and read the file JupyterLab wrote."""
        page = self._lesson_page
        _settle(page, "window.__kvlabNotebook.context.save()", 60, f"{lesson} to be saved")
        return checked_outputs.load(self.root / WORKDIR / "notebooks" / lesson)

    def _drop_lesson_page(self) -> None:
        if self._lesson_page is not None:
            with contextlib.suppress(Exception):
                self._lesson_page.close()
            self._lesson_page = None


# Open a notebook in the lessons' page (its previous one is closed by then) and keep a handle.
# Started in the page and waited for from here (NOTEBOOK_OPEN): a promise handed back through
# page.evaluate can be dropped by the page before it settles -- Playwright then fails with
# "Resulting promise was garbage collected" (seen once in some thirty runs) -- and a state
# polled for can be waited for again.
OPEN_NOTEBOOK = """(path) => {
    window.__kvlabNotebook = null;
    window.jupyterapp.commands.execute('docmanager:open', {path, factory: 'Notebook'})
        .then(w => w.context.ready.then(() => { window.__kvlabNotebook = w; }));
}"""
NOTEBOOK_OPEN = "(path) => { const w = window.__kvlabNotebook; return !!w && w.context.path === path; }"
WORKDIR = "my-kvlab"


BROWSER_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-sync",
    "--disable-component-update",
    "--disable-dev-shm-usage",
]


# Every plotly figure on screen (not in a collapsed widget, not a hidden still) has drawn its plot area.
DRAWN = """() => {
    const shown = [...document.querySelectorAll('.js-plotly-plot')].filter(p => p.offsetParent !== null);
    return shown.length > 0 && shown.every(p => p.querySelector('.main-svg') !== null);
}"""
VISIBLE_TEXT = """(needle) => [...document.querySelectorAll('.jp-OutputArea-output')]
    .filter(o => o.offsetParent !== null && o.innerText.includes(needle)).length"""


def _visible_plot_titles(page) -> list[str]:
    """The titles of the plotly figures on screen (a still hidden behind its live player is
    not), their lines joined by " | "."""
    return page.evaluate(
        "() => [...document.querySelectorAll('.js-plotly-plot')].filter(p => p.offsetParent !== null).map(p => {"
        " const t = p.querySelector('.gtitle'); if (!t) return '';"
        " const lines = [...t.querySelectorAll('tspan.line')].map(x => x.textContent);"
        " return lines.length ? lines.join(' | ') : t.textContent; })"
    )


def _titles_ok(page, step: int) -> bool:
    """All six figures drawn, in order, each titled with ``step`` -- a figure whose widget
    failed to initialise has no title, and one that missed an update shows the old step."""
    got = _visible_plot_titles(page)
    at_step = re.compile(rf"\bstep {step}(?!\d)")
    return len(got) == EXPECTED_PLOTS and all(g.startswith(w) and at_step.search(g) for g, w in zip(got, EXPECTED_TITLES))


def _assert_no_errors(page) -> None:
    errors = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
    tracebacks = [t for t in errors.all_text_contents() if "Traceback" in t or "Error" in t]
    bad = [n for n in ("Traceback", "Error displaying widget", "Failed to initialize", "VBox(children") if page.evaluate(VISIBLE_TEXT, n)]
    assert not tracebacks and not bad, f"error output in the notebook: {(tracebacks or bad)[0][:2000]}"


@pytest.mark.timeout(420)
def test_player_draws_in_the_page_and_steps_without_the_kernel(lab: Lab) -> None:
    """One widget draws the six views in the page; the still stays until they are drawn; Step
    redraws them from what the page already holds, and the kernel's player follows."""
    shot = ARTIFACTS / "browser_player.png"
    with lab.notebook(NOTEBOOK.name) as page:
        page_errors: list[str] = []
        page.on("pageerror", lambda e: page_errors.append(str(e)))
        _run_all(page)
        # Done when every code cell has a number ([1], [2], ...) and the kernel is idle again.
        _wait_until(page, ALL_CELLS_RAN, 240, "every cell to run")
        _wait_until(page, "() => true", 60, "the six figures to draw their titles", also=lambda: _titles_ok(page, 0))
        _assert_no_errors(page)
        assert not page_errors, page_errors
        assert len(_visible_plot_titles(page)) == EXPECTED_PLOTS, _visible_plot_titles(page)
        assert "player ready" in page.locator(".jp-OutputArea-output").all_text_contents()[-1]
        # The still gave way to the live player (one still, hidden; the player on screen).
        assert _stills(page) == [(False, True)]
        player = page.locator(".kvlab-player").first
        assert [b.strip() for b in player.locator(".kv-controls button").all_inner_texts()] == ["◀ Back", "▶ Play", "Step ▶"]
        # Step: drawn from the frames the page already has, then the kernel hears of it.
        for step in (1, 2):
            player.locator("button", has_text="Step ▶").click()
            _wait_until(page, "() => true", 30, f"the figures to show step {step}", also=lambda s=step: _titles_ok(page, s))
        pool_title = _visible_plot_titles(page)[0]
        assert "3 shared" in pool_title, pool_title  # step 2: req1 shares blocks 1-3 with req0
        # Once used, a recorded run's other steps come in the background: every jump is local.
        have = "() => document.querySelector('.kvlab-player .kv-replay').dataset.have"
        _wait_until(page, f"() => ({have})() === '9'", 60, "the page to hold all 9 steps", seen=lambda: page.evaluate(have))
        # Picking a request outlines it: the page draws it from the patches it holds.
        marked = "() => [...document.querySelectorAll('.kvlab-player svg text')].some(t => t.textContent === '▶ req1')"
        assert not page.evaluate(marked)
        player.locator("select[aria-label='request']").select_option("req1")
        _wait_until(page, marked, 30, "the timeline to name the selected request's row ▶ req1")
        pool_marks = "() => [...document.querySelectorAll('.kvlab-player .js-plotly-plot')].filter(p => p.offsetParent)[0].data[1].x"
        assert list(page.evaluate(pool_marks)) == [1, 2, 3, 5]  # req1's blocks (one pool row)
        box = player.bounding_box()
        area = page.locator(".jp-OutputArea-output").first.bounding_box()
        assert box["width"] <= area["width"] + 1, (box, area)  # the player fits the output area
        page.wait_for_timeout(500)  # let plotly finish its transition before the picture
        player.screenshot(path=str(shot))
        # The views take the room the output area has: at 1280 px with the file browser open,
        # two columns that fit; at 1920 px, three.
        grid_cols = "() => document.querySelector('.kvlab-player .kv-grid').style.gridTemplateColumns"
        fits = """() => { const p = document.querySelector('.kvlab-player .kv-replay').getBoundingClientRect();
            const a = document.querySelector('.kvlab-player').closest('.jp-OutputArea-output').getBoundingClientRect();
            return p.width > 0 && p.right <= a.right + 1; }"""
        _settle(page, "window.jupyterapp.commands.execute('filebrowser:activate')", 30, "the file browser to open")
        for width, cols in ((1280, "repeat(2, max-content)"), (1920, "repeat(3, max-content)")):
            page.set_viewport_size({"width": width, "height": 1400})
            _wait_until(page, f"() => ({grid_cols})() === '{cols}' && ({fits})()", 30, f"the Player to fit {width} px in {cols}")
            player.screenshot(path=str(ARTIFACTS / f"browser_player_{width}.png"))
    assert shot.exists()


# Every plotly plot on the page has its data and has drawn something in its plot area.
TRACES_DRAWN = """() => {
    const shown = [...document.querySelectorAll('.js-plotly-plot')].filter(p => p.offsetParent !== null);
    return shown.length > 0 && shown.every(p => p.data && p.data.length > 0 && p.querySelectorAll('.main-svg .trace, .main-svg .hm').length > 0);
}"""


@contextlib.contextmanager
def _busy(n: int) -> Iterator[list[int]]:
    """``n`` CPU-bound processes for the length of the block (a slow Binder pod, a shared
    machine), stopped by their PIDs afterwards whatever happened."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield [b.pid for b in burners]
    finally:
        for b in burners:
            b.kill()
            b.wait()


# `make test-busy` sets this: every lesson's run below then has that many CPU-bound processes
# beside it (one lesson at a time, so it is exactly that many).
BUSY = int(os.environ.get("KVLAB_BROWSER_BUSY", "0") or 0)


# Only in `make test-busy` (CI runs it after `make test`): inside `make test` its six burners
# would also starve the other workers' tests for the half minute it runs, and it would run twice.
@pytest.mark.skipif(not BUSY, reason="runs in `make test-busy`, one test at a time (KVLAB_BROWSER_BUSY unset)")
@pytest.mark.timeout(900)
def test_the_capstone_player_draws_completely_beside_six_busy_processes(lab: Lab) -> None:
    """The machine a slow Binder pod is: six CPU-bound processes on two cores. The capstone's
    Player still draws all six views on first display, no widget fails to start, and the
    still gives way to it. The times are printed, not judged (the waits are for states)."""
    with _busy(6), lab.notebook(CAPSTONE_DEMO.name) as page:
        console: list[str] = []
        page.on("console", lambda m: console.append(m.text))
        t0 = time.monotonic()
        _run_all(page)
        _wait_until(page, ALL_CELLS_RAN, 300, "every cell to run")
        ran = time.monotonic()
        start = int(page.locator(".jp-OutputArea-output").first.inner_text().strip())
        _wait_until(page, "() => true", 120, "the six views at the first preemption", also=lambda: _titles_ok(page, start))
        drawn = time.monotonic()
        _assert_no_errors(page)
        assert page.evaluate(TRACES_DRAWN), _visible_plot_titles(page)
        assert not [m for m in console if "Failed to initialize" in m], console
        assert _stills(page) == [(False, True)]
        page.locator(".kvlab-player").first.screenshot(path=str(ARTIFACTS / "browser_capstone_busy.png"))
        print(f"capstone player beside 6 busy processes: cells ran in {ran - t0:.1f} s; all six views drawn {drawn - ran:.1f} s later")


LESSONS = sorted(p.name for p in (REPO / "notebooks").glob("[0-9][0-9]*_*.ipynb"))
# The lesson whose run also checks predict-then-reveal closely (test_predict_browser.py).
PREDICT_LESSON = "03_prefix_caching.ipynb"


@pytest.mark.timeout(1800 if BUSY else 600)
@pytest.mark.parametrize("lesson", LESSONS)
def test_lesson_runs_clean(lab: Lab, lesson: str) -> None:
    """A learner's first contact: run all cells of their working copy of a lesson (outputs
    cleared, as `make lab` prepares it); every output renders, every plotly plot on screen has
    drawn its traces, no widget failed to start, no error; and every cell marked
    ``# NBVAL_CHECK_OUTPUT`` reproduces the output stored in the lesson (nbval's check, made
    on this run: checked_outputs.py) -- the one run of each lesson in `make test`, beside
    ``KVLAB_BROWSER_BUSY`` CPU-bound processes in `make test-busy`."""
    with _busy(BUSY), lab.working_copy(lesson) as page:
        t = time.monotonic()
        console: list[str] = []
        listen = lambda m: console.append(m.text)  # noqa: E731
        page.on("console", listen)
        _run_all(page)
        _wait_until(page, ALL_CELLS_RAN, 1500 if BUSY else 480, "every cell of the lesson to run")
        if lesson == PREDICT_LESSON:  # its first prediction, locked by hand and looked at
            from test_predict_browser import check_first_prediction

            check_first_prediction(page, lab)
        n = _lock_every_prediction(page)  # the answers (and most pictures) open only then
        _wait_until(page, DRAWN, 90, "every plotly figure to draw")
        _wait_until(page, TRACES_DRAWN, 90, "every plotly figure on screen to draw its traces")
        _assert_no_errors(page)
        page.remove_listener("console", listen)
        # A widget whose front end missed its start-up budget (anywidget logs this) stays blank.
        assert not [m for m in console if "Failed to initialize" in m], [m for m in console if "Failed" in m]
        assert page.locator(".js-plotly-plot").count() >= 1, "a lesson without a single picture"
        page.screenshot(path=str(ARTIFACTS / f"browser_{Path(lesson).stem}.png"), full_page=True)
        if lesson == STILLS_LESSON:  # live: the stills hide behind their widgets
            _wait_until(
                page,
                "() => true",
                60,
                "the live widgets",
                also=lambda: _stills(page) == [(False, True)] * N_WIDGETS_05A,
                seen=lambda: _stills(page),
            )
        ran = lab.save_lesson(lesson)
        stored = checked_outputs.load(REPO / "notebooks" / lesson)
        checked = checked_outputs.checked_cells(stored)
        problems = checked_outputs.mismatches(stored, ran)
        assert not problems, f"{lesson}: {len(problems)} of {len(checked)} checked cells differ from the lesson:\n" + "\n".join(problems)
        print(f"{lesson}: ran, {n} predictions locked, {len(checked)} checked outputs reproduced, in {time.monotonic() - t:.0f} s")
    if lesson == STILLS_LESSON:
        _reopened_lesson_shows_stills(lab, lesson, ran)


# An answer still behind its lock: the waiting line is in the DOM (textContent: no layout of
# the whole notebook, which innerText would force on every look).
STILL_LOCKED = "() => document.querySelector('.jp-Notebook').textContent.includes('The answer is ready')"


def _lock_every_prediction(page) -> int:
    """Answer every "predict, then run" form as a learner would (a number, the first choice or
    a sentence), press "Lock in", and wait until no answer is still behind its lock. Returns
    how many were locked here (a form locked before is passed over)."""
    forms = page.locator(".jp-OutputArea-output:has(.kvlab-live)", has_text="✎ Predict:")
    n = 0
    for i in range(forms.count()):
        form = forms.nth(i)
        if "Locked in:" in form.inner_text():
            continue
        n += 1
        form.scroll_into_view_if_needed()
        if form.locator("input[type='radio']").count():
            form.locator("input[type='radio']").first.check()
        elif form.locator("textarea").count():
            form.locator("textarea").first.fill("a guess")
        else:
            form.locator("input[type='text']").first.fill("1")
        lock = form.locator("button", has_text="Lock in")
        _wait_until(page, "() => true", 20, "Lock in to enable", also=lambda: lock.is_enabled())
        lock.click()
    _wait_until(page, "() => true", 60, "every answer to open", also=lambda: not page.evaluate(STILL_LOCKED))
    return n


def test_a_never_run_lesson_shows_still_pictures(lab: Lab) -> None:
    """A never-run lesson (untrusted: no widgets) shows each widget's still: no error, no repr.
    (A saved lesson reopened, its widgets' models gone: `_reopened_lesson_shows_stills`, after
    that lesson's run in `test_lesson_runs_clean`.)"""
    with lab.notebook(f"notebooks/{STILLS_LESSON}", run_kernel=False) as page:  # the committed file, as a reader opens it
        _wait_until(page, "() => true", 90, "the stills to draw", also=lambda: _stills(page) == [(True, False)] * 1)
        _assert_no_errors(page)
        _still_shot(page, "browser_still_never_run_05a.png")


def _reopened_lesson_shows_stills(lab: Lab, lesson: str, ran: dict) -> None:
    """The learner's run of ``lesson``, saved as a learner's Lab saves it (without widget
    state: this Lab saves it for the lessons' checked outputs, a learner's keeps JupyterLab's
    default, off), then reopened with a fresh kernel: every widget's model is gone, and each
    shows its still (the Player, the hints cell, the prediction forms and their answer
    areas); no error, no repr."""
    assert ran["metadata"].pop("widgets", None) is not None, "the save did not reach the file"
    rel = f"{WORKDIR}/notebooks/{lesson}"
    (lab.root / rel).write_text(json.dumps(ran))
    with lab.notebook(rel) as page:
        page.wait_for_timeout(3000)  # the widget manager gives up on the old models
        _wait_until(
            page,
            "() => true",
            90,
            "the stills to show",
            also=lambda: _stills(page) == [(True, False)] * N_WIDGETS_05A,
            seen=lambda: _stills(page),
        )
        _assert_no_errors(page)
        _still_shot(page, "browser_still_reopened_05a.png")


# The lesson whose stills are checked, never run and reopened: a Player and four prediction forms.
STILLS_LESSON = "05a_token_budget_and_preemption.ipynb"
# The widgets lesson 05a displays with a still, run top to bottom.
N_WIDGETS_05A = 11
# Each widget displayed with a still: (is the still on screen and drawn, is the widget on screen).
STILLS = """() => [...document.querySelectorAll('.jp-OutputArea-child')].filter(c => c.querySelector('.kvlab-still-next')).map(c => {
    const still = c.nextElementSibling, live = still && still.nextElementSibling;
    const drawn = still !== null && still.offsetParent !== null
        && (still.querySelector('.js-plotly-plot .main-svg, .jp-RenderedPlotly img') !== null || still.innerText.trim().length > 0);
    return [drawn, live !== null && live.offsetParent !== null && live.innerText.trim().length > 0];
})"""


def _stills(page) -> list[tuple[bool, bool]]:
    return [tuple(x) for x in page.evaluate(STILLS)]


def _still_shot(page, name: str) -> None:
    """A screenshot of the first still (the Player's) and the cell around it."""
    cell = page.locator(".jp-CodeCell:has(.kvlab-still-next)").first
    cell.scroll_into_view_if_needed()
    page.wait_for_timeout(1000)
    cell.screenshot(path=str(ARTIFACTS / name))


LEARNER_ANSWER = """def find_longest_cache_hit(block_hashes, num_tokens, block_size, cached):
    n = 0
    for h in block_hashes[: (num_tokens - 1) // block_size]:
        if h not in cached:
            break
        n += 1
    return n
"""


@pytest.mark.timeout(420)
def test_learner_fills_an_exercise_and_the_check_passes(lab: Lab) -> None:
    """Open an exercise as a new user would: run it (stubs say "not implemented yet"), type
    an answer into the solution cell, run it and the check below it: the check passes."""
    with lab.notebook("exercises/ex_prefix_cache.ipynb") as page:
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
        _wait_until(
            page,
            "() => true",
            60,
            "the check to pass",
            also=lambda: "✔ PASS longest_hit" in check_cell.locator(".jp-OutputArea").inner_text(),
        )
        page.screenshot(path=str(ARTIFACTS / "browser_exercise.png"))


def _offline_page(lab: Lab, path: Path, viewport: dict[str, int] | None = None) -> tuple[Any, list[str], list[str]]:
    """A page on a local file with every request except file:// blocked."""
    page = lab.browser.new_page(viewport=viewport or {"width": 1000, "height": 1300})
    blocked: list[str] = []
    errors: list[str] = []
    page.route("**/*", lambda r: r.continue_() if r.request.url.startswith("file://") else (blocked.append(r.request.url), r.abort()))
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(path.as_uri())
    return page, blocked, errors


def _export_title(page, view: int) -> str:
    return page.evaluate(f"() => (document.querySelector('#kv-view-{view} .gtitle') || {{}}).textContent || ''")


@pytest.mark.timeout(300)
def test_exported_replay_works_offline(lab: Lab, tmp_path: Path) -> None:
    import kvlab
    from kvlab.scenarios import shared_prefix

    path = kvlab.export_html(shared_prefix(), tmp_path / "replay.html", start=0)
    page, blocked, errors = _offline_page(lab, path)
    try:
        page.wait_for_function(
            "() => document.body.dataset.step === '0' && document.querySelectorAll('.js-plotly-plot .main-svg').length >= 6"
        )
        assert _export_title(page, 0).startswith("Block pool · step 0")
        page.click("#kv-next")
        page.click("#kv-next")
        page.wait_for_function("() => document.body.dataset.step === '2'")
        assert "3 shared" in _export_title(page, 0) and _export_title(page, 4).startswith("Timeline · step 2")
        assert "req1 prefix hit" in page.inner_text("#kv-status") and "hit/touch" in page.inner_text("#kv-events")
        # The request menu works without a kernel: each figure carries every request's patch.
        page.select_option("#kv-request", "req1")
        page.wait_for_function("() => document.getElementById('kv-view-0').data[1].x.length === 4")  # req1's blocks 1, 2, 3, 5
        assert "req1" in _export_title(page, 5)  # the kernel view draws req1's reads
        page.select_option("#kv-request", "")
        page.wait_for_function("() => document.getElementById('kv-view-0').data[1].x.length === 0")
        # The step before and the step after are drawn behind the one on screen, so ◀ Back
        # (and Step ▶) only swap which drawing area is shown: the one that held step 1 comes out.
        page.wait_for_function(
            "() => document.querySelector(\"#kv-view-0 ~ div[data-holds='1'], div[data-holds='1'] ~ #kv-view-0\") !== null"
        )
        behind = page.evaluate(
            "() => [...document.getElementById('kv-view-0').parentElement.children].findIndex(d => d.dataset.holds === '1')"
        )
        page.click("#kv-back")
        page.wait_for_function("() => document.body.dataset.step === '1'")
        shown = page.evaluate("() => [...document.getElementById('kv-view-0').parentElement.children].findIndex(d => d.id === 'kv-view-0')")
        assert shown == behind and _export_title(page, 0).startswith("Block pool · step 1")
        page.select_option("#kv-jump", "7")
        page.wait_for_function("() => document.body.dataset.step === '7'")
        page.fill("#kv-slider", "4")
        page.dispatch_event("#kv-slider", "input")
        page.wait_for_function("() => document.body.dataset.step === '4'")
        page.click("#kv-play")
        # Playing moves on by itself (past step 4); how far before the pause lands depends on
        # the machine's load, so the test waits for a state, not for a particular step.
        page.wait_for_function("() => Number(document.body.dataset.step) > 4", timeout=60_000)
        page.click("#kv-play")  # pause: it stays where it is
        page.wait_for_function("() => document.getElementById('kv-play').textContent === '▶ Play'")
        here = page.evaluate("() => document.body.dataset.step")
        assert int(here) > 4
        page.wait_for_timeout(1500)
        assert page.evaluate("() => document.body.dataset.step") == here
        page.screenshot(path=str(ARTIFACTS / "export_offline.png"), full_page=True)
        # A narrow window (a phone held upright): the views are drawn smaller, nothing is cut off.
        page.set_viewport_size({"width": 480, "height": 900})
        page.wait_for_function("() => document.documentElement.scrollWidth <= window.innerWidth")
        assert page.evaluate("() => document.querySelector('.kv-grid').style.gridTemplateColumns") == "max-content"  # one column
        page.screenshot(path=str(ARTIFACTS / "export_narrow.png"), full_page=True)
        assert not errors, errors
        assert blocked == [], blocked  # nothing asked for the network
        print(f"export: {path.stat().st_size / 1e6:.2f} MB written")
    finally:
        page.close()


VISIONS = ("none", "protanopia", "deuteranopia", "tritanopia", "achromatopsia")


@pytest.mark.timeout(300)
def test_colour_blind_screenshots(lab: Lab, tmp_path: Path) -> None:
    """Every view, under Chromium's emulation of each colour-vision deficiency: screenshots
    for a person to look at (test-artifacts/cvd_*.png). The emulation must be in effect:
    each deficiency changes the pixels."""
    import kvlab
    from kvlab.scenarios import shared_prefix

    # The pool with free, in use, shared and null blocks and the lookup walk; a busy run with
    # cached blocks and preemptions (the Gantt's four states); the kernel view with traced loads.
    pages = {"story": kvlab.export_html(shared_prefix(), tmp_path / "story.html", start=2)}
    pages["preemption"] = kvlab.export_html(_preemption_run(), tmp_path / "pre.html", start=_PRE_STEP[0])
    pages["kernel"] = kvlab.export_html(_traced_run(), tmp_path / "kernel.html", views=("pool", "table", "kernel", "hash"), start=4)
    for name, path in pages.items():
        page, _, errors = _offline_page(lab, path)
        try:
            page.wait_for_function("() => document.querySelectorAll('.js-plotly-plot .main-svg').length >= 4")
            page.wait_for_timeout(500)
            cdp = page.context.new_cdp_session(page)
            shots = {}
            for vision in VISIONS:
                cdp.send("Emulation.setEmulatedVisionDeficiency", {"type": vision})
                page.wait_for_timeout(300)
                out = ARTIFACTS / f"cvd_{name}_{vision}.png"
                shots[vision] = page.screenshot(path=str(out), full_page=True)
            assert not errors, errors
            assert len({bytes(b) for b in shots.values()}) == len(VISIONS), f"{name}: an emulation did not change the pixels"
        finally:
            page.close()


_PRE_STEP: list[int] = [0]


def _preemption_run() -> Any:
    """A small busy run: shared prefixes, eviction, preemptions (the Gantt's four states)."""
    from kvlab import Request
    from kvlab.engine.llm_engine import build_engine

    e = build_engine(num_blocks=24, block_size=4, max_num_batched_tokens=64)
    system = list(range(500, 512))
    for i in range(8):
        e.add_request(Request(f"r{i}", system + list(range(100 * i, 100 * i + 6)), max_tokens=10, arrival_time=0.01 * i))
    e.run()
    _PRE_STEP[0] = next(ev.step for ev in e.events if ev.kind == "request_preempted")
    return e


def _traced_run() -> Any:
    """Lesson 02's engine on the tiny model: the kernel view with traced loads."""
    import torch

    from kvlab import EventLog, KVCacheManager, Request
    from kvlab.core.sched.scheduler import Scheduler
    from kvlab.engine.llm_engine import LLMEngine
    from kvlab.worker.model import TinyLlama
    from kvlab.worker.model_runner import ModelRunner
    from kvlab.worker.tokenizer import ByteTokenizer

    torch.set_num_threads(1)
    tok, model, log = ByteTokenizer(), TinyLlama(seed=0), EventLog()
    mgr = KVCacheManager(num_blocks=11, block_size=4, event_log=log)
    engine = LLMEngine(mgr, Scheduler(mgr), ModelRunner(model, num_blocks=11, block_size=4, event_log=log), tokenizer=tok)
    engine.add_request(Request("r0", tok.encode("Paged KV!!"), max_tokens=6))
    engine.step()
    engine.add_request(Request("r1", tok.encode("blocks"), max_tokens=4))
    engine.run()
    return log
