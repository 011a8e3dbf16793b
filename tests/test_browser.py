"""The course as a learner meets it: JupyterLab started by `make lab`, driven in Debian's Chromium.

Screenshots go to test-artifacts/. Skipped, with the reason, where Chromium is not installed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request

import nbformat
import pytest

from common import ROOT

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [pytest.mark.slow, pytest.mark.browser, pytest.mark.skipif(
    CHROMIUM is None, reason="needs Chromium, which is not installed: `make chromium` installs it (Debian: apt-get "
                             "install chromium)")]
ARTIFACTS = ROOT / "test-artifacts"
TOKEN = "cs336-browser-test"
# Flags for a headless Chromium on a machine with no network beyond localhost.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-sync",
                 "--disable-background-networking", "--disable-component-update"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """The README's `make lab`, serving a scratch copy of notebooks/ (plus solved copies) on a free port."""
    root = tmp_path_factory.mktemp("lab")
    served, settings = root / "notebooks", root / "settings"
    shutil.copytree(ROOT / "notebooks", served)
    for source in (ROOT / "grading" / "source").glob("*/*.ipynb"):
        shutil.copy(source, served / f"{source.stem}_solved.ipynb")
    # Render every cell (JupyterLab 4 only renders the visible ones by default), so the test sees all outputs.
    tracker = settings / "@jupyterlab" / "notebook-extension" / "tracker.jupyterlab-settings"
    tracker.parent.mkdir(parents=True)
    tracker.write_text(json.dumps({"windowingMode": "none"}))
    port = free_port()
    args = (f"--port={port} --IdentityProvider.token={TOKEN} --LabApp.user_settings_dir={settings} "
            f"--LabApp.workspaces_dir={root / 'workspaces'}")
    server = subprocess.Popen(["make", "--no-print-directory", "lab", f"NOTEBOOKS={served}", f"ARGS={args}"],
                              cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180  # JupyterLab's first start builds its settings: slow on a busy machine
    while True:
        try:
            urllib.request.urlopen(f"{url}/api/status?token={TOKEN}", timeout=2)
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"`make lab` did not serve {url} (exit code {server.poll()})")
            time.sleep(0.5)
    yield url, served
    os.killpg(server.pid, signal.SIGTERM)
    server.wait(timeout=30)


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture
def open_notebook(lab, browser, request):
    """Open a notebook in JupyterLab; a screenshot of the page is saved when the test ends."""
    url, _ = lab
    pages = []

    def open_(name: str):
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        workspace = f"{request.node.name[:40]}-{len(pages)}"  # a fresh workspace: no tabs from other tests
        page.goto(f"{url}/lab/workspaces/{workspace}/tree/{name}?reset&token={TOKEN}")
        page.wait_for_function("() => document.querySelector('.jp-StatusBar-Widget')?.innerText.includes('| Idle')",
                               timeout=90_000)  # the kernel has started
        pages.append(page)
        return page

    yield open_
    ARTIFACTS.mkdir(exist_ok=True)
    for i, page in enumerate(pages):
        page.screenshot(path=ARTIFACTS / f"{request.node.name}-{i}.png", full_page=True)
        page.close()


def write_notebook(path, cells: list[str]) -> None:
    """A notebook of code cells on the course's kernel."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nb.metadata["kernelspec"] = {"name": "cs336-parallel", "display_name": "Python 3 (cs336-parallel)",
                                 "language": "python"}
    nbformat.write(nb, path)


def start_run_all(page) -> None:
    """Run > Run All Cells; returns once the first cell has run."""
    page.locator(".lm-MenuBar-itemLabel", has_text="Run").click()
    page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
    page.wait_for_function("() => /\\d/.test(document.querySelector('.jp-CodeCell .jp-InputPrompt').textContent)",
                           timeout=60_000)


def wait_until_done(page, timeout_s: float = 150) -> None:
    """Until the kernel is idle and no cell waits to run."""
    page.wait_for_function("""() => {
        const idle = document.querySelector('.jp-StatusBar-Widget')?.innerText.includes('| Idle');
        const queued = [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')]
            .some(p => p.textContent.includes('*'));
        return idle && !queued;
    }""", timeout=timeout_s * 1000, polling=500)


def run_all(page, timeout_s: float = 150) -> None:
    start_run_all(page)
    wait_until_done(page, timeout_s)


NOTEBOOK = ".jp-NotebookPanel:visible"  # the notebook on screen


def outputs(page) -> str:
    return "\n".join(page.locator(f"{NOTEBOOK} .jp-OutputArea-output").all_inner_texts())


def test_a_blank_notebook_runs_up_to_the_first_exercise_with_rank_output_and_a_plot(open_notebook):
    page = open_notebook("00_setup.ipynb")
    run_all(page)
    text = outputs(page)
    for rank in range(4):
        assert f"[rank {rank}] I am rank {rank} of 4" in text  # grouped per-rank output, in the cell
    assert page.locator(f"{NOTEBOOK} .jp-OutputArea-output img").count() >= 1  # the hierarchy chart
    assert "`shard_range` is not implemented yet" in text  # Run All stops at its first test, and says why


def test_the_collectives_notebook_shows_every_collective_per_rank(open_notebook):
    page = open_notebook("01_collectives.ipynb")
    run_all(page)
    text = outputs(page)
    assert "[rank 3] all_to_all" in text and "[rank 0] broadcast" in text
    assert page.locator(f"{NOTEBOOK} .jp-OutputArea-output img").count() >= 2  # the gallery, the ring steps
    assert "`ring_reduce_scatter` is not implemented yet" in text


def test_a_solved_notebook_runs_top_to_bottom_without_errors(open_notebook):
    page = open_notebook("01_collectives_solved.ipynb")
    run_all(page)
    prompts = page.locator(f"{NOTEBOOK} .jp-CodeCell .jp-InputPrompt").all_inner_texts()
    assert prompts and all(p.strip().startswith("[") and p.strip()[1:-2].isdigit() for p in prompts), prompts
    stderr = page.locator(f"{NOTEBOOK} .jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
    assert stderr.count() == 0
    assert "ring_all_reduce: ok" in outputs(page) and page.locator(f"{NOTEBOOK} .jp-OutputArea-output img").count() >= 4


def test_interrupting_a_hung_cell_stops_the_ranks_and_the_next_cell_runs(lab, open_notebook):
    _, served = lab
    cells = ["%load_ext cs336_parallel\n%cluster start -n 2",
             "%%ranks --timeout 600\nprint('stuck', rank, flush=True)\nif rank == 0:\n"
             "    dist.barrier()  # rank 1 never comes\nwhile True:\n    pass",
             "%%ranks\nprint('alive', rank)"]
    write_notebook(served / "hang.ipynb", cells)
    page = open_notebook("hang.ipynb")
    start_run_all(page)
    page.wait_for_function("() => ['[rank 0] stuck 0', '[rank 1] stuck 1'].every(line => "
                           "document.body.innerText.includes(line))", timeout=120_000)  # stuck on the ranks
    page.locator(".lm-MenuBar-itemLabel", has_text="Kernel").click()
    page.locator(".lm-Menu-item[data-command='kernelmenu:interrupt']").click()
    wait_until_done(page, timeout_s=120)
    text = outputs(page)
    assert "KeyboardInterrupt: stopped ranks 0, 1 and restarted the cluster" in text and "dist.barrier()" in text
    assert "cluster.py" not in text  # the ranks' stacks, not the launcher's
    page.locator(f"{NOTEBOOK} .jp-CodeCell").nth(2).click()
    page.keyboard.press("Shift+Enter")
    page.wait_for_function("() => document.body.innerText.includes('[rank 1] alive 1')", timeout=60_000)
    assert "[rank 0] alive 0" in outputs(page)


def test_moving_a_slider_redraws_the_pipeline_explorer(lab, open_notebook):
    _, served = lab
    cells = ["from cs336_parallel.notebook import load_definitions\n"
             "from cs336_parallel.widgets import ScheduleExplorer\n"
             "solved = load_definitions('05_pipeline_schedules_solved.ipynb')",
             "ScheduleExplorer({'1F1B': solved['one_f_one_b_schedule'], 'GPipe': solved['gpipe_schedule']})"]
    write_notebook(served / "explorer.ipynb", cells)
    page = open_notebook("explorer.ipynb")
    run_all(page)
    picture = page.locator(f"{NOTEBOOK} .jupyter-widgets img").first
    picture.wait_for(timeout=60_000)
    summary = page.locator(f"{NOTEBOOK} .widget-html").first
    before_picture, before_summary = picture.get_attribute("src"), summary.inner_text()
    assert "bubble" in before_summary
    handle = page.locator(f"{NOTEBOOK} .widget-slider").nth(1).locator(".noUi-handle")  # micro-batches m
    handle.focus()
    for _ in range(4):
        page.keyboard.press("ArrowRight")
    page.wait_for_function("([sel, old]) => document.querySelector(sel)?.innerText !== old",
                           arg=[".jp-NotebookPanel:not(.lm-mod-hidden) .widget-html", before_summary],
                           timeout=30_000)
    page.wait_for_function("([sel, old]) => document.querySelector(sel)?.getAttribute('src') !== old",
                           arg=[".jp-NotebookPanel:not(.lm-mod-hidden) .jupyter-widgets img", before_picture],
                           timeout=30_000)
    assert summary.inner_text() != before_summary  # the bubble fraction follows m
