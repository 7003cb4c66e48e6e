# Entry points named in README. Each target bootstraps what it needs (idempotent: a second run is fast).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test test-unit test-multirank test-bigbuild demo clean-venv

# Re-run the installer when its inputs change; it skips what is already there.
$(STAMP): launch/install.sh launch/build_horovod.sh launch/horovod_build_env.py setup.cfg pyproject.toml
	HVD_PARTIALFC_VENV=$(abspath $(VENV)) bash launch/install.sh
	touch $(STAMP)

install: $(STAMP)

test: install
	$(PY) -m pytest tests -q

# A -m on the command line replaces setup.cfg's -m "not bigbuild": keep it out here too.
test-unit: install
	$(PY) -m pytest tests -q -m "not multirank and not bigbuild"

test-multirank: install
	$(PY) -m pytest tests -q -m multirank

# A 1M-record streaming shard build with its peak RSS asserted (docs/data.md §6.6).
test-bigbuild: install
	$(PY) -m pytest tests/test_build_stream.py -q -s -m bigbuild

# The main job on the embedded default data (fonts): data, training on 2 ranks, evaluation, report.
demo: install
	bash launch/demo.sh

clean-venv:
	rm -rf $(VENV)
