"""Face ViTs: arcface_torch's ``vit_t`` .. ``vit_h`` (its WebFace42M recipes), weight-compatible with its files.

Every ``state_dict`` key and shape is that of arcface_torch's ``backbones/vit.py`` (``patch_embed.proj``,
``pos_embed``, ``mask_token``, ``blocks.N.{norm1,attn.qkv,attn.proj,norm2,mlp.fc1,mlp.fc2}``, ``norm``,
``feature.0..3``), so its ``backbone.pth`` files load with ``strict=True`` and an arcface_torch run imports
(tests/test_vit.py checks the key table and the parameter counts). The module code is this package's own.

* Tokens: 9x9 patches of the 112x112 face, each embedded by a 9x9 stride-9 convolution: 12x12 = 144
  tokens (the last 4 px rows and columns are not seen, as in arcface_torch), plus a learned position each;
  no class token.
* Masking (``mask_ratio``, training only): each sample keeps a random ``int(144 x (1 - ratio))`` of its
  tokens for the blocks; after the final LayerNorm the dropped places get the learned ``mask_token``, so the
  head always sees 144 tokens. The draw is ``torch.rand(B, 144)`` ranked, as arcface_torch's.
* Blocks (pre-norm): x + DropPath(Attention(LN(x))), x + DropPath(MLP(LN(x))); attention with ``heads``
  heads, qkv without bias, scale head_dim^-1/2 (``scaled_dot_product_attention``: the fused kernels on a
  GPU); MLP 4x wide with ReLU6. Stochastic depth rises linearly from 0 to ``drop_path`` over the blocks.
* Head: the 144 normalised tokens flattened, Linear(144 E -> E, no bias), BN1d, Linear(E -> D, no bias),
  BN1d (eps 2e-5), in fp32.
* Precision: the blocks follow the trainer's autocast (``train.precision``), attention included;
  arcface_torch forces its projections and MLPs to fp16 and its attention to fp32 whatever its ``fp16``
  says. Same weights, other rounding: outputs agree to float error, not bitwise.
* ``checkpoint_activations``: each block is a checkpoint segment (``recompute.run_segment``; its drop-path
  draw is replayed). arcface_torch checkpoints vit_b, vit_l and vit_h always (``config --from-arcface``
  sets it for them).
* Initialisation as arcface_torch's: linear weights, ``pos_embed`` truncated normal (std 0.02, cut at +-2),
  biases 0, LayerNorms 1 and 0, ``mask_token`` normal (std 0.02), the patch convolution torch's default.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .model_registry import register_variant
from .recompute import run_segment

PATCH = 9
EPS_HEAD = 2e-5
# name: (embedding width E, blocks, heads, drop_path, mask_ratio, checkpointed by arcface_torch)
VARIANTS = {"vit_t": (256, 12, 8, 0.1, 0.1, False), "vit_t_dp005_mask0": (256, 12, 8, 0.05, 0.0, False),
            "vit_s": (512, 12, 8, 0.1, 0.1, False), "vit_s_dp005_mask_0": (512, 12, 8, 0.05, 0.0, False),
            "vit_b": (512, 24, 8, 0.1, 0.1, True), "vit_b_dp005_mask_005": (512, 24, 8, 0.05, 0.05, True),
            "vit_l_dp005_mask_005": (768, 24, 8, 0.05, 0.05, True), "vit_h": (1024, 48, 8, 0.1, 0.0, True)}


def drop_path(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Stochastic depth: each sample's residual branch dropped with probability ``p``, kept ones scaled by 1/(1-p)."""
    if p == 0.0 or not training:
        return x
    keep = 1.0 - p
    mask = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(keep)
    return x * mask / keep


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)   # (B, h, n, d/h)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.ReLU6()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, drop_path: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, 4 * dim)
        self.drop_path = drop_path

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + drop_path(self.attn(self.norm1(x)), self.drop_path, self.training)
        return x + drop_path(self.mlp(self.norm2(x)), self.drop_path, self.training)


class PatchEmbed(nn.Module):
    def __init__(self, size: int, in_channels: int, dim: int):
        super().__init__()
        self.proj = nn.Conv2d(in_channels, dim, PATCH, stride=PATCH)
        self.tokens = (size // PATCH) ** 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)                     # (B, tokens, E)


class FaceViT(nn.Module):
    def __init__(self, dim: int, depth: int, heads: int, drop_path: float = 0.0, mask_ratio: float = 0.0,
                 embedding_dim: int = 512, size: int = 112, in_channels: int = 3,
                 checkpoint_activations: bool = False):
        super().__init__()
        if dim % heads:
            raise ValueError(f"vit: width {dim} is not a multiple of heads {heads}")
        if not 0.0 <= mask_ratio < 1.0:
            raise ValueError(f"vit: mask_ratio {mask_ratio} must be in [0, 1)")
        self.patch_embed = PatchEmbed(size, in_channels, dim)
        n = self.tokens = self.patch_embed.tokens
        self.pos_embed = nn.Parameter(torch.zeros(1, n, dim))
        self.mask_ratio = mask_ratio
        rates = torch.linspace(0, drop_path, depth, device="cpu").tolist()     # (a meta-device build too)
        self.blocks = nn.Sequential(*(Block(dim, heads, r) for r in rates))
        self.norm = nn.LayerNorm(dim)
        self.feature = nn.Sequential(nn.Linear(n * dim, dim, bias=False), nn.BatchNorm1d(dim, eps=EPS_HEAD),
                                     nn.Linear(dim, embedding_dim, bias=False),
                                     nn.BatchNorm1d(embedding_dim, eps=EPS_HEAD))
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.embedding_dim = embedding_dim
        self.checkpoint_activations = checkpoint_activations
        nn.init.normal_(self.mask_token, std=0.02)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x) + self.pos_embed                             # (B, N, E)
        b, n, d = x.shape
        keep = None
        if self.training and self.mask_ratio > 0:
            keep = torch.rand(b, n, device=x.device).argsort(dim=1)[:, :int(n * (1 - self.mask_ratio))]
            x = x.gather(1, keep.unsqueeze(-1).expand(-1, -1, d))             # (B, kept, E)
        for block in self.blocks:
            x = run_segment(block, x, self.checkpoint_activations)
        with torch.autocast(x.device.type, enabled=False):
            x = self.norm(x.float())
            if keep is not None:                  # the dropped places: the mask token, not normalised
                full = self.mask_token.expand(b, n, d).to(x.dtype)
                x = full.scatter(1, keep.unsqueeze(-1).expand(-1, -1, d), x)
            return self.feature(x.reshape(b, n * d))                          # (B, D) in fp32


def vit_input(name: str, in_shape) -> tuple:
    """(size, channels) of a square sample shape whose side holds at least one 9 px patch."""
    shape = [int(s) for s in in_shape]
    if len(shape) not in (2, 3) or shape[0] != shape[1] or shape[0] < PATCH:
        raise ValueError(f"{name} takes square images (112,112,3 for arcface_torch's weights), got {shape}")
    return shape[0], 1 if len(shape) == 2 else shape[2]


def _register(name: str) -> None:
    dim, depth, heads, dp, mask, _ = VARIANTS[name]

    def build(in_shape=(112, 112, 3), embedding_dim: int = 512, drop_path: float = dp, mask_ratio: float = mask,
              depth: int = depth, checkpoint_activations: bool = False) -> nn.Module:
        size, channels = vit_input(name, in_shape)
        return FaceViT(dim, depth, heads, drop_path, mask_ratio, embedding_dim, size, channels, checkpoint_activations)
    register_variant(name, build, f"arcface_torch's {name}: width {dim}, {depth} blocks, {heads} heads, drop path "
                                  f"{dp}, mask ratio {mask} (``depth``: fewer blocks for a CPU-sized test).")


for _name in VARIANTS:
    _register(_name)
