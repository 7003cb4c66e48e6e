"""Host synchronisations per training step, counted without a GPU.

On CUDA every read of a device value into Python (``.item()``, ``float()``, ``bool()``, ``tolist()``, ...)
and every operation whose output shape depends on the data (``nonzero``, ``unique``, boolean-mask indexing,
``torch.equal``) waits for the device's queue to drain. ``count_host_reads`` counts those calls during one
training step on CPU by wrapping them, so the count means on CPU what it will cost on a GPU.
"""
from __future__ import annotations

import contextlib
import os
from collections import Counter

import pytest
import torch

READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu")
OPS = ("nonzero", "unique", "masked_select", "equal", "allclose", "argwhere", "unique_consecutive",
       "repeat_interleave")


@contextlib.contextmanager
def count_host_reads():
    """A ``Counter`` of the synchronising calls made inside the block (name -> calls); ``counts.paused()``
    is a context in which nothing is counted."""
    counts: Counter = Counter()
    saved, paused = [], []

    def wrap(owner, name, key, only=None):
        fn = getattr(owner, name)
        saved.append((owner, name, fn, name in vars(owner)))

        def counted(*args, **kwargs):
            if not paused and (only is None or only(args)):
                counts[key] += 1
            return fn(*args, **kwargs)
        setattr(owner, name, counted)

    def bool_mask(args):   # x[mask], x[mask] = v: the mask's count of True decides the shape
        index = args[1] if len(args) > 1 else None
        index = index if isinstance(index, tuple) else (index,)
        return any(torch.is_tensor(i) and i.dtype == torch.bool for i in index)

    for name in READS:
        wrap(torch.Tensor, name, name)
    for name in OPS:
        wrap(torch, name, name)
        if hasattr(torch.Tensor, name):
            wrap(torch.Tensor, name, name)
    wrap(torch.Tensor, "__getitem__", "bool mask", bool_mask)
    wrap(torch.Tensor, "__setitem__", "bool mask", bool_mask)
    @contextlib.contextmanager
    def pause():
        paused.append(True)
        try:
            yield
        finally:
            paused.pop()
    counts.paused = pause
    try:
        yield counts
    finally:
        for owner, name, fn, own in reversed(saved):
            if own:
                setattr(owner, name, fn)
            else:                     # inherited (torch._C.TensorBase): uncover it again
                delattr(owner, name)


def test_the_counter_counts():
    t = torch.arange(4.0)
    before = dict(vars(torch.Tensor))
    with count_host_reads() as c:
        t.sum().item(), float(t[0]), bool((t > 1).any()), t[t > 1], torch.nonzero(t), t.tolist()
        t[torch.tensor([1, 2])], t + 1
    assert dict(c) == {"item": 1, "__float__": 1, "__bool__": 1, "bool mask": 1, "nonzero": 1, "tolist": 1}
    assert dict(vars(torch.Tensor)) == before                 # every wrapper taken off


def _trainer(shards, out, sets):
    from hvd_partialfc.config_io import load_config
    from hvd_partialfc.engine.local import LocalComm
    from hvd_partialfc.run.startup import start_trainer
    base = ["model.name=mlp", "model.embedding_dim=16", "model.kwargs={hidden_dim: 16}", "data.batch_size=8",
            "train.threads=1", "data.workers=0", "train.steps=4", "head.loss=arcface"]
    cfg = load_config(overrides=base + list(sets), extra={"data": {"shards": shards}, "out": str(out)})
    return start_trainer(cfg, LocalComm())


def step_reads(shards, out, sets, steps=3):
    """The synchronising calls of each of ``steps`` steps of a one-rank trainer (step 0 builds state)."""
    threads, rng = torch.get_num_threads(), torch.get_rng_state()
    try:
        trainer = _trainer(shards, out, sets)
        loader = iter(trainer.loader)
        per_step = []
        for step in range(steps):
            with count_host_reads() as c:
                def batches():   # the loader's sampler reads host tensors only (in workers on a GPU run)
                    while True:
                        with c.paused():
                            batch = next(loader)
                        yield batch
                trainer.train_step(step, batches())
            per_step.append(c)
        return per_step
    finally:
        torch.set_num_threads(threads)
        torch.set_rng_state(rng)


# The most synchronising calls one step may make (docs/gpu.md, "Speed on the GPU", lists them): the skip
# decision's one read of both gradient norms (none with train.skip_decision=device); sampled local when
# int(rate x width) < the batch: + the count of the batch's classes that sizes the sample; global: + the
# gather's row counts (host tensors).
DEVICE = ["train.skip_decision=device", "optim.backbone_kernel=fused", "optim.classifier_kernel=fused"]
LIMITS = {"local": ([], 1), "local, fp16": (["train.precision=fp16"], 1), "replicated": (["head.mode=replicated"], 1),
          "sampled local": (["head.sample_rate=0.5"], 1),
          "sampled local, lazy": (["head.sample_rate=0.5", "head.sampled_step=lazy"], 1),
          "sampled local, small sample": (["head.sample_rate=0.05"], 2),
          "global, sampled": (["head.mode=global", "head.sample_rate=0.5"], 2),
          # train.skip_decision=device: none; the norms reach the host by a copy into host memory, read a step later
          "local, fp16, device decision": (["train.precision=fp16", *DEVICE], 0),
          "replicated, device decision": (["head.mode=replicated", *DEVICE], 0)}


@pytest.mark.parametrize("case", list(LIMITS))
def test_host_synchronisations_per_step(case, feature_shards, tmp_path):
    sets, limit = LIMITS[case]
    for step, reads in enumerate(step_reads(feature_shards, tmp_path / "run", ["head.negatives_every=0"] + sets, 2)):
        assert sum(reads.values()) <= limit, (case, step, dict(reads))
