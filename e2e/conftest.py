"""JupyterLab in a real browser: a throwaway copy of the course, a lab server, headless Chromium.

- The server runs from the project's environment (the ``jupyter`` next to this Python) on a
  free loopback port, serving a temporary copy of ``notebooks/`` and ``solutions/``; its
  config, data, runtime, settings and workspace folders are temporary too, so nothing of
  the learner's (files, settings, other kernels) is read or written.
- The browser is Chromium driven by Playwright: ``$COURSE_CHROMIUM``, else the system's
  ``chromium`` (Debian's package), else Playwright's own download if there is one. With
  none, the tests are skipped with the reason, or fail when ``COURSE_E2E_REQUIRED=1``
  (CI sets it).
- One page per worker (``lab_page``) holds the lab: the first notebook loads it, each later one is opened in it as
  a learner opens the next notebook, after the one before is closed and its kernel shut down (loading the lab is
  most of what the browser does per notebook).
- Screenshots go to ``artifacts/e2e/`` (git ignores ``artifacts/``).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "artifacts" / "e2e"
COURSE_FOLDERS = ("notebooks", "solutions")
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
JUPYTER = Path(sys.executable).parent / "jupyter"
NO_JUPYTER = f"no jupyter next to {sys.executable}: run `make setup` first"
# JupyterLab settings for the throwaway profile: no news or update checks (no network here),
# every cell kept in the page (no windowing), no autosave of the copies.
LAB_SETTINGS = {
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings":
        {"fetchNews": "false", "checkForUpdates": False},
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
}


# What a test run adds to the environment that `make lab` would not: the course's own switches
# (COURSE_STRICT, COURSE_E2E_REQUIRED, ...), TRITON_INTERPRET (the course decides it itself, in
# helpers/triton_mode.py) and pytest's own variables. The lab gets none of them.
NOT_FROM_MAKE_LAB = ("COURSE_", "TRITON_INTERPRET", "PYTEST_")


def lab_env(environ) -> dict:
    """The environment `make lab` gives JupyterLab: the caller's, less what only a test run sets, plus the
    Makefile's one export (PYTHONPATH = the course folder)."""
    env = {k: v for k, v in environ.items() if not k.startswith(NOT_FROM_MAKE_LAB)}
    env["PYTHONPATH"] = str(ROOT)
    return env


def _unavailable(reason: str):
    if os.environ.get("COURSE_E2E_REQUIRED") == "1":
        pytest.fail(f"end-to-end tests required (COURSE_E2E_REQUIRED=1) but {reason}", pytrace=False)
    pytest.skip(reason)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tree_sha(folder: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("*.ipynb"))}


@dataclass
class Lab:
    base: str        # http://127.0.0.1:<port>
    token: str
    root: Path       # the throwaway copy the server serves
    log: Path
    _shutdowns: list = field(default_factory=list)    # kernel shutdowns still under way

    def url(self, notebook: str) -> str:
        """The lab at ``notebook`` in a fresh workspace, so no earlier tab (and kernel) is restored."""
        return f"{self.base}/lab/workspaces/e2e-{uuid.uuid4().hex[:8]}/tree/{notebook}?token={self.token}"

    def api(self, path: str, method: str = "GET"):
        req = urllib.request.Request(f"{self.base}/api/{path}", method=method,
                                     headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=30) as r:
            body = r.read()
        return json.loads(body) if body else None

    def shut_down_kernels(self, wait: bool = True):
        """Shut every kernel of the lab down; ``wait=False``: in a thread, joined by ``wait_for_shutdowns``."""
        for session in self.api("sessions"):
            if wait:
                self.api(f"sessions/{session['id']}", method="DELETE")
            else:
                thread = threading.Thread(target=self._delete_quietly, args=(f"sessions/{session['id']}",))
                thread.start()
                self._shutdowns.append(thread)

    def _delete_quietly(self, path: str):
        try:
            self.api(path, method="DELETE")
        except (urllib.error.URLError, OSError):
            pass          # the server is gone, and its kernels with it

    def wait_for_shutdowns(self):
        for thread in self._shutdowns:
            thread.join(timeout=60)
        self._shutdowns.clear()

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


# The learner's and the worked notebooks as they were before any test ran (read as pytest collects e2e/).
_ORIGINALS = {f: _tree_sha(ROOT / f) for f in COURSE_FOLDERS}


@pytest.fixture(scope="session")
def originals():
    return _ORIGINALS


@pytest.fixture(scope="session")
def lab(tmp_path_factory, originals):
    if not JUPYTER.exists():
        _unavailable(NO_JUPYTER)
    tmp = tmp_path_factory.mktemp("lab")
    root = tmp / "course"
    for folder in COURSE_FOLDERS:
        shutil.copytree(ROOT / folder, root / folder,
                        ignore=shutil.ignore_patterns(".ipynb_checkpoints", "*.backup-*"))
    for rel, value in LAB_SETTINGS.items():
        path = tmp / "settings" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(value))
    env = dict(lab_env(os.environ),
               JUPYTER_CONFIG_DIR=str(tmp / "config"), JUPYTER_DATA_DIR=str(tmp / "data"),
               JUPYTER_RUNTIME_DIR=str(tmp / "runtime"), JUPYTERLAB_SETTINGS_DIR=str(tmp / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp / "workspaces"))
    port, token = _free_port(), uuid.uuid4().hex
    cmd = [str(JUPYTER), "lab", "--no-browser", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
           "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
           f"--ServerApp.root_dir={root}", "--LabApp.expose_app_in_browser=True",
           "--LabApp.extension_manager=readonly", "--ServerApp.terminals_enabled=False"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")               # CI containers run as root
    log = tmp / "lab.log"
    server = subprocess.Popen(cmd, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=root)
    the_lab = Lab(f"http://127.0.0.1:{port}", token, root, log)
    deadline = time.monotonic() + 120
    while True:
        try:
            the_lab.api("status")
            break
        except (urllib.error.URLError, ConnectionError, OSError):
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                pytest.fail(f"JupyterLab did not start:\n{the_lab.log_tail()}", pytrace=False)
            time.sleep(0.5)
    yield the_lab
    the_lab.wait_for_shutdowns()
    server.terminate()
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()


def _chromium_path() -> str | None:
    for candidate in (os.environ.get("COURSE_CHROMIUM"), shutil.which("chromium"),
                      shutil.which("chromium-browser")):
        if candidate and Path(candidate).exists():
            return candidate
    return None


def _launch(playwright):
    """Chromium: ``$COURSE_CHROMIUM``, else the system's, else Playwright's download."""
    path = _chromium_path()
    return playwright.chromium.launch(executable_path=path, args=CHROMIUM_FLAGS) if path else \
        playwright.chromium.launch(args=CHROMIUM_FLAGS)


def _no_chromium(error: Exception) -> str:
    return ("no Chromium found (Debian: `apt-get install chromium`; or set COURSE_CHROMIUM): "
            + str(error).splitlines()[0])


NO_PLAYWRIGHT = "Playwright is not installed: run `make setup`"


def why_no_lab() -> str | None:
    """Why the lab tests cannot run here (None: they can): the look-up the ``lab`` and ``browser`` fixtures make, a
    JupyterLab next to this Python, Playwright, a Chromium that starts."""
    if not JUPYTER.exists():
        return NO_JUPYTER
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return NO_PLAYWRIGHT
    with sync_playwright() as p:
        try:
            _launch(p).close()
        except Exception as e:                      # no browser at all
            return _no_chromium(e)
    return None


@pytest.fixture(scope="session")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable(NO_PLAYWRIGHT)
    with sync_playwright() as p:
        try:
            b = _launch(p)
        except Exception as e:                      # no browser at all
            _unavailable(_no_chromium(e))
        yield b
        b.close()


PANEL = "window.jupyterapp.shell.currentWidget"      # the notebook in front
VIEWPORT = {"width": 1400, "height": 1000}
_KERNEL_IDLE = f"""() => {{
    const panel = {PANEL};
    const kernel = panel && panel.sessionContext && panel.sessionContext.session
                   && panel.sessionContext.session.kernel;
    return !!kernel && kernel.status === 'idle';
}}"""
# the documents open in the main area (a launcher the lab opens when the area is empty is none)
_DOCUMENTS = "() => [...window.jupyterapp.shell.widgets('main')].filter(w => w.context).map(w => w.context.path)"


class LabPage:
    """The worker's page with the lab in it: ``open`` a notebook in it as a learner does."""

    def __init__(self, lab: Lab, browser):
        self.lab, self.browser = lab, browser
        self.page = None
        self.errors: list[str] = []     # JavaScript errors raised in the page since the last open

    def open(self, notebook: str):
        """``notebook`` (a path in the lab's copy) in front, the only document, its kernel started and idle.
        The first one loads the lab at it; each later one is opened by the lab's own command (File > Open) once
        the documents before are closed. Returns the page."""
        if self.page is None:
            self.page = self.browser.new_page(viewport=VIEWPORT)
            self.page.on("pageerror", lambda e: self.errors.append(str(e)))
            self.errors.clear()
            self.page.goto(self.lab.url(notebook))
        else:
            self._close_documents()
            self.errors.clear()
            self.page.evaluate("async path => { await window.jupyterapp.commands.execute('docmanager:open', {path}); }",
                               notebook)
        # the app object appears some time after the page's load event: test for it before using it
        self.page.wait_for_function(f"path => !!(window.jupyterapp && {PANEL} && {PANEL}.sessionContext"
                                    f" && {PANEL}.context.path === path)", arg=notebook, timeout=120_000)
        self.page.evaluate(f"async () => {{ await {PANEL}.context.ready; await {PANEL}.sessionContext.ready; }}")
        self.page.wait_for_function(_KERNEL_IDLE, timeout=120_000)
        documents = self.page.evaluate(_DOCUMENTS)
        assert documents == [notebook], f"the lab shows {documents}, not only {notebook}"
        return self.page

    @contextlib.contextmanager
    def closed_on_error(self):
        """For a with-block: an exception in it closes the page (its state is unknown then), so that the next
        notebook loads the lab afresh."""
        try:
            yield
        except BaseException:
            with contextlib.suppress(Exception):     # the test's own error is the one to report
                self.discard()
            raise

    def _close_documents(self):
        """Close every document as it is (the copies are throwaway: no save, no prompt) and shut their kernels
        down, in the background."""
        self.page.evaluate("""() => { for (const w of [...window.jupyterapp.shell.widgets('main')]) {
            if (w.context) { w.context.model.dirty = false; }
            w.dispose();
        } }""")
        self.lab.shut_down_kernels(wait=False)

    def discard(self):
        if self.page is not None:
            self.page.close()
            self.page = None
        self.lab.shut_down_kernels()


@pytest.fixture(scope="session")
def lab_page(lab, browser):
    """One page per worker, kept from notebook to notebook (loading the lab is most of what the browser does)."""
    the_page = LabPage(lab, browser)
    yield the_page
    the_page.discard()


@pytest.fixture(scope="session")
def artifacts():
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS


if __name__ == "__main__":
    # `make check` asks once whether the lab tests run here: "1" if so (the learner copies then run there only),
    # else nothing, and why on stderr.
    reason = why_no_lab()
    if reason:
        print(f"e2e cannot run the learner notebooks here ({reason}): nbval runs them", file=sys.stderr)
    else:
        print(1)
