"""Shared test set-up: Jupyter, IPython and matplotlib write to a throw-away HOME."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

if not os.environ.get("GPIPE_TEST_HOME"):
    # `make test` already points these at a temp dir; a bare `pytest` gets one here.
    _home = tempfile.mkdtemp(prefix="gpipe-test-home-")
    os.environ.update(
        GPIPE_TEST_HOME=_home, HOME=_home, MPLCONFIGDIR=f"{_home}/matplotlib",
        IPYTHONDIR=f"{_home}/ipython", JUPYTER_CONFIG_DIR=f"{_home}/jupyter/config",
        JUPYTER_DATA_DIR=f"{_home}/jupyter/data", JUPYTER_RUNTIME_DIR=f"{_home}/jupyter/runtime",
    )


@pytest.fixture(autouse=True)
def cpu_unless_marked_gpu(request, monkeypatch):
    """The suite's tests hold on any machine: a test about CPU behaviour keeps the course's default devices (and
    launch's default backend, in its ranks too) on the CPU with GPIPE_DEVICE=cpu, also on a GPU machine; a test
    that expects a GPU is marked ``gpu`` and sees the machine as it is."""
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setenv("GPIPE_DEVICE", "cpu")
    else:
        monkeypatch.delenv("GPIPE_DEVICE", raising=False)


@pytest.fixture
def artifacts_dir() -> Path:
    """Where tests leave files for a person to look at (screenshots, traces)."""
    path = ROOT / "test-artifacts"
    path.mkdir(exist_ok=True)
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def lab_server(tmp_path_factory):
    """One JupyterLab server for every browser test (starting one costs seconds): a free loopback port, a copy of
    the notebooks, a temp HOME. Tests ask for ``jupyter_lab`` (tests/test_browser.py), which ends their kernels."""
    base = tmp_path_factory.mktemp("lab")
    root = base / "course"
    shutil.copytree(ROOT / "notebooks", root)
    with running_lab(root, base) as url:
        yield url


@contextlib.contextmanager
def running_lab(root: Path, base: Path, *options: str):
    """JupyterLab serving ``root`` on a free loopback port, with no token, a HOME under ``base`` and ``options``;
    yields its URL and stops it (and its kernels) afterwards."""
    home = base / "home"
    env = dict(os.environ, HOME=str(home), JUPYTER_CONFIG_DIR=str(home / "jc"), JUPYTER_DATA_DIR=str(home / "jd"),
               JUPYTER_RUNTIME_DIR=str(home / "jr"), IPYTHONDIR=str(home / "ipython"),
               MPLCONFIGDIR=str(home / "mpl"), PYTHONPATH=str(ROOT))
    port = _free_port()
    log = open(base / "lab.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}", *options,
         "--IdentityProvider.token=", "--ServerApp.password=", "--ServerApp.disable_check_xsrf=True",
         f"--ServerApp.root_dir={root}", *(["--allow-root"] if os.geteuid() == 0 else [])],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/status", timeout=2)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("JupyterLab did not start:\n" + (base / "lab.log").read_text()[-3000:])
                time.sleep(0.5)
        yield url
    finally:
        _stop(server)
        log.close()


def _stop(server: subprocess.Popen) -> None:
    """End the server and the kernels it started (its whole process group)."""
    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(server.pid, sig)
        except ProcessLookupError:
            return
        try:
            server.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def needs_site_extra() -> None:
    """Skip, naming the reason, where the site extra (Sphinx, myst-nb) is not installed: the GPU check's machines
    carry only what the course's lessons and tests need (tools/gpu_wheels.txt)."""
    for module in ("sphinx", "myst_nb"):
        pytest.importorskip(module, reason=f"{module} is not installed: building the site needs the site extra "
                                           f"(pip install -e '.[site]'; make test installs it)")


@pytest.fixture(scope="session")
def built_site(tmp_path_factory) -> Path:
    """The course website built afresh from this checkout (tools/build_site.py, as `make site` runs it), once per
    session: the folder of HTML, for tests/test_site.py and tests/test_browser_site.py. CI builds it with
    `make site` just before the tests and names it in GPIPE_SITE_DIR, which is then used as it is."""
    if os.environ.get("GPIPE_SITE_DIR"):
        site = Path(os.environ["GPIPE_SITE_DIR"])
        assert (site / "index.html").is_file(), f"GPIPE_SITE_DIR={site} holds no built site (make site)"
        return site
    needs_site_extra()
    build = tmp_path_factory.mktemp("site")
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "build_site.py"), "--build-dir", str(build)],
                            capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, f"the site did not build:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return build / "html"
