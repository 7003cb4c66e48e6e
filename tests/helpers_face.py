"""The published arcface_torch layouts as (key, shape) tables, written from the architecture description,
independently of hvd_partialfc.models: what a ``backbone.pth`` of arcface_torch holds."""
from __future__ import annotations

from typing import List, Tuple

import pytest
import torch

Table = List[Tuple[str, tuple]]
BN = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")


def bn(prefix: str, c: int) -> Table:
    return [(f"{prefix}.{k}", () if k == "num_batches_tracked" else (c,)) for k in BN]


def iresnet_table(layers, emb: int = 512) -> Table:
    """conv1, bn1, prelu; layerN.K.{bn1, conv1, bn2, prelu, conv2, bn3, downsample.0/.1 (first block)};
    bn2; fc (512*7*7 -> emb); features (BN1d)."""
    t: Table = [("conv1.weight", (64, 3, 3, 3))] + bn("bn1", 64) + [("prelu.weight", (64,))]
    cin = 64
    for i, (planes, n) in enumerate(zip((64, 128, 256, 512), layers)):
        for j in range(n):
            p = f"layer{i + 1}.{j}"
            c = cin if j == 0 else planes
            t += bn(f"{p}.bn1", c) + [(f"{p}.conv1.weight", (planes, c, 3, 3))] + bn(f"{p}.bn2", planes)
            t += [(f"{p}.prelu.weight", (planes,)), (f"{p}.conv2.weight", (planes, planes, 3, 3))]
            t += bn(f"{p}.bn3", planes)
            if j == 0:  # every stage starts with stride 2: a 1x1 conv + BN shortcut
                t += [(f"{p}.downsample.0.weight", (planes, c, 1, 1))] + bn(f"{p}.downsample.1", planes)
        cin = planes
    t += bn("bn2", 512) + [("fc.weight", (emb, 512 * 7 * 7)), ("fc.bias", (emb,))] + bn("features", emb)
    return t


def _conv_block(p: str, cin: int, cout: int, k: int, groups: int = 1, act: bool = True) -> Table:
    t = [(f"{p}.layers.0.weight", (cout, cin // groups, k, k))] + bn(f"{p}.layers.1", cout)
    return t + ([(f"{p}.layers.2.weight", (cout,))] if act else [])


def _depthwise(p: str, cin: int, cout: int, groups: int) -> Table:
    return (_conv_block(f"{p}.layers.0", cin, groups, 1) + _conv_block(f"{p}.layers.1", groups, groups, 3, groups)
            + _conv_block(f"{p}.layers.2", groups, cout, 1, act=False))


def mbf_table(emb: int = 512, blocks=(1, 4, 6, 2), scale: int = 2) -> Table:
    """get_mbf: layers.0 ConvBlock(3, 64s, 3x3 s2); layers.1 ConvBlock(64s, 64s, groups 64) (blocks[0] == 1);
    DepthWise(64s, 64s, g128); Residual(64s, blocks[1], g128); DepthWise(64s, 128s, g256);
    Residual(128s, blocks[2], g256); DepthWise(128s, 128s, g512); Residual(128s, blocks[3], g256);
    conv_sep ConvBlock(128s, 512); features GDC: LinearBlock(512, 512, g512, 7x7), Flatten, Linear, BN1d."""
    a, b = 64 * scale, 128 * scale
    assert blocks[0] == 1
    t = _conv_block("layers.0", 3, a, 3) + _conv_block("layers.1", a, a, 3, groups=64)
    t += _depthwise("layers.2", a, a, 128)
    t += sum((_depthwise(f"layers.3.layers.{k}", a, a, 128) for k in range(blocks[1])), [])
    t += _depthwise("layers.4", a, b, 256)
    t += sum((_depthwise(f"layers.5.layers.{k}", b, b, 256) for k in range(blocks[2])), [])
    t += _depthwise("layers.6", b, b, 512)
    t += sum((_depthwise(f"layers.7.layers.{k}", b, b, 256) for k in range(blocks[3])), [])
    t += _conv_block("conv_sep", b, 512, 1)
    t += _conv_block("features.layers.0", 512, 512, 7, groups=512, act=False)
    return t + [("features.layers.2.weight", (emb, 512))] + bn("features.layers.3", emb)


def vit_table(dim: int, depth: int, emb: int = 512, tokens: int = 144) -> Table:
    """arcface_torch's VisionTransformer (norm "ln", no class token), in state_dict order (the module's own
    parameters first): pos_embed, mask_token, patch_embed.proj (9x9 conv), blocks.K.{norm1, attn.qkv (no bias),
    attn.proj, norm2, mlp.fc1 (4x), mlp.fc2}, norm, feature.0..3 (Linear(tokens*dim, dim) no bias, BN1d,
    Linear(dim, emb) no bias, BN1d)."""
    t: Table = [("pos_embed", (1, tokens, dim)), ("mask_token", (1, 1, dim)),
                ("patch_embed.proj.weight", (dim, 3, 9, 9)), ("patch_embed.proj.bias", (dim,))]
    for k in range(depth):
        p = f"blocks.{k}"
        t += [(f"{p}.norm1.weight", (dim,)), (f"{p}.norm1.bias", (dim,)), (f"{p}.attn.qkv.weight", (3 * dim, dim)),
              (f"{p}.attn.proj.weight", (dim, dim)), (f"{p}.attn.proj.bias", (dim,)), (f"{p}.norm2.weight", (dim,)),
              (f"{p}.norm2.bias", (dim,)), (f"{p}.mlp.fc1.weight", (4 * dim, dim)), (f"{p}.mlp.fc1.bias", (4 * dim,)),
              (f"{p}.mlp.fc2.weight", (dim, 4 * dim)), (f"{p}.mlp.fc2.bias", (dim,))]
    t += [("norm.weight", (dim,)), ("norm.bias", (dim,)), ("feature.0.weight", (dim, tokens * dim))]
    return t + bn("feature.1", dim) + [("feature.2.weight", (emb, dim))] + bn("feature.3", emb)


def param_count(table: Table) -> int:
    """Parameters (not buffers) of a table: BN running statistics and counters excluded."""
    n = 0
    for key, shape in table:
        if not key.endswith(("running_mean", "running_var", "num_batches_tracked")):
            n += int(torch.Size(shape).numel())
    return n


def random_state(table: Table, seed: int = 0) -> dict:
    """An arcface_torch-format state dict with random values: weights ~ N(0, 0.05), BN scales near 1,
    positive running variances, counters as int64 scalars."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for key, shape in table:
        if key.endswith("num_batches_tracked"):
            out[key] = torch.tensor(1000 + len(out), dtype=torch.int64)
        elif key.endswith("running_var"):
            out[key] = torch.rand(shape, generator=g) + 0.5
        elif key.endswith("running_mean") or key.endswith(".bias"):
            out[key] = 0.1 * torch.randn(shape, generator=g)
        elif len(shape) == 1:  # BN / PReLU weights
            out[key] = 1.0 + 0.1 * torch.randn(shape, generator=g)
        else:
            out[key] = 0.05 * torch.randn(shape, generator=g)
    return out


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: on a shared 2-core machine two threads spin against the other processes
    (iresnet18's step at batch 2: 1 s with one thread, up to 15 s with two under load)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
