# The kit's two commands: `make demo` and `make test`. Both build .venv/ on first use.
# The tier is chosen once, when .venv is built: GPU if `nvidia-smi -L` lists a GPU, else CPU.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
KIT := $(dir $(abspath $(lastword $(MAKEFILE_LIST))))
STAMP := $(VENV)/.colo_kit-installed
TIER ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo gpu || echo cpu)
export OMP_NUM_THREADS ?= 1
export VLLM_CPU_KVCACHE_SPACE ?= 1
export TOKENIZERS_PARALLELISM ?= false
export PYTHONUNBUFFERED := 1

.PHONY: venv demo test test-fast numbers numbers-status site lab lab-reset clean-venv data

venv: $(STAMP)

$(STAMP): requirements/common.txt requirements/cpu.txt requirements/gpu.txt pyproject.toml scripts/make_venv.sh
	PY=$(PY) VENV=$(VENV) bash scripts/make_venv.sh $(TIER) && touch $(STAMP)

demo: venv
	$(BIN)/python -m colo_kit demo

# Two workers (pytest-xdist), each running one test file at a time: the notebooks beside the rest of the suite on
# two cores; every test's time lands in results/runs/pytest.xml (ignored by git). `pytest` alone runs it serially.
# --no-loadscope-reorder: files go out in conftest's order (test_launch.py first, on a pristine worker); xdist's
# default sends the files with the most tests first, and test_launch.py then failed after test_proxy.py & co.
test: venv
	$(BIN)/python -m pytest -v -n 2 --dist loadfile --no-loadscope-reorder --durations=25 --junitxml=results/runs/pytest.xml

test-fast: venv
	$(BIN)/python -m pytest -v -n 2 --dist loadfile --no-loadscope-reorder -m "not slow and not notebook"

# Every measured time and peak a learner reads, from one check run here: the notebooks executed as Run All runs
# them (into results/gpu_check.json where there is a GPU, else results/cpu_check.json), what the lessons show from
# the large records (results/lessons.json), then the notebooks' headers, README.md's hardware matrix and
# docs/INSTRUCTOR.md's tables rewritten from what it measured.
numbers: venv
	$(BIN)/python scripts/check.py notebooks --json results/$(TIER)_check.json
	$(BIN)/python -m record.lessons --out results/lessons.json
	$(BIN)/python scripts/check.py refresh

# How fresh the numbers are: for each results file a learner reads, the machine and commit that measured it and how
# many commits changed the code it measures since; each notebook's Run All records; the runs and goals still owed.
# A report, not a test: git and the JSON files only, in seconds. STATUS_ARGS=--json for machines, --markdown for README.
# The venv is built if missing, never rebuilt here (as `site` below).
STATUS_ARGS ?=
numbers-status:
	@[ -e $(STAMP) ] || $(MAKE) venv
	$(BIN)/python -m record.status $(STATUS_ARGS)

# The lessons as a static website under build/site/html/ (open index.html, or `python -m http.server -d
# build/site/html`): each lesson page from its executed copy under results/ (nothing is executed), the home page from
# README.md, INSTRUCTOR.md, the package's reference and the freshness report (docs/site/build.py). The venv is built
# if missing, never rebuilt here (an order-only prerequisite would still be remade when a requirements file is newer
# than its stamp, as in a fresh clone).
site:
	@[ -e $(STAMP) ] || $(MAKE) venv
	$(BIN)/python docs/site/build.py --out build/site

# JupyterLab on lab/, a working copy of notebooks/ made on first use: a learner's edits, outputs and
# JupyterLab's autosaves land there (ignored by git), never in the tracked notebooks. `make lab-reset` puts
# fresh copies back. The copies carry this kernel's language_info, which JupyterLab would otherwise write into a
# notebook as its kernel starts, marking it modified before the learner did anything (scripts/lab_copy.py).
# LAB_IP=0.0.0.0 to listen beyond this machine (then `export LAB_TOKEN=...` first: it
# reaches JupyterLab through its environment, not its command line, where `ps` would show it); as root
# (containers) it adds --allow-root, which JupyterLab otherwise demands and refuses.
# LAB_DIR=lab-NAME gives each learner sharing one clone on a GPU node a working copy of their own; a copy that a
# JupyterLab has open is refused (scripts/lab_run.py).
LAB_IP ?= 127.0.0.1
LAB_PORT ?= 8888
LAB_DIR ?= lab
LAB_ARGS = --ip=$(LAB_IP) --port=$(LAB_PORT) $(if $(filter 0,$(shell id -u)),--allow-root)
LAB_DIR_OK = [[ "$(LAB_DIR)" =~ ^lab(-[A-Za-z0-9]+)?$$ ]] || { echo "LAB_DIR=$(LAB_DIR): use lab or lab-NAME \
	(letters and digits, e.g. lab-alice), a folder git ignores" >&2; exit 2; }
lab: venv
	@$(LAB_DIR_OK)
	@$(BIN)/python $(KIT)scripts/lab_copy.py $(LAB_DIR) notebooks/*.ipynb
	@[ -z "$$LAB_TOKEN" ] || export JUPYTER_TOKEN="$$LAB_TOKEN"; $(BIN)/python $(KIT)scripts/lab_run.py $(LAB_DIR) $(BIN)/jupyter lab $(LAB_DIR)/ $(LAB_ARGS)

lab-reset:
	@$(LAB_DIR_OK)
	@mkdir -p $(LAB_DIR) && rm -f $(LAB_DIR)/*.ipynb && $(BIN)/python $(KIT)scripts/lab_copy.py --replace $(LAB_DIR) \
		notebooks/*.ipynb && echo "$(LAB_DIR)/: fresh copies of notebooks/"

data: venv
	$(BIN)/python scripts/make_data.py

clean-venv:
	rm -rf $(VENV)
