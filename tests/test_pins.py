"""No number changes: fixed short runs, resumes of committed checkpoints and shard builds against the digests
pinned on this machine before the code around them moved (tests/pins.py says what and how).

The digests are this machine's regression checks: on another build (a CUDA torch, an AVX2 CPU, other numpy,
h5py or Pillow versions) they skip, naming the environments they were recorded on. What runs on every build:
each pinned run's losses and norms within the tolerance measured across builds (``pins.py --measure``)."""
from __future__ import annotations

import os

import pytest

import pins
from conftest import require_horovod, simulate_cli

SIMULATED = [c for c in pins.CASES if not pins.CASES[c].get("real")]


def run_here(case, out, resume=""):
    """``pins.run_case`` of a simulated case, through the CLI in this process (a process each cost 2-3 s of
    imports, 10 of them); the pinned digests, recorded from separate processes, decide that nothing differs."""
    c = pins.CASES[case]
    sets = c["sets"] + ([f"checkpoint.resume={resume}"] if resume else [])
    code, _ = simulate_cli(None, 2, os.path.join(pins.FIXTURES, "data", c["data"]), out, sets, pins.STEPS)
    assert code == 0, f"simulate of {case} exited {code}"
    return os.path.join(out, "checkpoints", f"step-{pins.STEPS:08d}")


def pinned_here(recorded, env):
    """This environment's pins; a skip naming the environments pinned when there are none."""
    envs = {k: v for k, v in recorded.items() if k != "portable"}
    if env not in envs:
        pytest.skip(f"the bitwise pins are this project's regression checks, recorded on {' | '.join(envs) or 'none'}; "
                    f"this machine is {env} (the portable check runs here; to move code on this machine, first "
                    f"record its pins on landed main: .venv/bin/python tests/pins.py --record)")
    return envs[env]


@pytest.fixture(scope="module")
def pinned():
    return pinned_here(pins.load_pins(), pins.environment())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each simulated case run once (to step 30) for both tests below: {case: step-30 checkpoint}."""
    done = {}

    def get(case):
        if case not in done:
            done[case] = run_here(case, str(tmp_path_factory.mktemp(case) / "run"))
        return done[case]
    return get


@pytest.mark.parametrize("case", SIMULATED)
def test_fixed_run_and_the_resume_of_its_committed_checkpoint(case, pinned, runs, tmp_path):
    want = pinned["runs"][case]
    assert pins.checkpoint_digests(runs(case)) == want
    resumed = run_here(case, str(tmp_path / "resumed"), resume=pins.fixture_dir(pinned, case))
    assert pins.checkpoint_digests(resumed) == want


@pytest.mark.parametrize("case", SIMULATED)
def test_losses_and_norms_on_any_build(case, runs):
    portable = pins.load_pins()["portable"]
    bad = pins.within(pins.summary(runs(case)), portable["reference"][case], portable["tolerance"][case])
    assert not bad, f"{case} (recorded on {portable['recorded_on']}): " + "; ".join(bad)


def test_the_portable_check_can_fail_and_the_pins_skip_elsewhere():
    """A figure moved by 1e-3 (a margin's or a scale's change moves them by far more) is outside the measured
    tolerance; another environment skips the bitwise pins with the environments they were recorded on."""
    portable = pins.load_pins()["portable"]
    ref, tol = portable["reference"]["local_negatives"], portable["tolerance"]["local_negatives"]
    assert pins.within(dict(ref), ref, tol) == []
    moved = dict(ref, **{"loss@30": ref["loss@30"] * (1 + 1e-3)})
    assert pins.within(moved, ref, tol)
    with pytest.raises(pytest.skip.Exception, match="recorded on torch "):
        pinned_here(pins.load_pins(), "torch 9.9.9+cu999 / x86_64 AVX2 / numpy 3.0")


@pytest.mark.multirank
def test_fixed_horovodrun_run(pinned, tmp_path):
    require_horovod()
    assert pins.checkpoint_digests(pins.run_case("horovodrun", str(tmp_path / "run"))) == pinned["runs"]["horovodrun"]


def test_both_shard_builders_write_the_pinned_files(pinned, tmp_path):
    assert pins.shard_builds(str(tmp_path)) == pinned["shards"]
