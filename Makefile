# The front-door commands (README): `make lab` starts the course (learners), `make grade` grades a learner's
# notebook. Each creates or updates the environment in .venv first, and is quick when it is up to date.
# Versions come from the lock (requirements/lock.txt).
# course only
# `make test` runs every test (developers), `make notebooks` releases the notebooks (instructors); `make lock` makes
# a new lock, `make test-latest` tries the newest versions pyproject.toml allows in an environment of its own,
# before they reach the lock. The parts between `course only` lines are left out of the student edition a class is
# given (`python -m grading student-edition DIR`, grading/edition.py).
# end course only

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
# What a learner needs (the package, JupyterLab, nbgrader).
READY := $(VENV)/.installed
# `make lab TORCH=cpu`: PyTorch's CPU-only wheels on Linux (192 MB to download, not ~2.7 GB of CUDA libraries).
TORCH_INDEX := $(if $(filter cpu,$(TORCH)),--extra-index-url https://download.pytorch.org/whl/cpu)
# Every package at the lock's version (a constraints file: pip installs what is asked for, and pins what it names).
LOCK := requirements/lock.txt
CONSTRAINTS := -c $(LOCK)
# `make grade`: a class's student edition has only the visible tests (cs336_parallel/selfcheck.py).
GRADER := cs336_parallel.selfcheck
# course only
# What the tests need on top (pytest, ruff...).
TEST_READY := $(VENV)/.installed-test
PINS := requirements/pins.txt
# LATEST=1 (make test-latest): the newest versions pyproject.toml allows, apart from requirements/pins.txt.
CONSTRAINTS := $(if $(LATEST),-c $(PINS) --upgrade --upgrade-strategy eager,-c $(LOCK))
UV := uv==0.13.9
# The course's repository grades against the hidden tests (grading/).
GRADER := grading selfgrade
# end course only
PIP_INSTALL := $(BIN)/python -m pip install --quiet --disable-pip-version-check $(TORCH_INDEX) $(CONSTRAINTS)
KERNEL := cs336-parallel
# The environment's tools (jupyter, nbgrader, alembic) come first for every command.
export PATH := $(CURDIR)/$(BIN):$(PATH)
# A browser opens where there is a screen; on a headless server JupyterLab just prints its URL.
OPEN_BROWSER := $(if $(or $(DISPLAY),$(WAYLAND_DISPLAY),$(filter Darwin,$(shell uname -s))),,--no-browser)
# Containers and cloud machines often log in as root; JupyterLab refuses root unless told.
AS_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root)
# nbgrader's instructor tools (formgrader, exchange-based assignment and course lists) stay out of the
# learner's JupyterLab; its Validate button stays.
# course only
# Instructors use `python -m grading` (grading/README.md).
# end course only
NBGRADER_SERVER_OFF := formgrader assignment_list course_list
NBGRADER_LAB_OFF := formgrader assignment-list course-list create-assignment menu

# PyTorch 2.13 has wheels for Python 3.10 and newer.
OLD_PYTHON := "cs336-parallel needs Python 3.10 or newer, as PyTorch 2.13 does; $(PYTHON) is Python " \
  + sys.version.split()[0] + ". Install Python 3.10 or newer (python3 on Ubuntu 22.04 is 3.10; on macOS: \
  brew install python@3.11), then run: make lab PYTHON=python3.10 (or the version you installed)"
NO_VENV := "$(PYTHON) cannot create a virtual environment (it has no ensurepip). On Debian or Ubuntu: \
  sudo apt install python3-venv (python3.10-venv for Python 3.10), then run make again."

NOTEBOOKS ?= notebooks

.PHONY: lab grade clean

lab: $(READY)
	$(BIN)/jupyter lab --notebook-dir=$(NOTEBOOKS) $(OPEN_BROWSER) $(AS_ROOT) $(ARGS)

grade: $(READY)  ## grade your own notebook: make grade NOTEBOOK=notebooks/01_collectives.ipynb
	$(BIN)/python -m $(GRADER) $(NOTEBOOK)

# course only
SUDO := $(if $(filter 0,$(shell id -u)),,sudo -n)

.PHONY: test test-fast test-latest lock chromium sandbox notebooks lint

# Two pytest-xdist workers, each running whole modules (a module's fixtures are built once) or one notebook's
# mutation run, the longest first (tests/conftest.py): much of the suite waits on kernels, sandboxes and ranks,
# and the other worker fills those waits. WORKERS=0: one process.
WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -n $(WORKERS) --dist loadscope --no-loadscope-reorder

test: $(TEST_READY) chromium sandbox
	$(PYTEST) $(ARGS)

# A developer's loop: everything but the tests marked slow (whole notebooks autograded, the hosted install,
# sandboxes, the browser), about 3 minutes on 2 cores. `make test` (and CI) runs everything.
test-fast: $(TEST_READY)
	$(PYTEST) -m "not slow" $(ARGS)

# Installs Debian package $(2) unless one of the commands $(1) exists; where that is not possible, says $(3).
apt_install = for c in $(1); do command -v $$c >/dev/null && exit 0; done; \
	{ command -v apt-get >/dev/null && export DEBIAN_FRONTEND=noninteractive && \
	  { $(SUDO) apt-get install -y -q $(2) >/dev/null 2>&1 || \
	    { $(SUDO) apt-get update -q >/dev/null 2>&1 && $(SUDO) apt-get install -y -q $(2) >/dev/null 2>&1; }; }; } || \
	echo "$(3)"

# The browser tests drive Debian's Chromium; without it (and without the rights to install it) they are skipped.
chromium:
	@$(call apt_install,chromium chromium-browser,chromium,Chromium is not installed and could not be installed here: the browser tests will be skipped.)

# Autograding runs each submission in a bubblewrap sandbox (grading/README.md): Debian's bubblewrap. Without it,
# the grading tests grade without isolation (tests/conftest.py) and the isolation tests are skipped.
sandbox:
	@$(call apt_install,bwrap,bubblewrap,bubblewrap is not installed and could not be installed here: submissions are graded without isolation.)

notebooks: $(READY)  ## regenerate the student notebooks from grading/source (instructors); FORCE=1 overwrites changes
	$(BIN)/python -m grading release $(if $(FORCE),--force)

lint: $(TEST_READY)
	$(BIN)/ruff check .

# A new lock: the newest versions pyproject.toml allows (requirements/pins.txt holds some on purpose), for every
# platform and Python 3.10+ at once. `make lock PACKAGE=cloudpickle` moves that one package only. Then `make test`.
lock: $(READY)
	$(PIP_INSTALL) $(UV)
	$(BIN)/uv pip compile pyproject.toml --extra course --extra test --universal --python-version 3.10 \
	  -c $(PINS) $(if $(PACKAGE),--upgrade-package $(PACKAGE),--upgrade) --custom-compile-command "make lock" \
	  --quiet -o $(LOCK)

# The whole suite in .venv-latest, built from the newest versions pyproject.toml allows instead of the lock; when it
# fails, it names the packages whose new release breaks it (requirements/test_latest.py). Not part of `make test`.
test-latest: chromium sandbox
	$(PYTHON) requirements/test_latest.py $(ARGS)

$(TEST_READY): $(READY)
	$(PIP_INSTALL) -e '.[course,test]'
	touch $@
# end course only

$(READY): pyproject.toml $(LOCK)
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else $(OLD_PYTHON))'
	@$(PYTHON) -c 'import ensurepip' 2>/dev/null || { echo $(NO_VENV); exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) -e '.[course]'
	$(BIN)/python -m compileall -q cs336_parallel  # sandboxes read it read-only: compiled once, not per process
	$(BIN)/python -m cs336_parallel.kernel --install $(KERNEL) "Python 3 ($(KERNEL))"
	$(BIN)/jupyter server extension disable --sys-prefix $(NBGRADER_SERVER_OFF:%=nbgrader.server_extensions.%) >/dev/null 2>&1
	$(BIN)/jupyter labextension disable --level=sys_prefix $(NBGRADER_LAB_OFF:%=@jupyter/nbgrader:%) >/dev/null 2>&1
	mkdir -p $(VENV)/share/jupyter/lab/settings  # no "get Jupyter news?" prompt on a learner's first start
	echo '{"@jupyterlab/apputils-extension:notification": {"fetchNews": "false"}}' \
	  > $(VENV)/share/jupyter/lab/settings/overrides.json
	touch $@

clean:
	rm -rf $(VENV)
# course only
	rm -rf .venv-latest grading/release grading/submitted grading/autograded grading/feedback grading/gradebook.db \
	  grading/executed grading/report
# end course only
