"""The two engines give the same numbers: ``horovodrun -np 2`` (Horovod) and ``torchrun --nproc-per-node 2``
(torch.distributed) train bitwise-identical backbones, classifiers, optimizer states and random streams,
and a checkpoint written under one resumes under the other, bitwise. Plus what only the torch engine has:
choosing the engine from the launcher, and the debug check of collective names.

The shared set (one launch per launcher, ``tests/mr/engines_launch.py``): 12 steps of each classifier mode
(``local`` with cross-shard negatives, sampled ``local``, sampled ``global``, ``replicated``) and of a mixed
run (fp16 autocast with loss scaling, fp16 gradient compression, sync BatchNorm, two backward passes a step,
clipping, AdamW, flip augmentation), digested with tests/pins.py's own hash (not the package's).
"""
from __future__ import annotations

import json
import os
import time

import pytest

from conftest import MR, launch_cmd, launch_env, require_horovod, run_job
import pins

pytestmark = pytest.mark.multirank
# 12 steps: three negatives exchanges (every 5 steps, from step 0; the one at step 10 after the resume), and two
# epochs of the mixed run (6 steps: two backward passes of 8 of a rank's 96 samples); the checkpoint of step 8,
# in the mixed run's second epoch, is the cross-engine resume's start. (16 steps took no other path and cost
# this set ~15 CPU-s more; 32 steps, past the feature runs' first epoch too, 22 s more of its 54 s.)
STEPS, HALF = 12, 8
CASES = {name: pins.CASES[name] for name in ("local_negatives", "local_sampled", "global_sampled", "replicated")}
CASES["mixed_fp16_compression"] = {"data": "images", "sets": pins.CASES["mixed"]["sets"] + ["optim.fp16_compression=true"]}
LAUNCHERS = {"horovodrun": "gloo", "torchrun": "torchrun"}


def launcher(name: str, np_: int = 2):
    """The launch command of ``name`` (horovodrun with Gloo, or torchrun on this host) for ``np_`` ranks."""
    return launch_cmd(LAUNCHERS[name], np_)


def train_args(case, out, steps=STEPS, resume=""):
    args = ["--shards", os.path.join(pins.FIXTURES, "data", case["data"]), "--out", str(out), "--steps", str(steps)]
    for s in case["sets"] + [f"checkpoint.every={HALF}", "checkpoint.keep=3"]:
        args += ["--set", s]
    return args + (["--resume", str(resume)] if resume else [])


def launch_items(which, out, items, timeout=400):
    spec = out / "spec.json"
    out.mkdir(parents=True, exist_ok=True)
    spec.write_text(json.dumps({"out": str(out), "items": items}))
    t0 = time.time()
    # Horovod's 1 ms cycle (not the engine's 10 ms CPU default): sync BatchNorm's small collectives each wait
    # for a cycle, 42 s of the mixed run's 50 steps at 10 ms (measured when the set ran 50 steps); at 2 ranks the fusion it changes is exact anyway
    env = dict(launch_env(), HOROVOD_CYCLE_TIME="1")
    p = run_job(launcher(which) + [os.path.join(MR, "engines_launch.py"), str(spec)], env, timeout)
    assert p.returncode == 0, f"{which} exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    return time.time() - t0


def ckpt(out, name, step=STEPS):
    return out / name / "run" / "checkpoints" / f"step-{step:08d}"


def _bad_sha256_args(shards, run):
    """``train``'s arguments of a run whose rank 1 has bad input (bytes of its shard changed, with
    ``data.verify_sha256``): a copy of the feature fixture at ``shards``, ``local`` with negatives, 10 steps."""
    import shutil
    shutil.copytree(os.path.join(pins.FIXTURES, "data", "features"), shards)
    with open(sorted(shards.glob("*.h5"))[1], "r+b") as f:
        f.seek(-64, 2)
        tail = f.read(64)
        f.seek(-64, 2)
        f.write(bytes(255 - b for b in tail))          # every byte differs: the file's sha256 changes
    case = {"data": "features", "sets": CASES["local_negatives"]["sets"] + ["data.verify_sha256=true"]}
    args = train_args(case, run, 10)
    args[1] = str(shards)
    return args


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """Both launches of the shared set, side by side, with the resumes across engines: Horovod -> torch of
    the mixed run (the last case of the Horovod launch) in the torch launch, torch -> Horovod of ``local`` with
    negatives (the first case of the torch launch) in the Horovod launch, each item started once the other
    launch has published the checkpoint it resumes (``after``; one launch per engine, not three). The torch
    launch ends with the two refusals at start-up (``engine_mismatch``: train.engine=horovod under torchrun;
    ``agreed_error``: bad input on rank 1 only), each ``hvd-partialfc train`` (``cli.main``) returning its
    error on every rank, as a launch of its own would exit with it (one torchrun start-up, not three)."""
    from concurrent.futures import ThreadPoolExecutor
    base = tmp_path_factory.mktemp("engines")
    hvd, tor = base / "horovod", base / "torch"
    from_torch = ckpt(tor, "local_negatives", HALF)
    items_h = [{"train": n, "args": train_args(c, hvd / n / "run")} for n, c in CASES.items()]
    items_h += [{"scenario": "primitives"}, {"train": "from_torch", "after": str(from_torch), "args": train_args(
        CASES["local_negatives"], hvd / "from_torch" / "run", resume=from_torch)}]
    from_horovod = ckpt(hvd, "mixed_fp16_compression", HALF)
    items = [{"train": n, "args": train_args(c, tor / n / "run")} for n, c in CASES.items()]
    items.append({"train": "from_horovod", "after": str(from_horovod), "args": train_args(
        CASES["mixed_fp16_compression"], tor / "from_horovod" / "run", resume=from_horovod)})
    items += [{"scenario": "primitives"}, {"scenario": "mismatch"}]
    # the two refusals at start-up, last (each an error every rank returns from ``train``; nothing runs after)
    items.append({"train": "engine_mismatch", "args": train_args(CASES["local_negatives"], tor / "engine_mismatch" / "run")
                  + ["--set", "train.engine=horovod"], "expect_error": True})
    items.append({"train": "agreed_error", "args": _bad_sha256_args(base / "bad_shards", tor / "agreed_error" / "run"),
                  "expect_error": True})
    with ThreadPoolExecutor(2) as pool:
        runs = {"horovodrun": pool.submit(launch_items, "horovodrun", hvd, items_h),
                "torchrun": pool.submit(launch_items, "torchrun", tor, items)}
        seconds = {k: f.result() for k, f in runs.items()}
    print(f"shared set, side by side: horovodrun {seconds['horovodrun']:.1f} s, torchrun {seconds['torchrun']:.1f} s")
    return hvd, tor


@pytest.mark.parametrize("case", list(CASES))
def test_both_engines_give_the_same_bits(shared, case):
    hvd, tor = shared
    for step in (HALF, STEPS):
        a, b = pins.checkpoint_digests(str(ckpt(hvd, case, step))), pins.checkpoint_digests(str(ckpt(tor, case, step)))
        assert set(a) == set(b) and len(a) == 8
        assert a == b, {k: (a[k][:12], b[k][:12]) for k in a if a[k] != b[k]}


def test_checkpoints_resume_across_engines_bitwise(shared):
    hvd, tor = shared
    for resumed, whole in ((ckpt(tor, "from_horovod"), ckpt(hvd, "mixed_fp16_compression")),
                           (ckpt(hvd, "from_torch"), ckpt(tor, "local_negatives"))):
        assert pins.checkpoint_digests(str(resumed)) == pins.checkpoint_digests(str(whole))
    log = (tor / "from_horovod" / "rank-0.log").read_text()
    assert f"at step {HALF}" in log


def test_every_primitive_computes_what_it_must_under_both_engines(shared):
    """tests/mr/engines_launch.py's ``primitives``: broadcast from ranks that start different, all-gather of
    unequal row counts, sums / maxima / averages of several dtypes, scalars, the vote, objects."""
    hvd, tor = shared
    for base in (hvd, tor):
        for r in range(2):
            assert (base / "primitives" / f"rank-{r}.log").read_text() == "primitives ok\n"


def test_collectives_that_differ_across_ranks_fail_loudly(shared):
    _, tor = shared
    for r in range(2):
        text = (tor / "mismatch" / f"rank-{r}.log").read_text()
        assert "RankFailure: collective #" in text and "rank 0: scalar.path.a, rank 1: scalar.path.b" in text


def test_engine_follows_the_launcher_and_refuses_a_mismatch():
    from hvd_partialfc.config import ConfigError
    from hvd_partialfc.engine.select import choose_engine, detect_launcher
    torchrun = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "TORCHELASTIC_RUN_ID": "x"}
    assert detect_launcher(torchrun) == "torchrun" and choose_engine("auto", torchrun) == "torch"
    from hvd_partialfc.engine.select import horovod_installed
    installed = horovod_installed()
    for horovod_launch in ({"HOROVOD_RANK": "1", "HOROVOD_SIZE": "2"}, {"OMPI_COMM_WORLD_RANK": "0"}):
        if installed:
            assert choose_engine("auto", horovod_launch) == "horovod"
        else:                                                  # a torch-only install: said, not a crash
            with pytest.raises(ConfigError, match="Horovod is not installed"):
                choose_engine("auto", horovod_launch)
    assert choose_engine("auto", {}) == ("horovod" if installed else "torch")   # alone: Horovod where installed
    assert choose_engine("torch", {}) == "torch"                # alone: a world of one under either engine
    with pytest.raises(ConfigError, match="does not fit the launcher"):
        choose_engine("horovod", torchrun)
    with pytest.raises(ConfigError, match="does not fit the launcher"):
        choose_engine("torch", {"OMPI_COMM_WORLD_RANK": "0"})


def _item(tor, name):
    """What each rank's ``train`` of the item returned and printed: [(code, text)] by rank."""
    return [(json.loads((tor / name / f"rank-{r}.result.json").read_text())["code"],
             (tor / name / f"rank-{r}.log").read_text()) for r in range(2)]


def test_explicit_engine_that_does_not_fit_is_an_error_before_any_work(shared):
    """``train.engine=horovod`` under torchrun: exit 2 on every rank with one line, before any work, and no
    traceback of ours (the shared torch launch's ``engine_mismatch``: each rank's ``train``)."""
    require_horovod()
    _, tor = shared
    for code, text in _item(tor, "engine_mismatch"):
        assert code == 2, text[-3000:]
        assert text.count("hvd-partialfc train: error: train.engine=horovod does not fit the launcher") == 1
        assert 'hvd_partialfc/' not in "".join(l for l in text.splitlines() if 'File "' in l)  # no traceback of ours
    assert not (tor / "engine_mismatch" / "run").exists()


def test_an_error_on_one_rank_at_start_is_agreed_by_every_rank(shared):
    """Bad input on rank 1 only (bytes of its shard changed; ``data.verify_sha256``): every rank ends on the
    failure agreed at start-up, and rank 0 reports it once (the shared torch launch's ``agreed_error``: each
    rank's ``train`` returns the error, and the items after it still run on the same engine). Under Horovod
    (Gloo and MPI) the same agreement is test_train_multirank.py's ``test_label_outside_slice_fails_on_every_rank*``;
    how fast ranks exit after a failure: test_reliability.py."""
    _, tor = shared
    (c0, t0), (c1, t1) = _item(tor, "agreed_error")
    assert c0 != 0 and c1 != 0      # every rank ends (a hang meets the launch's timeout)
    # agreed: rank 0 prints it, once for the job; every rank exits
    assert "[rank 0] error: RankFailure: 1 of 2 ranks failed at 'setup'" in t0, t0[-3000:]
    assert "[rank 1] error" not in t0 + t1, t1[-3000:]
    assert "  rank 1: " in t0 + t1 and "sha256" in t0 + t1
