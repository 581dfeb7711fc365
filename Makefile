# make run: set up (once) and start the daemon in the foreground.
# make test: set up (once) and run the whole suite, then the self-check.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup run test selfcheck bench poppler clean install-units

setup: $(STAMP) poppler

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# poppler renders scanned PDF pages; without it the daemon still reads PDF text (pypdf)
poppler:
	@command -v pdftotext >/dev/null || { \
	  if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && apt-get install -y -qq poppler-utils; \
	  elif command -v apt-get >/dev/null && command -v sudo >/dev/null; then \
	    sudo apt-get install -y poppler-utils; \
	  else echo "note: install poppler (pdftotext, pdftoppm) for scanned PDF pages"; fi; }

run: setup
	$(PY) assistant.py

test: setup
	$(PY) -m pytest -q
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
