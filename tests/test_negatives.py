"""Cross-shard negatives (head.negatives_every): a remote column scores a feature as its owner does, the
exchanged centres are frozen, each classifier takes exactly its own update, and the exchange works with
uneven slice widths, under real horovodrun."""
import json
import pathlib

import pytest

import helpers_np2
from conftest import build_shards, make_feature_npz
from hvd_partialfc.config import ConfigError
from hvd_partialfc.config_io import load_config

pytestmark = pytest.mark.multirank


def _ranks(out, n=2):
    return [json.load(open(out / f"rank-{r}.json")) for r in range(n)]


STEP_CASES = [(0, "softmax", 0), (2, "arcface", 0), (0, "cosface", 3)]


def _np2_items(request, folder):
    """The module's scenarios, one item of the shared launch (tests/helpers_np2.py): ``logits``, then ``step``
    (5 steps) for each case of STEP_CASES on 5 classes over 2 ranks: slices [0, 3) and [3, 5) of different
    widths."""
    base = request.getfixturevalue("tmp_path_factory").mktemp("neg")
    shards = build_shards(make_feature_npz(base / "f.npz", [12] * 5), base / "s", 2)
    return [{"scenario": "all", "call": "negatives_scenarios.scenario_all",
             "args": [shards, folder("all"), 5, [f"{s}:{l}:{p}" for s, l, p in STEP_CASES]]}]


NP2_PART = helpers_np2.Part("negatives", fixture="np2", build=_np2_items, timeout=240)


@pytest.fixture(scope="module")
def np2(request):
    """The folder of the module's scenarios, run under ``horovodrun -np 2`` (Gloo) in the launch that
    tests/helpers_np2.py shares with the other files' two-rank work."""
    return pathlib.Path(helpers_np2.shared(request).done("all"))


def test_remote_columns_score_like_their_owner(np2):
    """Every loss, every share: rank r's logit for a remote class == the owner's logit for it, on the same
    features (softmax: x . w with the owner's raw row; cosface/arcface: s cos, scale included), and the
    fused forward (loss and gradients) == cross entropy over [own rows | the owners' raw rows]."""
    for r in _ranks(np2 / "logits"):
        assert sorted(r["cases"]) == sorted(f"{l}-share{s}" for l in ("softmax", "cosface", "arcface") for s in (0, 3))
        for name, c in r["cases"].items():
            assert c["remote_rows"] == (3 if name.endswith("share3") else 9 - 2 * r["rank"]), name
            assert c["match_min_cos"] > 1 - 1e-6, name                   # each column is one owner row
            assert c["logit_err"] <= 1e-5 * max(1.0, c["logit_scale"]), (name, c)
            # the fused forward == cross entropy over [own rows | the owners' raw rows]
            assert c["loss"] == pytest.approx(c["ref_loss"], rel=1e-5), (name, c)
            assert c["grad_x_err"] <= 1e-5 * max(1.0, c["grad_x_scale"]), (name, c)
            assert c["grad_w_err"] <= 1e-5 * max(1.0, c["grad_w_scale"]), (name, c)


@pytest.mark.parametrize("share,loss,pool", STEP_CASES)
def test_exchange_uneven_slices_frozen_remote_local_classifier(np2, share, loss, pool):
    """Training with negatives every 2 steps on uneven slices: each exchange delivers the other rank's raw
    centres (or its share, capped by the pool), they stay a frozen buffer, and step 0's updates are the
    offline ones (classifier: its own gradient / N, remote columns included; backbone: the ranks' mean)."""
    r0, r1 = _ranks(np2 / f"step-{share}-{loss}-{pool}")
    assert (r0["width"], r1["width"]) == (3, 2)
    # at steps 0, 2, 4 each rank received exactly the other rank's raw centres (or `share` of them; with
    # head.negatives_pool=3 at most ceil(3 / 2) = 2 of each, so rank 0's whole slice of 3 is capped)
    assert r0["exchanges"] == [True, True, True] and r1["exchanges"] == [True, True, True]
    assert r0["remote_rows"] == 2 and r1["remote_rows"] == (3 if share == 0 and pool == 0 else 2)
    # the remote centres are a buffer: no gradient ever reaches them
    for r in (r0, r1):
        assert r["remote_is_buffer"] and not r["remote_requires_grad"] and r["remote_grad_is_none"]
        # step 0's applied classifier update == the offline one from this rank's own gradient (over its own
        # rows and the owners' raw remote rows) / N; the remote columns change it (vs_bare), so this is
        # sensitive to how they are scored
        assert r["classifier_update_max_abs_err"] < 1e-6, r
        assert r["classifier_update_vs_bare"] > 1e-4 and r["classifier_update_size"] > 1e-3
        # ... and the backbone's == the offline mean of both ranks' gradients
        assert r["update_max_abs_err"] < 1e-5
    assert r0["digest"] == r1["digest"]


def test_negatives_config_is_checked():
    # on by default in local mode (docs/accuracy.md picks K and the share); the other modes do not use it
    cfg = load_config(None, ["data.shards=/x"])
    assert (cfg.head.negatives_every, cfg.head.negatives_share, cfg.head.negatives_pool) == (50, 1024, 8192)
    from hvd_partialfc.classifier.negatives import negatives_share
    # the share is capped at ceil(pool / N): 1,024 a rank up to N=8, then the pool divided (what a rank
    # receives stays ~8,192 rows), never more than the slice; pool 0: no cap; share 0: the whole slice
    assert [negatives_share(3095, n, 1024, 8192) for n in (2, 8, 64, 256)] == [1024, 1024, 128, 32]
    assert negatives_share(97, 256, 1024, 100000) == 97 and negatives_share(5000, 256, 1024, 0) == 1024
    assert negatives_share(5000, 64, 0, 8192) == 128 and negatives_share(5000, 64, 0, 0) == 5000
    from hvd_partialfc.data.layout import RankLayout
    from hvd_partialfc.classifier.heads import GlobalSoftmaxHead
    from hvd_partialfc.classifier.modes import get_mode
    g = load_config(None, ["data.shards=/x", "head.mode=global", "model.embedding_dim=3"])
    assert type(get_mode("global").create_head(g, RankLayout.even(8, 2), 0, None)) is GlobalSoftmaxHead
    with pytest.raises(ConfigError, match=">= 0"):
        load_config(None, ["data.shards=/x", "head.negatives_every=-1"])
    with pytest.raises(ConfigError, match=">= 0"):
        load_config(None, ["data.shards=/x", "head.negatives_pool=-1"])


def test_start_of_run_line_counts_bytes_sent_and_received():
    """The line a run prints at its start (``CrossShardNegativesHead.describe``) against the arithmetic of
    docs/scaling.md: rank r hands in its share and receives every rank's, each S x D x 4 bytes, every K
    steps; against the gradient's allreduce, handed in and received (2 x its bytes)."""
    import re
    from types import SimpleNamespace
    from hvd_partialfc.classifier.modes import CrossShardNegativesHead
    widths = [388] * 63 + [374]                 # 24,818 classes on 64 ranks, the last slice narrower
    comm = SimpleNamespace(rank=63, size=64)    # describe() reads rank and size only: no collective runs
    head = CrossShardNegativesHead(374, 128, 24_444, comm, every=50, share=1024, slice_widths=widths,
                                   pool=8192, loss="softmax")
    line = head.describe(backbone_grad_bytes=2_277_632)
    sent, received = 128 * 128 * 4, 64 * 128 * 128 * 4                # ceil(8192 / 64) = 128 rows a rank
    per_step = (sent + received) / 50
    assert "128 of 374 centres shared per rank, 8064 remote centres held (3.9 MB)" in line, line
    assert f"{per_step:,.0f} B/step" in line, line
    pct = float(re.search(r"= ([0-9.]+)% of the backbone", line).group(1))
    assert pct == pytest.approx(100 * per_step / (2 * 2_277_632), abs=0.005), line
