"""tools/jupyter_lab_config.py, the configuration `make lab` starts JupyterLab with: running a lesson and saving it
leaves the checkout as git has it, and work/ stays writable (issue 46: lessons never dirty the repository)."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.error
import urllib.request

import pytest
from test_browser import NOTEBOOK_MS, lab_page, open_and_start_run_all

from conftest import ROOT, running_lab

pytestmark = [pytest.mark.browser, pytest.mark.timeout(900)]
LESSON = "notebooks/00_welcome.ipynb"


@pytest.fixture
def course_lab(tmp_path):
    """A git checkout of the lessons with a work/ folder, served by JupyterLab with the course's configuration."""
    course = tmp_path / "course"
    shutil.copytree(ROOT / "notebooks", course / "notebooks")
    (course / "work").mkdir()
    shutil.copy(ROOT / ".gitignore", course / ".gitignore")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(course)]
    for command in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "lessons"]):
        subprocess.run(git + command, check=True, capture_output=True)
    with running_lab(course, tmp_path, f"--config={ROOT / 'tools' / 'jupyter_lab_config.py'}") as url:
        yield url, course, git


def _put(url: str, path: str, model: dict) -> int:
    request = urllib.request.Request(f"{url}/api/contents/{path}", data=json.dumps(model).encode(), method="PUT",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status
    except urllib.error.HTTPError as error:
        return error.code


def test_the_server_keeps_lessons_read_only_and_work_writable(course_lab):
    url, course, git = course_lab
    with urllib.request.urlopen(f"{url}/api/contents/{LESSON}", timeout=30) as reply:
        model = json.load(reply)
    assert model["writable"] is False
    assert _put(url, LESSON, {"type": "notebook", "content": model["content"]}) == 403
    assert _put(url, "notebooks/mine.ipynb", {"type": "notebook", "content": model["content"]}) == 403
    assert _put(url, "work/00_welcome.ipynb", {"type": "notebook", "content": model["content"]}) == 201
    assert subprocess.run(git + ["status", "--porcelain"], capture_output=True, text=True).stdout == ""


def test_running_and_saving_a_lesson_leaves_git_status_clean(course_lab, artifacts_dir):
    url, course, git = course_lab
    before = (course / LESSON).read_bytes()
    with lab_page(artifacts_dir, "lessons_read_only") as (sync_api, page):
        open_and_start_run_all(page, url, LESSON)
        page.locator(".jp-Notebook-ExecutionIndicator[data-status='busy']").or_(
            page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']")).first.wait_for()
        page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").first.wait_for(timeout=NOTEBOOK_MS)
        page.locator(".jp-Notebook").click()
        page.keyboard.press("Control+s")  # a save now, rather than waiting out the two-minute autosave
        page.wait_for_timeout(3000)
        status = subprocess.run(git + ["status", "--porcelain"], capture_output=True, text=True).stdout
        assert status == "" and (course / LESSON).read_bytes() == before, status
