"""A learner's set-up: the Makefile's choices, the PyTorch the course needs, GPUs too few for NCCL, a
release that keeps a learner's work, and the hosted (Colab, Kaggle) install from each notebook's first cell."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import nbformat
import pytest
from jupyter_client.manager import start_new_kernel
from nbclient import NotebookClient

from common import ROOT
from cs336_parallel import versions
from cs336_parallel.magics import cpu_fallback_note
from grading import gradebook

PYPROJECT = (ROOT / "pyproject.toml").read_text()


# -- the Makefile --------------------------------------------------------------------------------------------

def dry_run(*args: str, tmp_path: Path) -> str:
    """The commands `make` would run for a fresh environment in tmp_path (nothing is run)."""
    venv_dir = tmp_path / "venv"
    # Not the variables of a make that runs this suite (`make test-latest` passes LATEST=1 down, in MAKEFLAGS and
    # in the environment).
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "LATEST")}
    done = subprocess.run(["make", "-n", *args, f"VENV={venv_dir}"], cwd=ROOT, capture_output=True, text=True,
                          env=env)
    assert done.returncode == 0, done.stderr
    return done.stdout.replace("\\\n", " ")  # a command continued over several lines, as one line


def installs(*args: str, tmp_path: Path) -> list[str]:
    return [line for line in dry_run(*args, tmp_path=tmp_path).splitlines() if "pip install" in line]


def test_make_lab_installs_the_course_without_the_test_tools_at_the_locks_versions(tmp_path):
    lines = installs("lab", tmp_path=tmp_path)
    assert len(lines) == 1 and "'.[course]'" in lines[0] and "download.pytorch.org" not in lines[0]
    assert "-c requirements/lock.txt" in lines[0]


def test_make_test_adds_the_test_tools_at_the_locks_versions(tmp_path):
    lines = installs("test", tmp_path=tmp_path)
    assert [("'.[course]'" in line, "'.[course,test]'" in line) for line in lines] == [(True, False), (False, True)]
    assert all("-c requirements/lock.txt" in line for line in lines)


def test_make_grade_uses_the_lock_too(tmp_path):
    lines = installs("grade", "NOTEBOOK=notebooks/00_setup.ipynb", tmp_path=tmp_path)
    assert len(lines) == 1 and "-c requirements/lock.txt" in lines[0]


def test_the_install_compiles_the_package_once_for_the_sandboxes_that_read_it_read_only(tmp_path):
    lines = dry_run("lab", tmp_path=tmp_path).splitlines()
    assert any("-m compileall -q cs336_parallel" in line for line in lines), lines


def test_torch_cpu_selects_pytorchs_cpu_wheel_index_with_the_same_lock(tmp_path):
    """The CPU index's torch 2.13.0+cpu satisfies the lock's torch==2.13.0 (a local version label), and needs
    none of the CUDA packages the lock lists for PyPI's build: constraints pin them, they do not install them."""
    lines = installs("lab", "TORCH=cpu", tmp_path=tmp_path)
    assert len(lines) == 1 and "--extra-index-url https://download.pytorch.org/whl/cpu" in lines[0]
    assert "-c requirements/lock.txt" in lines[0]


def test_make_lock_regenerates_the_lock_for_every_platform_from_pyproject_and_the_pins(tmp_path):
    compile_line = next(line for line in dry_run("lock", tmp_path=tmp_path).splitlines() if "pip compile" in line)
    for part in ("pyproject.toml", "--universal", "--extra course", "--extra test", "-c requirements/pins.txt",
                 "--upgrade", "-o requirements/lock.txt"):
        assert part in compile_line, (part, compile_line)
    one = next(line for line in dry_run("lock", "PACKAGE=cloudpickle", tmp_path=tmp_path).splitlines()
               if "pip compile" in line)
    assert "--upgrade-package cloudpickle" in one and "--upgrade " not in one


def test_make_test_latest_is_its_own_target_and_environment(tmp_path):
    assert "test_latest.py" in dry_run("test-latest", tmp_path=tmp_path)
    assert "test_latest.py" not in dry_run("test", tmp_path=tmp_path)
    lines = installs("test", "LATEST=1", tmp_path=tmp_path)
    assert all("-c requirements/pins.txt --upgrade" in line and "lock.txt" not in line for line in lines), lines


def test_an_old_python_is_told_what_to_install(tmp_path):
    fake = tmp_path / "python3.9"  # reports Python 3.9.1, runs `-c CODE` otherwise as the real one does
    fake.write_text(f"#!{sys.executable}\nimport sys\nsys.version_info = (3, 9, 1, 'final', 0)\n"
                    "sys.version = '3.9.1 (fake)'\nexec(sys.argv[2])\n")
    fake.chmod(0o755)
    venv_dir = tmp_path / "venv"
    done = subprocess.run(["make", f"{venv_dir}/.installed", f"VENV={venv_dir}", f"PYTHON={fake}"], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode != 0 and not venv_dir.exists()
    assert f"cs336-parallel needs Python 3.10 or newer, as PyTorch 2.13 does; {fake} is Python 3.9.1." in done.stderr
    assert "make lab PYTHON=python3.10" in done.stderr


# -- the PyTorch the course needs ------------------------------------------------------------------------------

def test_the_torch_needed_is_pyprojects_lower_bound_and_the_lock_holds_it():
    bound = re.search(r'"torch>=(\d+)\.(\d+)"', PYPROJECT)
    assert bound and versions.TORCH_NEEDED == (int(bound.group(1)), int(bound.group(2)))
    needed = ".".join(map(str, versions.TORCH_NEEDED))
    assert f"torch=={needed}." in (ROOT / "requirements" / "pins.txt").read_text()
    assert re.search(rf"^torch=={re.escape(needed)}\.\d+$", (ROOT / "requirements" / "lock.txt").read_text(), re.M)


@pytest.mark.parametrize("version", ["2.13.0", "2.13.0+cpu", "2.14.0a0+git1234abc", "3.0.0"])
def test_torch_2_13_or_newer_passes(version):
    versions.check_torch(version)


@pytest.mark.parametrize("version", ["2.12.1", "2.4.0+cu121", "1.13.1"])
def test_an_older_torch_is_one_clear_error_naming_the_version_needed(version):
    with pytest.raises(versions.SetupError) as info:
        versions.check_torch(version)
    message = str(info.value)
    assert "needs PyTorch 2.13 or newer" in message and f"this kernel has torch {version}" in message
    assert "%pip install torch==2.13.0" in message and "\n" not in message


def test_no_torch_at_all_says_what_to_install(monkeypatch):
    monkeypatch.setattr(versions, "torch_version", lambda: None)
    with pytest.raises(versions.SetupError, match=r"has none: %pip install torch==2\.13\.0"):
        versions.check_torch()


def test_load_ext_with_an_old_torch_fails_in_one_line(tmp_path):
    """A kernel whose torch metadata says 2.4.1 (a dist-info ahead of the real one on sys.path)."""
    info = tmp_path / "torch-2.4.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.4.1\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    km, kc = start_new_kernel(kernel_name="python3", env=env, stderr=subprocess.DEVNULL)
    try:
        reply = kc.execute_interactive("%load_ext cs336_parallel", timeout=60)["content"]
        assert reply["status"] == "error" and reply["ename"] == "SetupError"
        lines = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in reply["traceback"]]
        assert len(lines) == 1 and "needs PyTorch 2.13 or newer" in lines[0] and "torch 2.4.1" in lines[0]
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


# -- GPUs too few for NCCL -------------------------------------------------------------------------------------

def test_one_gpu_and_four_ranks_says_why_the_ranks_run_on_the_cpu():
    assert cpu_fallback_note(4, "gloo", 1) == (
        "4 ranks on CPU (gloo): this machine has 1 GPU; NCCL needs one GPU per rank")
    assert cpu_fallback_note(8, "gloo", 4).endswith("this machine has 4 GPUs; NCCL needs one GPU per rank")
    assert cpu_fallback_note(4, "gloo", 0) is None  # a CPU machine: nothing to explain
    assert cpu_fallback_note(4, "nccl", 4) is None


# -- the release keeps a learner's work ------------------------------------------------------------------------

def test_make_notebooks_keeps_a_notebook_with_changes(tmp_path):
    name = "00_setup"
    shutil.copytree(gradebook.COURSE / "source" / name, tmp_path / "source" / name)
    into = tmp_path / "notebooks"
    target = into / f"{name}.ipynb"
    gradebook.release(tmp_path, into, [name])
    master = tmp_path / "source" / name / f"{name}.ipynb"
    master.write_text(master.read_text().replace("Setup: the machine", "Setup: this machine"))
    gradebook.release(tmp_path, into, [name])  # an instructor's second release: it replaces the first one
    assert "Setup: this machine" in target.read_text()
    learner = target.read_text().replace("# YOUR CODE HERE", "return 0, n  # my answer")
    target.write_text(learner)
    with pytest.raises(gradebook.LearnerChanges) as info:
        gradebook.release(tmp_path, into, [name])
    assert target.read_text() == learner and info.value.kept == [target]
    assert "has changes that the release would overwrite" in str(info.value) and "FORCE=1" in str(info.value)
    gradebook.release(tmp_path, into, [name], force=True)
    assert "my answer" not in target.read_text()


# -- hosted notebooks: one pip install from the repository -----------------------------------------------------

def hosted_command() -> str:
    """The install line every notebook's first cell gives (pyproject's Repository URL, the `hosted` extra)."""
    url = re.search(r'^Repository = "(.+)"$', PYPROJECT, re.M).group(1)
    return f'%pip install "cs336-parallel[hosted] @ git+{url}"'


@pytest.mark.parametrize("name", gradebook.assignments())
def test_each_notebooks_first_cell_says_how_to_install_on_colab_or_kaggle(name):
    for path in (gradebook.COURSE / "source" / name / f"{name}.ipynb", ROOT / "notebooks" / f"{name}.ipynb"):
        first = next(c for c in nbformat.read(path, 4).cells if c.cell_type == "code")
        lines = first.source.splitlines()
        assert lines[:2] == ["# On Colab or Kaggle, run this first, in a new cell above this one:",
                             f"# {hosted_command()}"], f"{path}: first code cell"
        assert "%load_ext cs336_parallel" in lines


def test_the_readme_gives_the_same_hosted_install():
    assert hosted_command().removeprefix("%") in (ROOT / "README.md").read_text()


def test_the_hosted_install_asks_only_for_lower_bounds():
    """The hosted extra and the core keep what a host has where it is new enough: no exact pins."""
    tomllib = pytest.importorskip("tomllib", reason="Python 3.10's standard library reads no TOML")
    project = tomllib.loads(PYPROJECT)["project"]
    for requirement in [*project["dependencies"], *project["optional-dependencies"]["hosted"]]:
        assert "==" not in requirement and "<" not in requirement, requirement


HOST = ("torch==2.13.0", "ipykernel==6.29.5")  # what a hosted Jupyter has before the notebook's first cell


@pytest.mark.slow
@pytest.mark.network  # downloads the host's PyTorch and Jupyter, and the package's dependencies
@pytest.mark.timeout(900)
def test_a_notebook_runs_on_a_host_after_the_hosted_install_which_keeps_the_hosts_torch_and_jupyter(tmp_path,
                                                                                                    monkeypatch):
    """A fresh virtual environment with a host's own PyTorch and Jupyter kernel (as Colab has them); then the
    notebooks' pip command, with this checkout in place of the repository's URL (same form:
    `cs336-parallel[hosted] @ URL`); then notebook 00 (master) top to bottom. The host's versions stay."""
    env_dir = tmp_path / "hosted"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    done = subprocess.run([python, "-m", "pip", "install", "--quiet", *HOST], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    requirement = json.loads(hosted_command().split(" ", 2)[2])  # the quoted requirement
    checkout = tmp_path / "checkout"  # a copy: building the package writes build/ next to its sources
    shutil.copytree(ROOT, checkout, ignore=shutil.ignore_patterns(".git", ".venv*", "build", "*.egg-info", "release",
                                                                  "autograded", "submitted", "feedback"))
    requirement = re.sub(r"@ git\+\S+$", f"@ {checkout.as_uri()}", requirement)
    done = subprocess.run([python, "-m", "pip", "install", "--quiet", requirement], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    kept = subprocess.run([python, "-c", "from importlib.metadata import version as v; "
                           "print(v('torch').split('+')[0], v('ipykernel'))"], capture_output=True, text=True).stdout
    assert kept.split() == [h.split("==")[1] for h in HOST], kept
    kernels = tmp_path / "kernels"
    subprocess.run([python, "-m", "ipykernel", "install", "--prefix", kernels, "--name", "hosted"], check=True,
                   capture_output=True)
    monkeypatch.setenv("JUPYTER_PATH", str(kernels / "share" / "jupyter"))
    nb = nbformat.read(gradebook.COURSE / "source" / "00_setup" / "00_setup.ipynb", 4)
    work = tmp_path / "work"  # not the checkout: the kernel imports the installed package
    work.mkdir()
    NotebookClient(nb, timeout=300, kernel_name="hosted", resources={"metadata": {"path": str(work)}}).execute()
    imported = [o for c in nb.cells for o in c.get("outputs", []) if "PyTorch" in o.get("text", "")]
    assert imported, "the first demonstration cell printed nothing"
    where = subprocess.run([python, "-c", "import cs336_parallel; print(cs336_parallel.__file__)"],
                           capture_output=True, text=True, cwd=work).stdout
    assert str(env_dir) in where, where


# -- the README's cluster examples -----------------------------------------------------------------------------

def readme_targets() -> list[str]:
    """`path:function` of every `python -m cs336_parallel.run` command in the README."""
    readme = (ROOT / "README.md").read_text().replace("\\\n", " ")
    return re.findall(r"-m cs336_parallel\.run [^\n`]*?(\S+\.(?:py|ipynb):\w+)", readme)


def test_the_readmes_cluster_examples_name_functions_that_exist():
    from cs336_parallel.run import load_target

    targets = readme_targets()
    assert len(targets) >= 3 and any(t.endswith(":check_ring_all_reduce") for t in targets), targets
    for target in targets:
        assert callable(load_target(str(ROOT / target))), target


def test_the_readmes_first_cluster_example_runs_under_torchrun():
    """The learner's notebook has stubs to fill in; the master's solution runs the same function on 2 ranks."""
    master = "grading/source/01_collectives/01_collectives.ipynb:check_ring_all_reduce"
    assert "notebooks/01_collectives.ipynb:check_ring_all_reduce" in readme_targets()
    done = subprocess.run([sys.executable, "-m", "cs336_parallel.run", "--nproc-per-node", "2", master],
                          capture_output=True, text=True, cwd=ROOT, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        assert f"[rank {rank}] 'ring_all_reduce on 2 ranks matches dist.all_reduce: max error" in done.stdout
