"""Any world size 1 <= N <= S on a set of S shards (elastic restarts): divisors keep today's blocks exactly,
other sizes get contiguous blocks of unequal shard counts with the least possible largest block (in
samples), N > S is an error; a checkpoint re-shards to such a layout and resumes on it, row for row."""
import itertools
import json
import os
import random
import shutil

import numpy as np
import pytest
import torch

from conftest import build_shards, make_feature_npz, simulate_here
from hvd_partialfc.data.layout import RankLayout
from hvd_partialfc.data.partition import LabelSlice, check_partition
from hvd_partialfc.data.shards import Manifest, ShardEntry, ShardError, rank_layout


def _shards(counts, widths=None):
    """Shard label slices (``widths`` classes each, default 3) and a manifest with ``counts`` samples each."""
    widths = widths or [3] * len(counts)
    bounds = np.concatenate([[0], np.cumsum(widths)]).tolist()
    slices = [LabelSlice(i, bounds[i], bounds[i + 1]) for i in range(len(counts))]
    entries = [ShardEntry(f"s{i}.h5", s.start, s.end, c, "") for i, (s, c) in enumerate(zip(slices, counts))]
    return slices, Manifest(bounds[-1], "features", [4], "float32", entries)


def _block_samples(layout, counts):
    return [sum(counts[i] for i in block) for block in layout.shard_blocks]


def _optimum_dp(counts, n):
    """The least possible largest block of n contiguous non-empty blocks: the textbook linear-partition DP
    (best[j][i]: first i shards in j blocks), independent of the binary search under test."""
    s, inf = len(counts), float("inf")
    prefix = np.concatenate([[0], np.cumsum(counts)]).tolist()
    best = [[inf] * (s + 1) for _ in range(n + 1)]
    best[0][0] = 0
    for j in range(1, n + 1):
        for i in range(j, s + 1):
            best[j][i] = min(max(best[j - 1][m], prefix[i] - prefix[m]) for m in range(j - 1, i))
    return best[n][s]


def _optimum_brute(counts, n):
    """The same by trying every set of n - 1 cut positions."""
    s = len(counts)
    return min(max(sum(counts[a:b]) for a, b in zip((0,) + cuts, cuts + (s,)))
               for cuts in itertools.combinations(range(1, s), n - 1))


def _check_blocks(layout, num_shards, n):
    """Blocks of consecutive shard indices, each non-empty, together every shard once, in rank order."""
    assert layout.world_size == n and len(layout.shard_blocks) == n
    assert all(len(b) >= 1 and list(b) == list(range(b[0], b[-1] + 1)) for b in layout.shard_blocks)
    assert [i for b in layout.shard_blocks for i in b] == list(range(num_shards))


@pytest.mark.parametrize("num_shards", [1, 6, 8, 12, 64])
def test_divisors_give_todays_blocks_whatever_the_counts(num_shards):
    rng = random.Random(num_shards)
    counts = [rng.randint(1, 1000) for _ in range(num_shards)]      # unbalanced: must not matter
    slices, manifest = _shards(counts)
    for n in (d for d in range(1, num_shards + 1) if num_shards % d == 0):
        k = num_shards // n
        layout = rank_layout(manifest, n)
        assert layout.shard_blocks == tuple(tuple(range(r * k, r * k + k)) for r in range(n))
        assert layout.slices == tuple(LabelSlice(r, 3 * r * k, 3 * (r + 1) * k) for r in range(n))
        assert RankLayout.from_shards(slices, n).shard_blocks == layout.shard_blocks    # no counts needed


def test_64_shards_on_24_ranks_balanced_by_samples():
    rng = random.Random(64)
    counts = [int(2000 / (1 + rng.random() * 20)) for _ in range(64)]   # long-tail-ish shard sizes
    slices, manifest = _shards(counts, [rng.randint(1, 9) for _ in range(64)])
    layout = rank_layout(manifest, 24)
    _check_blocks(layout, 64, 24)
    check_partition(list(layout.slices), manifest.num_classes)
    for sl, block in zip(layout.slices, layout.shard_blocks):   # a block's labels: its shards' ranges
        assert (sl.start, sl.end) == (slices[block[0]].start, slices[block[-1]].end)
    assert len({len(b) for b in layout.shard_blocks}) > 1          # unequal blocks
    assert max(_block_samples(layout, counts)) == _optimum_dp(counts, 24)
    assert rank_layout(manifest, 24) == layout                     # deterministic


def test_equal_shards_spread_the_slack():
    """64 equal shards on 24 ranks: the optimum is 3 shards a rank; the tie-break gives 16 blocks of 3 and
    8 of 2 (targets j x 64 / 24), never blocks of 1."""
    _, manifest = _shards([100] * 64)
    sizes = [len(b) for b in rank_layout(manifest, 24).shard_blocks]
    assert sorted(sizes) == [2] * 8 + [3] * 16


def test_small_cases_reach_the_brute_force_optimum():
    rng = random.Random(0)
    for _ in range(300):
        s = rng.randint(2, 9)
        n = rng.choice([d for d in range(2, s + 1) if s % d] or [s])
        counts = [rng.choice([0, 1, 5, rng.randint(0, 100)]) for _ in range(s)]
        slices, manifest = _shards(counts)
        layout = rank_layout(manifest, n)
        _check_blocks(layout, s, n)
        if s % n:
            assert max(_block_samples(layout, counts)) == _optimum_brute(counts, n), (counts, n)


def test_more_ranks_than_shards_is_an_error():
    _, manifest = _shards([10] * 6)
    with pytest.raises(ShardError, match="maximum world size is 6"):
        rank_layout(manifest, 7)
    with pytest.raises(ShardError, match="world size must be >= 1"):
        rank_layout(manifest, 0)


def test_non_contiguous_shards_in_an_uneven_block_are_refused():
    slices = [LabelSlice(0, 0, 3), LabelSlice(1, 3, 6), LabelSlice(2, 7, 9)]
    assert RankLayout.from_shards(slices, 2, [1, 1, 5]).shard_blocks == ((0, 1), (2,))   # the gap between blocks
    with pytest.raises(ValueError, match="shards 1 and 2 are not contiguous"):
        RankLayout.from_shards(slices, 2, [5, 1, 1])      # blocks [0], [1, 2]: the gap inside a block


# --- end to end: train on 2 ranks, resume on 4 and 5 (neither divides 6 shards) ---------------------------

BASE = ["model.name=mlp", "model.embedding_dim=8", "model.kwargs={hidden_dim: 16}", "data.batch_size=8",
        "train.log_every=50", "data.workers=0", "head.negatives_every=0", "train.threads=1"]
# 24 classes in 6 shards of 4 classes; samples per shard 40, 40, 120, 80, 40, 40
CLASS_COUNTS = [10] * 8 + [30] * 4 + [20] * 4 + [10] * 8


@pytest.fixture(scope="module")
def shards6(tmp_path_factory):
    d = tmp_path_factory.mktemp("any")
    return build_shards(make_feature_npz(d / "f.npz", CLASS_COUNTS, dim=8, seed=3), d / "s6", 6)


def _sim(ranks, shards, out, steps, *sets, timeout=60):
    """``simulate`` in this process (conftest.simulate_here); its last checkpoint."""
    from hvd_partialfc.config_io import load_config
    cfg = load_config(None, [*BASE, *sets, f"data.shards={shards}", f"out={out}", f"train.steps={steps}"])
    return simulate_here(cfg, ranks, timeout).checkpoint


def _rows(ckpt):
    """(slices, every classifier row, its momentum) of a checkpoint, read with the package's loaders."""
    from hvd_partialfc.run_files import load_file, read_meta
    meta = read_meta(ckpt)
    files = [load_file(os.path.join(ckpt, f), "classifier") for f in meta["classifier_files"]]
    assert [[f["label_start"], f["label_end"]] for f in files] == meta["slices"]
    weight = torch.cat([f["weight"] for f in files])
    momentum = torch.cat([f["optimizer"]["state"][0]["momentum_buffer"] for f in files])
    return meta["slices"], weight, momentum


def test_resume_on_a_world_size_that_does_not_divide_the_shards(shards6, tmp_path):
    from hvd_partialfc.data.shards import read_manifest
    from hvd_partialfc.run.ckpt.reshard import reshard_checkpoint
    manifest = read_manifest(shards6)
    assert [s.num_samples for s in manifest.shards] == [40, 40, 120, 80, 40, 40]
    first = _sim(2, shards6, tmp_path / "n2", 4)
    slices2, weight, momentum = _rows(first)
    assert slices2 == [[0, 12], [12, 24]]                     # 2 divides 6: today's blocks of 3
    # N = 4 at the checkpoint's step: nothing trains, the rows each rank loaded are saved as they are
    loaded = _sim(4, shards6, tmp_path / "n4", 4, f"checkpoint.resume={first}")
    slices4, w4, m4 = _rows(loaded)
    check_partition([LabelSlice(r, a, b) for r, (a, b) in enumerate(slices4)], 24)
    assert slices4 == [[0, 8], [8, 12], [12, 16], [16, 24]]   # shards [0, 1], [2], [3], [4, 5]: max 120 samples
    assert torch.equal(w4, weight) and torch.equal(m4, momentum)  # every rank's rows, bitwise
    # the offline re-sharding cuts the same slices and rows
    copy = reshard_checkpoint(first, str(tmp_path / "resharded4"), 4)
    assert _rows(copy)[0] == slices4 and torch.equal(_rows(copy)[1], weight)
    from hvd_partialfc.run_files import CheckpointError
    # meta.json records the shards' sample counts: no shard set needed; an older checkpoint (without them)
    # reads the manifest, and says why when it cannot
    assert json.load(open(os.path.join(first, "meta.json")))["shard_samples"] == [40, 40, 120, 80, 40, 40]
    again = reshard_checkpoint(first, str(tmp_path / "again4"), 4, shard_dir=str(tmp_path / "no-shards"))
    assert _rows(again)[0] == slices4
    old = tmp_path / "old-format"
    shutil.copytree(first, old)
    meta = json.load(open(old / "meta.json"))
    del meta["shard_samples"]
    (old / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="6 shards on 4 ranks .not a divisor.*cannot be read"):
        reshard_checkpoint(str(old), str(tmp_path / "nowhere"), 4, shard_dir=str(tmp_path / "no-shards"))
    with pytest.raises(CheckpointError, match="maximum world size is 6"):
        reshard_checkpoint(first, str(tmp_path / "nowhere"), 7)
    # train on: the same uneven layout resumes at its own size, and 5 ranks resume from 2 ranks' checkpoint
    on4 = _sim(4, shards6, tmp_path / "n4", 6, "checkpoint.resume=auto")
    # 2 more steps of 2 ranks' samples (run/progress.py) are 1 at 4 ranks
    assert on4.endswith("step-00000005") and _rows(on4)[0] == slices4
    on5 = _sim(5, shards6, tmp_path / "n5", 6, f"checkpoint.resume={first}")
    slices5, w5, _ = _rows(on5)
    check_partition([LabelSlice(r, a, b) for r, (a, b) in enumerate(slices5)], 24)
    assert len(slices5) == 5 and w5.shape == weight.shape and torch.isfinite(w5).all()
    assert not torch.equal(w5, weight)                        # it trained
