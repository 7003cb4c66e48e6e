# Entry points named in README. Each target bootstraps what it needs (idempotent: a second run is fast).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test test-unit test-multirank demo clean-venv

# Re-run the installer when its inputs change; it skips what is already there.
$(STAMP): launch/install.sh setup.cfg pyproject.toml
	bash launch/install.sh
	touch $(STAMP)

install: $(STAMP)

test: install
	$(PY) -m pytest tests -q

test-unit: install
	$(PY) -m pytest tests -q -m "not multirank"

test-multirank: install
	$(PY) -m pytest tests -q -m multirank

# The main job on the embedded default data (fonts): data, training on 2 ranks, evaluation, report.
demo: install
	bash launch/demo.sh

clean-venv:
	rm -rf $(VENV)
