"""What a process that joins a running job does before it asks to join (launch/torch_inprocess.py, ``REJOIN``).

The members notice a join request at their next step, checkpoint, re-form with the newcomer and start their trainers
again at the new size; they wait for it in the first collective of that start. Whatever the newcomer still has to
do after asking is their pause, so it asks only once everything that does not depend on the group it joins is
done, while they train:

* the whole trainer imported (models, data, classifier, checkpoints, evaluation: most of a cold start);
* the shard set's manifest read and the runtime options checked (a user's mistake still fails the start);
* the backbone built on the CPU with its optimizer, and one forward, backward and optimizer step run on a small
  batch of the data's shape (torch's operators, its thread pool and allocator warmed; torch's first optimizer
  imports its compiler stack, seconds on a loaded host), then let go.

What the new layout decides comes after the re-form, as in any start: this rank's slice of the classes and its
shards (so its loader and its workers), the classifier and its optimizer state, the checkpoint the members write at
the agreed step (it does not exist yet when the newcomer asks). On a GPU the pass is not run: the device is agreed
with the group (engine/device.py) and a CUDA context opened before that could sit on another rank's GPU.
"""
from __future__ import annotations

import os
import time


def prepare_to_join(cfg) -> str:
    """Do the work above; a line saying what it took. Not a collective; a failure here is not reported (the start
    that follows the join meets it again and reports it as any start does)."""
    t0 = time.monotonic()
    from importlib import import_module
    for name in (".startup", "..engine.heartbeat"):     # the trainer's modules and cli_train's own
        import_module(name, __package__)
    import torch
    from . import startup
    from ..data.shards import read_manifest
    from ..engine.device import uses_cuda
    from ..models import create_model
    from ..classifier.optimizers import make_optimizer
    from .speed import resolve_fast_paths
    imported = time.monotonic() - t0
    try:
        manifest = read_manifest(cfg.data.shards)
        startup.check_runtime_options(cfg, manifest.kind)
        if uses_cuda(cfg.train.device):
            return f"imported the trainer in {imported:.2f} s (no warm-up pass on a GPU)"
        startup.set_threads(cfg, "cpu", int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        state = torch.random.get_rng_state()     # the run seeds its own streams; this leaves no trace anyway
        backbone = create_model(cfg.model.name, in_shape=list(manifest.sample_shape),
                                embedding_dim=cfg.model.embedding_dim, **cfg.model.kwargs)
        o, cpu = cfg.optim, torch.device("cpu")
        opt = make_optimizer(backbone.parameters(), o.name, o.backbone_lr, o.backbone_momentum,
                             o.backbone_weight_decay, kernel=resolve_fast_paths(cfg, cpu).backbone_kernel)
        backbone(torch.randn(2, *manifest.sample_shape)).sum().backward()
        opt.step()                               # torch's first optimizer imports its compiler stack: seconds
        torch.random.set_rng_state(state)
        del backbone, opt
    except Exception as e:                       # met again, and reported, by the start after the join
        return f"imported the trainer in {imported:.2f} s; warm-up skipped ({type(e).__name__}: {e})"
    warm = time.monotonic() - t0 - imported
    return f"imported the trainer in {imported:.2f} s, warmed the backbone up in {warm:.2f} s"
