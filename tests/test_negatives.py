"""Cross-shard negatives (head.negatives_every): exchanged centres are frozen, the classifier stays local,
and the exchange works with uneven slice widths, under real horovodrun."""
import json
import os

import pytest

from conftest import MR, build_shards, make_feature_npz, run_hvd
from hvd_partialfc.config import ConfigError, load_config

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("share", [0, 2])
def test_exchange_uneven_slices_frozen_remote_local_classifier(tmp_path, share):
    # 5 classes on 2 ranks: slices [0, 3) and [3, 5) of different widths
    shards = build_shards(make_feature_npz(tmp_path / "f.npz", [12] * 5), tmp_path / "s", 2)
    out = tmp_path / "neg"
    run_hvd(2, [os.path.join(MR, "scenarios.py"), "negatives", shards, out, 5, share], timeout=120)
    r0, r1 = (json.load(open(out / f"rank-{r}.json")) for r in range(2))
    assert (r0["width"], r1["width"]) == (3, 2)
    # at steps 0, 2, 4 each rank received exactly the other rank's normalised centres (or `share` of them)
    assert r0["exchanges"] == [True, True, True] and r1["exchanges"] == [True, True, True]
    assert r0["remote_rows"] == 2 and r1["remote_rows"] == (3 if share == 0 else 2)
    # the remote centres are a buffer: no gradient ever reaches them
    assert not r0["remote_requires_grad"] and r0["remote_grad_is_none"]
    # rank 0's classifier (lr 0) never moved although its softmax saw rank 1's centres: local updates only
    assert r0["classifier_max_change"] == 0.0 and r1["classifier_max_change"] > 0
    assert r0["digest"] == r1["digest"]


def test_negatives_config_is_checked():
    # on by default in local mode (docs/accuracy.md picks K and the share); the other modes do not use it
    cfg = load_config(None, ["data.shards=/x"])
    assert (cfg.head.negatives_every, cfg.head.negatives_share) == (50, 1024)
    from hvd_partialfc.modes import GlobalSoftmaxHead, create_head
    from hvd_partialfc.partition import LabelSlice
    g = load_config(None, ["data.shards=/x", "head.mode=global"])
    assert type(create_head("global", LabelSlice(0, 0, 4), 8, 3, g.head, comm=None)) is GlobalSoftmaxHead
    with pytest.raises(ConfigError, match=">= 0"):
        load_config(None, ["data.shards=/x", "head.negatives_every=-1"])
