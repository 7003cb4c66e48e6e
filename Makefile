# Entry points named in README. Each target bootstraps what it needs (idempotent: a second run is fast).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test test-unit test-multirank test-bigbuild demo clean-venv

# Re-run the installer when its inputs change; it skips what is already there.
$(STAMP): launch/install.sh launch/build_horovod.sh launch/horovod_build_env.py setup.cfg pyproject.toml
	HVD_PARTIALFC_VENV=$(abspath $(VENV)) bash launch/install.sh --test-fonts
	touch $(STAMP)

install: $(STAMP)

# `hvd-partialfc doctor` first: what the machine has and lacks, one line each (docs/engines.md). make test goes on
# whatever it says (the tests name what fails; a missing font or GPU is only a note); make demo stops on a
# missing requirement of the demo's engine (Horovod with Gloo), before any data is built.
DOCTOR := $(PY) -m hvd_partialfc.cli doctor

# The single-process tests on both cores (pytest-xdist, a file's tests on one worker so they share its
# fixtures), then the multi-rank tests alone (their ranks need the cores; their timeouts assume them). Both
# halves run whatever the first gives; the target fails if either did.
UNIT := -m "not multirank and not bigbuild" -n 2 --dist loadfile
test: install
	$(DOCTOR) || true
	$(PY) -m pytest tests -q $(UNIT); unit=$$?; $(PY) -m pytest tests -q -m "multirank and not bigbuild"; \
	  multi=$$?; exit $$((unit || multi))

# A -m on the command line replaces setup.cfg's -m "not bigbuild": keep it out here too.
test-unit: install
	$(PY) -m pytest tests -q $(UNIT)

test-multirank: install
	$(PY) -m pytest tests -q -m multirank

# A 1M-record streaming shard build with its peak RSS asserted (docs/data.md §6.6).
test-bigbuild: install
	$(PY) -m pytest tests/test_build_stream.py -q -s -m bigbuild

# The main job on the embedded default data (fonts): data, training on 2 ranks, evaluation, report.
demo: install
	$(DOCTOR) --engine horovod --out runs/demo
	bash launch/demo.sh

clean-venv:
	rm -rf $(VENV)
