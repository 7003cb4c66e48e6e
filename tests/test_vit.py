"""arcface_torch's face ViTs (models/vit.py): key tables and parameter counts, the attention against its
formula, token masking and stochastic depth against an independent computation, activation checkpointing
bitwise, and a training run through the trainer."""
from __future__ import annotations

import glob
import json
import math

import numpy as np
import pytest
import torch

from conftest import build_shards, simulate_cli
from helpers_face import one_thread  # noqa: F401  (autouse fixture)
from helpers_face import param_count, random_state, vit_table
from hvd_partialfc.models import create_model
from hvd_partialfc.models.recompute import set_activation_checkpointing
from hvd_partialfc.models.vit import VARIANTS, drop_path

FACE = [112, 112, 3]
# Exact parameter counts at embedding 512 (arcface_torch's get_model(name, num_features=512) gives the same)
PARAMS = {"vit_t": 19_137_792, "vit_t_dp005_mask0": 19_137_792, "vit_s": 76_023_296, "vit_s_dp005_mask_0": 76_023_296,
          "vit_b": 113_833_472, "vit_b_dp005_mask_005": 113_833_472, "vit_l_dp005_mask_005": 255_684_352,
          "vit_h": 756_393_984}


def _table(model):
    return [(k, tuple(v.shape)) for k, v in model.state_dict().items()]


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_key_tables_and_parameter_counts(name):
    dim, depth = VARIANTS[name][:2]
    with torch.device("meta"):
        model = create_model(name, in_shape=FACE, embedding_dim=512)
    assert _table(model) == vit_table(dim, depth, 512)
    assert sum(p.numel() for p in model.parameters()) == param_count(vit_table(dim, depth, 512)) == PARAMS[name]


def test_an_arcface_file_loads_strictly_and_embeds():
    model = create_model("vit_t", in_shape=FACE, embedding_dim=64, depth=2)
    state = random_state(vit_table(256, 2, 64))
    model.load_state_dict(state, strict=True)
    for key in ("blocks.1.attn.qkv.weight", "pos_embed", "feature.3.running_var", "mask_token"):
        assert torch.equal(model.state_dict()[key], state[key])
    out = model.eval()(torch.rand(3, 3, 112, 112))
    assert out.shape == (3, 64) and out.dtype == torch.float32 and torch.isfinite(out).all()
    with pytest.raises(ValueError, match="square"):
        create_model("vit_t", in_shape=[112, 96, 3], embedding_dim=64)


def test_attention_is_the_softmax_formula():
    torch.manual_seed(0)
    attn = create_model("vit_t", in_shape=FACE, embedding_dim=8, depth=1).blocks[0].attn
    x = torch.randn(2, 144, 256, dtype=torch.float64)
    attn = attn.double()
    q, k, v = attn.qkv(x).view(2, 144, 3, 8, 32).permute(2, 0, 3, 1, 4)
    w = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(32), dim=-1)
    want = attn.proj((w @ v).transpose(1, 2).reshape(2, 144, 256))
    assert torch.allclose(attn(x), want, atol=1e-12)


def test_masking_keeps_a_random_share_and_puts_the_mask_token_back():
    """Training: the blocks see int(144 x 0.75) = 108 tokens of each sample, those the ranking of
    ``torch.rand(B, 144)`` keeps; the head sees the normalised kept tokens in place and the mask token in
    the others. Evaluation: all 144, no token replaced."""
    torch.manual_seed(0)
    model = create_model("vit_t", in_shape=FACE, embedding_dim=8, depth=1, mask_ratio=0.25, drop_path=0.0)
    seen, head_in = [], []
    model.blocks[0].register_forward_hook(lambda m, i, o: seen.append(i[0].shape))
    model.feature[0].register_forward_hook(lambda m, i, o: head_in.append(i[0].view(i[0].shape[0], 144, 256)))
    x = torch.rand(2, 3, 112, 112)
    torch.manual_seed(7)
    model.train()(x)
    torch.manual_seed(7)
    keep = torch.rand(2, 144).argsort(dim=1)[:, :108]
    assert seen[-1] == (2, 108, 256)
    token = model.mask_token.detach().view(256)
    for b in range(2):
        masked = {i for i in range(144) if torch.equal(head_in[-1][b, i], token)}
        assert masked == set(range(144)) - set(keep[b].tolist())
    model.eval()(x)
    assert seen[-1] == (2, 144, 256)
    assert not any(torch.equal(head_in[-1][b, i], token) for b in range(2) for i in range(144))


def test_drop_path_drops_whole_samples_and_rescales():
    torch.manual_seed(3)
    x = torch.rand(4000, 5) + 1
    y = drop_path(x, 0.25, True)
    kept = (y != 0).all(dim=1)
    assert torch.equal(kept, (y != 0).any(dim=1))               # a sample is kept or dropped whole
    assert torch.allclose(y[kept], x[kept] / 0.75)
    assert abs(kept.float().mean().item() - 0.75) < 0.03
    assert drop_path(x, 0.25, False) is x and drop_path(x, 0.0, True) is x


def test_activation_checkpointing_is_bitwise_with_masking_and_drop_path():
    """Each block recomputed in backward: the same drop-path draws (the checkpoint replays the random
    stream), so the outputs, gradients and BatchNorm buffers are bitwise those of the plain forward."""
    torch.manual_seed(0)
    plain = create_model("vit_t", in_shape=FACE, embedding_dim=16, depth=2, drop_path=0.5, mask_ratio=0.1)
    ckpt = create_model("vit_t", in_shape=FACE, embedding_dim=16, depth=2, drop_path=0.5, mask_ratio=0.1)
    ckpt.load_state_dict(plain.state_dict())
    x = torch.rand(3, 3, 112, 112) * 2 - 1
    results = []
    for model, on in ((plain, False), (ckpt, True)):
        set_activation_checkpointing(model, on)
        torch.manual_seed(11)
        out = model.train()(x)
        (out * torch.linspace(-1, 1, 16)).sum().backward()
        results.append((out.detach(), {k: p.grad for k, p in model.named_parameters()},
                        {k: b.clone() for k, b in model.named_buffers()}))
    (oa, ga, ba), (ob, gb, bb) = results
    assert torch.equal(oa, ob) and all(torch.equal(ga[k], gb[k]) for k in ga) and all(
        torch.equal(ba[k], bb[k]) for k in ba)
    assert all(g is not None for g in ga.values())


def test_a_vit_trains_through_the_trainer(tmp_path, capsys):
    """2 virtual ranks, 3 steps of vit_t (one block) with masking, drop path, block checkpointing and AdamW
    (arcface_torch's ViT recipes): the loss is finite, and the checkpoint's backbone is arcface_torch's key
    table, and every kind of its parameters moves between the first and the third step's checkpoint."""
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "faces.npz", images=rng.integers(0, 256, (16, 112, 112, 3)).astype(np.uint8),
             labels=np.repeat(np.arange(4), 4))
    shards = build_shards(tmp_path / "faces.npz", tmp_path / "shards", 2)
    rc, out = simulate_cli(capsys, 2, shards, tmp_path / "run", steps=3, sets=[
        "model.name=vit_t", "model.embedding_dim=32", "model.kwargs={depth: 1}", "model.checkpoint_activations=true",
        "optim.name=adamw", "optim.backbone_lr=0.001", "optim.classifier_lr=0.001", "data.batch_size=4",
        "head.negatives_every=0", "train.threads=1", "checkpoint.every=1", "checkpoint.keep=3"])
    assert rc == 0, out[-3000:]
    recs = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl") if '"loss"' in line]
    assert recs and all(np.isfinite(r["loss"]) for r in recs)
    ckpts = sorted(glob.glob(str(tmp_path / "run" / "checkpoints" / "*" / "backbone.pt")))
    assert len(ckpts) == 3, ckpts
    first, last = (torch.load(c, weights_only=True)["state_dict"] for c in (ckpts[0], ckpts[-1]))
    assert [(k, tuple(v.shape)) for k, v in last.items()] == vit_table(256, 1, 32)
    for key in ("blocks.0.attn.qkv.weight", "pos_embed", "mask_token", "patch_embed.proj.weight", "feature.2.weight"):
        assert not torch.equal(first[key], last[key]), key      # every kind of parameter is trained
