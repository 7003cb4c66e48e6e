# Entry points named in README. Each target bootstraps what it needs (idempotent: a second run is fast).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test test-unit test-multirank test-bigbuild demo clean-venv

# Re-run the installer when its inputs change; it skips what is already there.
$(STAMP): scripts/setup/install.sh scripts/setup/build_horovod.sh scripts/setup/horovod_build_env.py setup.cfg pyproject.toml
	HVD_PARTIALFC_VENV=$(abspath $(VENV)) bash scripts/setup/install.sh --test-fonts
	touch $(STAMP)

install: $(STAMP)

# `hvd-partialfc doctor` first: what the machine has and lacks, one line each (docs/engines.md). make test goes on
# whatever it says (the tests name what fails; a missing font or GPU is only a note); make demo stops on a
# missing requirement of the demo's engine (Horovod with Gloo), before any data is built.
DOCTOR := $(PY) -m hvd_partialfc.cli doctor

# Three streams. The suite is CPU-bound (20 CPU-minutes from a fresh clone, 2026-12-07, most of it process starts:
# import torch, then torch._dynamo at a process's first optimizer, ~3.5 CPU-s each), so the aim is to keep both
# cores busy:
# * tests marked serial (a rate, a CPU share or a time bound is their claim: the flood's note rate fell 94x at
#   nice 19 beside the ranks; a heartbeat's 3 s bound) first, one at a time, at normal priority;
# * beside them, and beside everything after, the single-process tests at nice 19 (pytest-xdist on both cores, a
#   file's tests on one worker so they share its fixtures): they take a core only when no rank wants it;
# * then the other multi-rank tests two at a time (--dist loadfile: a file's tests, or the files sharing one
#   launch, on one worker; conftest.py). One at a time they left a core idle (1.14 cores used on average: launches,
#   waits) and took 11 min 45 s of the 13 min 25 s.
# The unit stream's output comes last; the target fails if any stream did.
SERIAL := -m "serial and not bigbuild"
MULTI := -m "multirank and not serial and not bigbuild" -n 2 --dist loadfile
UNIT := -m "not multirank and not serial and not bigbuild" -n 2 --dist loadfile
test: install
	$(DOCTOR) || true
	@log=$$(mktemp); nice -n 19 $(PY) -m pytest tests -q -p no:cacheprovider $(UNIT) > $$log 2>&1 & unitpid=$$!; \
	  $(PY) -m pytest tests -q -p no:cacheprovider $(SERIAL); serial=$$?; \
	  $(PY) -m pytest tests -q -p no:cacheprovider $(MULTI); multi=$$?; \
	  wait $$unitpid; unit=$$?; echo "--- the single-process tests (run beside them at nice 19):"; cat $$log; \
	  rm -f $$log; exit $$((unit || multi || serial))

# A -m on the command line replaces setup.cfg's -m "not bigbuild": keep it out here too.
test-unit: install
	$(PY) -m pytest tests -q $(UNIT)

test-multirank: install
	$(PY) -m pytest tests -q $(SERIAL); s=$$?; $(PY) -m pytest tests -q $(MULTI); exit $$((s || $$?))

# A 1M-record streaming shard build with its peak RSS asserted (docs/evidence/data.md §6.6).
test-bigbuild: install
	$(PY) -m pytest tests/test_build_stream.py -q -s -m bigbuild

# The main job on the embedded default data (fonts): data, training on 2 ranks, evaluation, report.
demo: install
	$(DOCTOR) --engine horovod --out runs/demo
	bash scripts/demo.sh

clean-venv:
	rm -rf $(VENV)
