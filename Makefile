# The two front-door commands (README): `make lab` starts the course, `make test` runs every test.
# Both create or update the environment in .venv first, and are quick when it is up to date.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
READY := $(VENV)/.installed
KERNEL := cs336-parallel
# The environment's tools (jupyter, nbgrader, alembic) come first for every command.
export PATH := $(CURDIR)/$(BIN):$(PATH)
# A browser opens where there is a screen; on a headless server JupyterLab just prints its URL.
OPEN_BROWSER := $(if $(or $(DISPLAY),$(WAYLAND_DISPLAY),$(filter Darwin,$(shell uname -s))),,--no-browser)
# Containers and cloud machines often log in as root; JupyterLab refuses root unless told.
AS_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root)
# nbgrader's instructor tools (formgrader, exchange-based assignment and course lists) stay out of the
# learner's JupyterLab; its Validate button stays. Instructors use grading/course.py (grading/README.md).
NBGRADER_SERVER_OFF := formgrader assignment_list course_list
NBGRADER_LAB_OFF := formgrader assignment-list course-list create-assignment menu

NOTEBOOKS ?= notebooks
SUDO := $(if $(filter 0,$(shell id -u)),,sudo -n)

.PHONY: lab test chromium sandbox notebooks grade lint clean

lab: $(READY)
	$(BIN)/jupyter lab --notebook-dir=$(NOTEBOOKS) $(OPEN_BROWSER) $(AS_ROOT) $(ARGS)

test: $(READY) chromium sandbox
	$(BIN)/python -m pytest $(ARGS)

# The browser tests drive Debian's Chromium; without it (and without the rights to install it) they are skipped.
chromium:
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || \
	  { command -v apt-get >/dev/null && export DEBIAN_FRONTEND=noninteractive && \
	    { $(SUDO) apt-get install -y -q chromium >/dev/null 2>&1 || \
	      { $(SUDO) apt-get update -q >/dev/null 2>&1 && $(SUDO) apt-get install -y -q chromium >/dev/null 2>&1; }; }; } || \
	  echo "Chromium is not installed and could not be installed here: the browser tests will be skipped."

# Autograding runs each submission in a bubblewrap sandbox (grading/README.md): Debian's bubblewrap. Without it,
# the grading tests grade without isolation (tests/conftest.py) and the isolation tests are skipped.
sandbox:
	@command -v bwrap >/dev/null || \
	  { command -v apt-get >/dev/null && export DEBIAN_FRONTEND=noninteractive && \
	    { $(SUDO) apt-get install -y -q bubblewrap >/dev/null 2>&1 || \
	      { $(SUDO) apt-get update -q >/dev/null 2>&1 && $(SUDO) apt-get install -y -q bubblewrap >/dev/null 2>&1; }; }; } || \
	  echo "bubblewrap is not installed and could not be installed here: submissions are graded without isolation."

notebooks: $(READY)  ## regenerate the student notebooks from grading/source (instructors)
	$(BIN)/python grading/course.py release

grade: $(READY)  ## grade your own notebook: make grade NOTEBOOK=notebooks/01_collectives.ipynb
	$(BIN)/python grading/course.py selfgrade $(NOTEBOOK)

lint: $(READY)
	$(BIN)/ruff check .

$(READY): pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "cs336-parallel needs Python 3.11 or newer, found " + sys.version' 
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[course,test]'
	$(BIN)/python -m ipykernel install --sys-prefix --name $(KERNEL) --display-name "Python 3 ($(KERNEL))" >/dev/null
	$(BIN)/jupyter server extension disable --sys-prefix $(NBGRADER_SERVER_OFF:%=nbgrader.server_extensions.%) >/dev/null 2>&1
	$(BIN)/jupyter labextension disable --level=sys_prefix $(NBGRADER_LAB_OFF:%=@jupyter/nbgrader:%) >/dev/null 2>&1
	mkdir -p $(VENV)/share/jupyter/lab/settings  # no "get Jupyter news?" prompt on a learner's first start
	echo '{"@jupyterlab/apputils-extension:notification": {"fetchNews": "false"}}' \
	  > $(VENV)/share/jupyter/lab/settings/overrides.json
	touch $@

clean:
	rm -rf $(VENV) grading/release grading/submitted grading/autograded grading/feedback grading/gradebook.db \
	  grading/executed grading/report
