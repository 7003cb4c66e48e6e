"""No number changes: fixed short runs, resumes of committed checkpoints and shard builds against the digests
pinned on this machine before the code around them moved (tests/pins.py says what and how)."""
from __future__ import annotations

import os

import pytest

import pins
from conftest import simulate_cli


def run_here(case, out, resume=""):
    """``pins.run_case`` of a simulated case, through the CLI in this process (a process each cost 2-3 s of
    imports, 10 of them); the pinned digests, recorded from separate processes, decide that nothing differs."""
    c = pins.CASES[case]
    sets = c["sets"] + ([f"checkpoint.resume={resume}"] if resume else [])
    code, _ = simulate_cli(None, 2, os.path.join(pins.FIXTURES, "data", c["data"]), out, sets, pins.STEPS)
    assert code == 0, f"simulate of {case} exited {code}"
    return os.path.join(out, "checkpoints", f"step-{pins.STEPS:08d}")


@pytest.fixture(scope="module")
def pinned():
    env = pins.environment()
    recorded = pins.load_pins()
    if env not in recorded:
        pytest.fail(f"no pins for this environment ({env}; pinned: {', '.join(recorded) or 'none'}). Record them "
                    f"on a commit known to be right (landed main), before moving code: "
                    f".venv/bin/python tests/pins.py --record")
    return recorded[env]


@pytest.mark.parametrize("case", [c for c in pins.CASES if not pins.CASES[c].get("real")])
def test_fixed_run_and_the_resume_of_its_committed_checkpoint(case, pinned, tmp_path):
    want = pinned["runs"][case]
    assert pins.checkpoint_digests(run_here(case, str(tmp_path / "run"))) == want
    resumed = run_here(case, str(tmp_path / "resumed"), resume=os.path.join(pins.FIXTURES, case))
    assert pins.checkpoint_digests(resumed) == want


@pytest.mark.multirank
def test_fixed_horovodrun_run(pinned, tmp_path):
    assert pins.checkpoint_digests(pins.run_case("horovodrun", str(tmp_path / "run"))) == pinned["runs"]["horovodrun"]


def test_both_shard_builders_write_the_pinned_files(pinned, tmp_path):
    assert pins.shard_builds(str(tmp_path)) == pinned["shards"]
