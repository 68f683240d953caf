# Two commands do all the set-up on a fresh machine:
#   make test   create .venv if missing, install, run every test (unit, notebooks, browser)
#   make lab    create .venv if missing, install, copy the exercises you lack into work/ (never
#               overwriting your answers), start JupyterLab on the course (notebooks/, work/)
#   make site   build the course website into _build/html from the stored notebooks (seconds; the folder to
#               publish); make site-serve previews it on http://127.0.0.1:8000
# GPU users: install the torch build for your CUDA into .venv first (see README);
# an installed torch is kept.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.installed
CHROMIUM ?= /usr/bin/chromium
PYTEST_ARGS ?=
# Extra options for `jupyter lab`, e.g. LAB_ARGS="--ip 0.0.0.0 --no-browser" on a remote machine.
LAB_ARGS ?=
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: test lab site site-serve browser sandbox notebooks exercises bench gpu-check clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "torch==$(TORCH_VERSION)"
	$(PY) -m pip install --quiet -e ".[lab,test,site]"
	@touch $@

# Debian's chromium for the browser test (Playwright drives it; it downloads no browser).
browser:
	@if [ ! -x $(CHROMIUM) ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing chromium with apt-get"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
	      || echo "could not install chromium: the browser test will be skipped"; \
	  else echo "no $(CHROMIUM): the browser test will be skipped (apt-get install chromium)"; fi; \
	fi

# Debian's bubblewrap: the grader runs each learner kernel in its own sandbox (docs/instructors.md, the threat model).
sandbox:
	@if ! command -v bwrap >/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing bubblewrap with apt-get"; \
	    (apt-get install -y -qq bubblewrap >/dev/null 2>&1 || (apt-get update -qq && \
	      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null)) \
	      || echo "could not install bubblewrap: grading will refuse unless run with --no-sandbox"; \
	  else echo "no bwrap: grading refuses unless run with --no-sandbox (apt-get install bubblewrap)"; fi; \
	fi

# Jupyter, IPython and matplotlib write under $HOME: tests get a throw-away one. The tests run in TEST_JOBS
# processes (pytest-xdist; default one per core, 0 for one process), each test file whole in one of them so that
# the fixtures a file shares (a graded class, a JupyterLab server) are built once.
TEST_JOBS ?= auto
test: $(STAMP) browser sandbox
	@tmp=$$(mktemp -d); \
	GPIPE_TEST_HOME=$$tmp HOME=$$tmp MPLCONFIGDIR=$$tmp/matplotlib IPYTHONDIR=$$tmp/ipython \
	JUPYTER_CONFIG_DIR=$$tmp/jupyter/config JUPYTER_DATA_DIR=$$tmp/jupyter/data \
	JUPYTER_RUNTIME_DIR=$$tmp/jupyter/runtime \
	$(PY) -m pytest tests notebooks solutions --nbval --nbval-sanitize-with tests/nbval_sanitize.cfg \
	  -n $(TEST_JOBS) --dist loadfile $(PYTEST_ARGS); \
	rc=$$?; rm -rf $$tmp; exit $$rc

# Learners answer in work/, their copy of exercises/: `exercises start` copies only the notebooks work/
# lacks, so running it every time is safe.
lab: $(STAMP) sandbox
	$(PY) -m gpipe_ref exercises start work
	$(VENV)/bin/jupyter lab --config=tools/jupyter_lab_config.py --ServerApp.root_dir=. \
	  --LabApp.default_url=/lab/tree/notebooks/00_welcome.ipynb \
	  $$([ "$$(id -u)" = 0 ] && echo --allow-root) $(LAB_ARGS)

# The course website: every lesson, the glossary and the exercise notebooks as pages, rendered from the stored
# outputs and saved widget state (nothing runs, no network); any broken link, missing picture, stored error or
# widget without saved state fails it. Publish _build/html as it is, on any static host.
SITE_PORT ?= 8000
site: $(STAMP)
	$(PY) tools/build_site.py

site-serve: site
	@echo "serving _build/html on http://127.0.0.1:$(SITE_PORT) (Ctrl-C to stop)"
	$(PY) -m http.server $(SITE_PORT) --bind 127.0.0.1 --directory _build/html

# Re-execute the committed notebooks in place (after editing one).
notebooks: $(STAMP)
	$(PY) tools/execute_notebooks.py notebooks/*.ipynb solutions/*.ipynb

# Rebuild exercises/ from solutions/ (after editing a solution notebook); it refuses to overwrite a
# notebook there that holds answers (python -m gpipe_ref exercises build --force does).
exercises: $(STAMP)
	$(PY) -m gpipe_ref exercises build

# The full benchmark (a few minutes): results and plot in bench/. torchgpipe 0.0.7 is an optional peer,
# installed without its dependencies (it would otherwise ask pip to resolve torch again).
bench: $(STAMP)
	-$(PY) -m pip install --quiet --no-deps "torchgpipe==0.0.7"
	$(PY) -m gpipe_ref bench --json bench/results.json

# On a machine with CUDA GPUs, without network: the machine's own python and torch (.venv's when there is one),
# nothing installed. Carry the wheels `tools/gpu_wheels.sh` downloads where there is network, then e.g.
# `make gpu-check GPU_CHECK_ARGS="--wheels .whl --jobs 14"`. One summary line per part; record it in bench/gpu.md.
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),python3)
GPU_CHECK_ARGS ?=
gpu-check:
	$(GPU_PY) tools/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache test-artifacts _build
