"""The GPU paths that a CPU can check, on a faked GPU node (torch.cuda's functions replaced by recording
fakes; no CUDA is started): which GPU a rank takes (engine/device.py), the refusal of ranks sharing one,
and the RNG codec's CUDA state in checkpoints (run/ckpt/checkpoint_files.py), old lists included."""
from __future__ import annotations

import os
import types

import pytest
import torch

from hvd_partialfc.config import ConfigError
from hvd_partialfc.config_io import load_config


class FakeGpus:
    """``n`` visible GPUs: ``torch.cuda``'s device and RNG functions, recording what is set."""

    def __init__(self, monkeypatch, n, current=0, uuids=None):
        self.n, self.current, self.set_devices, self.rng_sets = n, current, [], []
        self.uuids = uuids or [f"GPU-{i:04d}" for i in range(n)]
        cuda = torch.cuda
        for name, fn in {"is_available": lambda: n > 0, "is_initialized": lambda: True,
                         "device_count": lambda: n, "set_device": self.set_device,
                         "current_device": lambda: self.current,
                         "get_device_properties": lambda d: types.SimpleNamespace(uuid=self.uuids[_index(d)]),
                         "get_rng_state": self.get_rng_state, "set_rng_state": self.set_rng_state}.items():
            monkeypatch.setattr(cuda, name, fn)

    def set_device(self, i):
        self.set_devices.append(_index(i))
        self.current = _index(i)

    @staticmethod
    def state(i):
        """A stand-in for device i's generator state (a ByteTensor as CUDA's, marked by its device)."""
        return torch.full((16,), 100 + i, dtype=torch.uint8)

    def get_rng_state(self, device="cuda"):
        return self.state(self.current if device == "cuda" else _index(device))

    def set_rng_state(self, state, device="cuda"):
        self.rng_sets.append((state.clone(), self.current if device == "cuda" else _index(device)))


def _index(d):
    return d if isinstance(d, int) else (torch.device(d).index if torch.device(d).index is not None else 0)


def _comm(rank, local_rank):
    return types.SimpleNamespace(rank=rank, local_rank=local_rank)


def _cfg(device):
    return types.SimpleNamespace(train=types.SimpleNamespace(device=device))


def test_the_suite_runs_on_the_cpu():
    """conftest.py hides the GPUs from this process and from every job it launches (their environment is
    this one's); HVD_PARTIALFC_TEST_GPU=1 shows them, and then this CPU test is skipped."""
    from conftest import launch_env
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "" and launch_env()["CUDA_VISIBLE_DEVICES"] == ""
    assert not torch.cuda.is_available()


# --- which GPU ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("visible,want", [(1, 0), (4, 3)])
def test_the_one_visible_gpu_else_the_local_rank(monkeypatch, visible, want):
    """Local rank 3: with one GPU visible (Slurm --gpus-per-task=1, Kubernetes) cuda:0, with 4 cuda:3; the
    trainer's choice (startup.pick_device) and the torch engine's (torchdist.init) agree."""
    from hvd_partialfc.engine import torchdist
    from hvd_partialfc.run.startup import pick_device
    gpus = FakeGpus(monkeypatch, visible)
    cfg = _cfg("cuda")
    assert pick_device(cfg, _comm(3, 3)) == torch.device("cuda", want)
    assert gpus.set_devices == [want]
    # the torch engine alone (no RANK), local rank 3, its group faked (a CPU build has no NCCL)
    backends = []
    monkeypatch.setattr(torchdist.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(torchdist.dist, "init_process_group", lambda backend, **kw: backends.append(backend))
    for k in ("RANK", "WORLD_SIZE", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("LOCAL_RANK", "3")
    comm = torchdist.init("cuda")
    assert comm.device == torch.device("cuda", want) and gpus.set_devices[-1] == want
    assert backends == ["cpu:gloo,cuda:nccl"]


def test_a_local_rank_without_a_gpu_is_one_clear_error(monkeypatch):
    from hvd_partialfc.run.startup import pick_device
    gpus = FakeGpus(monkeypatch, 2)
    with pytest.raises(ConfigError, match=r"^rank 7 \(local rank 3\) has no GPU: 2 visible on this host; start at "
                                          r"most 2 ranks per node .*--gpus-per-task=1"):
        pick_device(_cfg("cuda"), _comm(7, 3))
    assert gpus.set_devices == []
    FakeGpus(monkeypatch, 0)
    with pytest.raises(ConfigError, match="train.device=cuda, but no GPU is visible"):
        pick_device(_cfg("cuda"), _comm(0, 0))
    assert pick_device(_cfg("auto"), _comm(0, 0)) == torch.device("cpu")


# --- ranks sharing a GPU --------------------------------------------------------------------------------

def _agreed(monkeypatch, uuids, rank, share_gpu=False, others=None):
    """``agreed_device`` on rank ``rank`` of len(uuids) ranks, each alone on its host's one visible GPU
    with that UUID; ``others``: what the other ranks contribute instead (an error of their own)."""
    from hvd_partialfc.engine.device import agreed_device
    FakeGpus(monkeypatch, 1, uuids=[uuids[rank]])

    def allgather(mine):
        assert mine == (None, ("node0", uuids[rank]))          # this rank's (error, (host, UUID))
        out = [(None, ("node0", u)) for u in uuids]
        for r, e in (others or {}).items():
            out[r] = (e, None)
        return out
    return agreed_device("cuda", rank, rank, len(uuids), share_gpu, allgather)


def test_ranks_sharing_a_gpu_are_refused_on_every_rank_unless_allowed(monkeypatch):
    monkeypatch.setattr("socket.gethostname", lambda: "node0")
    for rank in (0, 1, 2):
        with pytest.raises(ConfigError, match=r"^ranks share a GPU \(ranks 0, 2 on host node0, GPU GPU-a\): NCCL "
                                              r"refuses .* train.share_gpu=true"):
            _agreed(monkeypatch, ["GPU-a", "GPU-b", "GPU-a"], rank)
    assert _agreed(monkeypatch, ["GPU-a", "GPU-b", "GPU-a"], 1, share_gpu=True) == (torch.device("cuda", 0), True)
    assert _agreed(monkeypatch, ["GPU-a", "GPU-b", "GPU-c"], 2) == (torch.device("cuda", 0), False)
    # the same UUID on two hosts would be two GPUs (the host is part of the name)
    from hvd_partialfc.engine.device import sharing_error
    assert sharing_error([("node0", "GPU-a"), ("node1", "GPU-a")], allow=False) is None


def test_a_rank_without_a_gpu_fails_every_rank_with_its_message(monkeypatch):
    monkeypatch.setattr("socket.gethostname", lambda: "node0")
    with pytest.raises(ConfigError, match=r"^rank 1 \(local rank 1\) has no GPU"):
        _agreed(monkeypatch, ["GPU-a", "GPU-b"], 0, others={1: "rank 1 (local rank 1) has no GPU: ..."})


def test_the_torch_engine_checks_before_nccl_and_shares_over_gloo(monkeypatch):
    """torchdist.init at 2 ranks on one GPU: the identities go through an object all-gather (Gloo, on the
    host), the sharing is refused; with share_gpu the engine's collectives run on host tensors."""
    from hvd_partialfc.engine import torchdist
    FakeGpus(monkeypatch, 1)
    monkeypatch.setattr(torchdist.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(torchdist.dist, "get_world_size", lambda: 2)

    def all_gather_object(out, obj, group=None):
        out[:] = [obj, obj]                 # the other rank reports the same host and GPU
    monkeypatch.setattr(torchdist.dist, "all_gather_object", all_gather_object)
    for k, v in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError, match=r"ranks share a GPU \(ranks 0, 1 on host "):
        torchdist.init("cuda")
    assert torchdist.init("cuda", share_gpu=True).device == torch.device("cpu")


def test_share_gpu_is_a_resume_free_config_key():
    from hvd_partialfc.run.ckpt.resume import RESUME_FREE_KEYS
    assert load_config(None, ["data.shards=s", "train.share_gpu=true"]).train.share_gpu is True
    assert load_config(None, ["data.shards=s"]).train.share_gpu is False
    assert "train.share_gpu" in RESUME_FREE_KEYS


# --- the RNG codec's CUDA state -------------------------------------------------------------------------

@pytest.fixture
def cpu_streams():
    """The process's torch, numpy and Python streams, put back after (the codec sets them)."""
    import random
    import numpy as np
    saved = (torch.get_rng_state(), np.random.get_state(), random.getstate())
    yield
    torch.set_rng_state(saved[0]), np.random.set_state(saved[1]), random.setstate(saved[2])


def test_the_codec_saves_the_current_device_only_and_restores_onto_it(monkeypatch, cpu_streams, tmp_path):
    """Written on device 3 of 4 (one tensor), read back as a checkpoint is (weights_only), restored where one
    GPU is visible: onto device 0, the saved state."""
    from hvd_partialfc.run_files import load_file
    from hvd_partialfc.run.ckpt.checkpoint_files import rng_state, set_rng_state
    FakeGpus(monkeypatch, 4, current=3)
    state = rng_state()
    assert torch.is_tensor(state["cuda"]) and torch.equal(state["cuda"], FakeGpus.state(3))
    torch.save(state, tmp_path / "c.pt")
    gpus = FakeGpus(monkeypatch, 1)
    set_rng_state(load_file(str(tmp_path / "c.pt")))
    assert [(s.tolist(), d) for s, d in gpus.rng_sets] == [(FakeGpus.state(3).tolist(), 0)]


@pytest.mark.parametrize("visible,current,entries,want", [
    (4, 2, 4, 2),     # the same node: the current device's entry
    (1, 0, 4, 0),     # written with 4 visible, resumed with one per process: entry 0 on device 0
    (2, 1, 1, 0),     # fewer entries than the current index: the first
])
def test_old_checkpoints_lists_still_load(monkeypatch, cpu_streams, tmp_path, visible, current, entries, want):
    """A checkpoint of before (get_rng_state_all: one state per visible device, saved through a file) sets
    one state, onto the current device."""
    from hvd_partialfc.run_files import load_file
    from hvd_partialfc.run.ckpt.checkpoint_files import rng_state, set_rng_state
    FakeGpus(monkeypatch, 0)                         # the CPU part of the state, as saved then
    state = dict(rng_state(), cuda=[FakeGpus.state(i) for i in range(entries)])
    torch.save(state, tmp_path / "old.pt")
    gpus = FakeGpus(monkeypatch, visible, current=current)
    set_rng_state(load_file(str(tmp_path / "old.pt")))
    assert [(s.tolist(), d) for s, d in gpus.rng_sets] == [(FakeGpus.state(want).tolist(), current)]


def test_a_cpu_run_saves_and_sets_no_cuda_state(monkeypatch, cpu_streams):
    """CUDA available but not started (a CPU run on a GPU node): no CUDA state saved, none set."""
    from hvd_partialfc.run.ckpt.checkpoint_files import rng_state, set_rng_state
    gpus = FakeGpus(monkeypatch, 2)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    state = rng_state()
    assert "cuda" not in state
    set_rng_state(dict(state, cuda=FakeGpus.state(0)))
    assert gpus.rng_sets == []
