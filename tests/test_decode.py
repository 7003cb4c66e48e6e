"""data.decode=gpu (data/device_decode.py), run here on the CPU: the workers send JPEG bytes and the flip
decisions, the batch is decoded and flipped where it is used. Against the CPU path (PIL in the workers) for
the same seed and batch index: the same samples, the same mirrors, the same normalisation; PNG and resized
sets through PIL; what falls back, what is an error; data.workers=-1; the GPU check's decode benchmark."""
import io
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from data_tools.bench_loader import run_gpu_decode
from data_tools.shard_writer import write_shard_set
from hvd_partialfc.config import ConfigError
from hvd_partialfc.config_io import load_config
from hvd_partialfc.data import device_decode as dd
from hvd_partialfc.data.augment import BatchAugment
from hvd_partialfc.data.loader import RankShardDataset, make_loader, prepare_batch, resolve_workers
from hvd_partialfc.data.partition import even_slices
from hvd_partialfc.data.shards import ShardError, decode_image
from conftest import launch_env
from helpers_face import one_thread  # noqa: F401  (autouse: one intra-op thread on the shared cores)

CPU = torch.device("cpu")
# torchvision's own tests accept a mean absolute difference below 2 levels (of 255) between its decoders
# and Pillow (test/test_image.py: test_decode_jpeg, libjpeg vs PIL; test_decode_jpegs_cuda, nvJPEG vs CPU)
MEAN_LEVELS = 2.0


def _faces(n, size, seed=0):
    """Smooth random colour images, not mirror-symmetric (a flip is visible)."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (n, 4, 4, 3)).astype(np.uint8)
    return np.stack([np.asarray(Image.fromarray(s).resize((size, size), Image.BICUBIC)) for s in small])


def _encode(images, fmt):
    out = []
    for img in images:
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format=fmt, **({"quality": 95} if fmt == "JPEG" else {}))
        out.append(np.frombuffer(buf.getvalue(), np.uint8))
    return out


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    """8 classes x 12 images in 2 shards: JPEG RGB 24x24, JPEG read as gray, PNG, and 28x28 JPEGs stored as 24x24."""
    d = tmp_path_factory.mktemp("decode")
    y = np.repeat(np.arange(8), 12)
    x24, x28 = _faces(96, 24), _faces(96, 28, seed=1)
    out = {}
    for name, blobs, shape in [("jpeg", _encode(x24, "JPEG"), [24, 24, 3]), ("gray", _encode(x24, "JPEG"), [24, 24]),
                               ("png", _encode(x24, "PNG"), [24, 24, 3]),
                               ("resized", _encode(x28, "JPEG"), [24, 24, 3])]:
        out[name] = str(d / name)
        write_shard_set(out[name], "encoded", blobs, y, even_slices(8, 2), 8, sample_shape=shape)
    return out


def _inputs(shards, decode, n=6, augment=("flip",), start=0, workers=0):
    ds = RankShardDataset(shards, 1, 2)
    loader, _ = make_loader(ds, 8, seed=3, workers=workers, start=start, augment=list(augment), decode=decode)
    it = iter(loader)
    out = [prepare_batch(*next(it), CPU, ds.kind) for _ in range(n)]
    del it, loader
    return out


@pytest.mark.parametrize("name", ["jpeg", "gray", "png", "resized"])
@pytest.mark.parametrize("augment,start", [(("flip",), 0), (("flip",), 5), ((), 0)])
def test_gpu_path_on_cpu_is_the_cpu_loader(sets, name, augment, start):
    """Batch k (from a fresh start or resumed at 5, so 2 epochs are crossed) under decode=gpu is batch k of the
    CPU path: same labels, same mirrors, same [-1, 1] input. Here torchvision cannot load (the CUDA wheel on a
    +cpu torch), so every sample goes through PIL: bitwise. With a loading torchvision: within its tolerance."""
    cpu, gpu = _inputs(sets[name], "cpu", augment=augment, start=start), \
        _inputs(sets[name], "gpu", augment=augment, start=start)
    exact = dd.torchvision_decoder()[0] is None
    for (x0, y0), (x1, y1) in zip(cpu, gpu):
        assert torch.equal(y0, y1) and x1.dtype == torch.float32 and x1.shape == x0.shape
        if exact:
            assert torch.equal(x0, x1)
        else:
            diff = (x1 - x0).abs().flatten(1).mean(1) * 127.5             # per image, in levels of 255
            assert float(diff.max()) < MEAN_LEVELS
            mirror = ((x1 - x0.flip(-1)).abs().flatten(1).mean(1) * 127.5)
            assert bool((diff < mirror).all())                           # the same flip decisions


def test_encoded_batches_cross_worker_processes(sets):
    """2 workers send EncodedBatch objects through the DataLoader's queues: the same inputs as 0 workers."""
    a, b = _inputs(sets["jpeg"], "gpu", n=4), _inputs(sets["jpeg"], "gpu", n=4, workers=2)
    assert all(torch.equal(x0, x1) and torch.equal(y0, y1) for (x0, y0), (x1, y1) in zip(a, b))


_INHERITED = r"""
import gc, os, sys
from hvd_partialfc.data.loader import RankShardDataset, make_loader
marks = sys.argv[2]


class Garbage:                   # the parent's unreachable cycle, with a finalizer (onnxruntime's joins threads)
    def __init__(self):
        self.me = self

    def __del__(self):
        with open(marks, "a") as f:
            f.write(f"{os.getpid()}\n")


gc.disable()
Garbage()
loader, _ = make_loader(RankShardDataset(sys.argv[1], 1, 2), 8, seed=3, workers=1)
next(iter(loader))               # a worker forked with the cycle uncollected
pid = os.fork()                  # and a fork of our own, whose collector runs at once
if pid == 0:
    gc.collect()
    os._exit(0)
os.waitpid(pid, 0)
gc.collect()                     # the parent collects its own
print(os.getpid(), pid)
"""


def test_a_loader_worker_never_collects_what_it_inherited(sets, tmp_path):
    """A forked worker that collected the parent's garbage ran its finalizers in the child: in the suite, an
    onnxruntime session left in a cycle by an earlier test was freed in a DataLoader worker, whose join of the
    session's threads (not copied by the fork) hung the worker and the test forever. After make_loader, a
    fork's collector leaves inherited cycles alone; the parent's collects them (finalized once, in it)."""
    marks = tmp_path / "finalized"
    marks.write_text("")
    p = subprocess.run([sys.executable, "-c", _INHERITED, sets["jpeg"], str(marks)], capture_output=True,
                       text=True, env=launch_env(), timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    parent, child = map(int, p.stdout.split())
    assert marks.read_text().split() == [str(parent)], (marks.read_text(), parent, child)


def test_flip_coins_are_the_cpu_flips():
    """BatchAugment.flip_coins(k, n) are the samples the CPU flip mirrors in batch k (independent check: which
    outputs equal the mirrored input)."""
    x = np.random.default_rng(0).integers(0, 256, (16, 5, 6, 3)).astype(np.uint8)
    aug = BatchAugment(["flip:p=0.3"], seed=7, rank=2)
    hits = 0
    for k in (0, 1, 10_006, 10_007):
        y = aug(k, x)
        mirrored = (y == x[:, :, ::-1]).reshape(16, -1).all(1)
        assert np.array_equal(aug.flip_coins(k, 16), mirrored)
        hits += int(mirrored.sum())
    assert 0 < hits < 64
    assert not BatchAugment([], 7, 2).flip_coins(3, 4).any()
    with pytest.raises(ValueError, match="data.augment has flip, blur"):
        BatchAugment(["flip", "blur"], 7, 2).flip_coins(0, 4)


def _pil_decoder(blobs, channels, device):
    """A stand-in for nvJPEG here: uint8 (C, H, W) at the image's own size, as torchvision returns it."""
    out = []
    for b in blobs:
        img = Image.open(io.BytesIO(b.numpy().tobytes())).convert("L" if channels == 1 else "RGB")
        out.append(torch.from_numpy(np.array(img)).reshape(img.height, img.width, channels).permute(2, 0, 1))
    return out


def test_decoder_branch_sizes_and_errors(sets):
    """Through a batched decoder (PIL standing in for nvJPEG): JPEGs of the stored size are its output, the
    28x28 ones are resized through PIL as the CPU path does; a JPEG the device refuses goes through PIL (the
    same pixels); one PIL cannot decode either is named (rank, file, sample)."""
    for name in ("jpeg", "resized"):
        ds = RankShardDataset(sets[name], 0, 2)
        src = dd.EncodedBatches(ds, BatchAugment(["flip"], 3, 0, "encoded"))
        batch, _ = src[(4, list(range(8)))]
        want, _ = prepare_batch(*make_loader(ds, 8, 3, augment=["flip"])[0].dataset[(4, list(range(8)))], CPU,
                                "encoded")
        assert torch.equal(dd.decode_batch(batch, CPU, decoder=_pil_decoder), want)
    blobs, _ = ds.read_stored([0, 1, 2])
    refused = len(blobs[2])                     # a whole JPEG the device refuses: PIL decodes it instead

    def strict(bs, channels, device):
        if any(len(b) < 100 or len(b) == refused for b in bs):
            raise RuntimeError("Not a JPEG file: starts with 0xff 0xd8")
        return _pil_decoder(bs, channels, device)
    whole = dd.EncodedBatch.pack(blobs, np.zeros(3, bool), [24, 24, 3], [ds.where(p) for p in (0, 1, 2)])
    assert torch.equal(dd.decode_batch(whole, CPU, decoder=strict), dd.decode_batch(whole, CPU, decoder=_pil_decoder))
    broken = [blobs[0], blobs[1][:40], blobs[2]]
    batch = dd.EncodedBatch.pack(broken, np.zeros(3, bool), [24, 24, 3], [ds.where(p) for p in (0, 1, 2)])
    with pytest.raises(ShardError, match=r"rank 0: .*shard-00000-of-00002.h5: sample 1 cannot be decoded \(OSError"):
        dd.decode_batch(batch, CPU, decoder=strict)


def test_choose_decode_falls_back_or_refuses(sets, monkeypatch):
    cuda = torch.device("cuda")          # a device object only: nothing runs on it
    ds = {k: RankShardDataset(v, 0, 2) for k, v in sets.items()}
    flip = BatchAugment(["flip"], 0, 0, "encoded")
    monkeypatch.setattr(dd, "torchvision_decoder", lambda: (_pil_decoder, ""))
    assert dd.choose_decode("cpu", cuda, ds["jpeg"], flip) == ("cpu", "")
    assert dd.choose_decode("gpu", cuda, ds["jpeg"], flip) == ("gpu", "")
    assert dd.choose_decode("gpu", cuda, ds["gray"], BatchAugment([], 0, 0, "encoded")) == ("gpu", "")
    for name, why in [("png", "PNG"), ("resized", "28x28, resized to 24x24")]:
        use, note = dd.choose_decode("gpu", cuda, ds[name], flip)
        assert use == "cpu" and why in note and "the CPU path" in note
    use, note = dd.choose_decode("gpu", CPU, ds["jpeg"], flip)
    assert use == "cpu" and "the training device is cpu" in note
    with pytest.raises(ValueError, match="data.augment has flip, jitter, which run on the CPU"):
        dd.choose_decode("gpu", cuda, ds["jpeg"], BatchAugment(["flip", "jitter"], 0, 0, "encoded"))
    monkeypatch.setattr(dd, "torchvision_decoder", lambda: (None, "torchvision does not load (ImportError: x)"))
    with pytest.raises(ValueError, match="needs torchvision .*ImportError: x.*data.decode=cpu"):
        dd.choose_decode("gpu", cuda, ds["jpeg"], flip)


def test_config_keys():
    cfg = load_config(None, ["data.shards=/x"])
    assert (cfg.data.decode, cfg.data.workers) == ("cpu", 0)
    assert load_config(None, ["data.shards=/x", "data.decode=gpu", "data.workers=-1"]).data.workers == -1
    with pytest.raises(ConfigError, match="data.decode='nvjpeg': expected one of cpu, gpu"):
        load_config(None, ["data.shards=/x", "data.decode=nvjpeg"])
    with pytest.raises(ConfigError, match="data.workers=-2"):
        load_config(None, ["data.shards=/x", "data.workers=-2"])
    assert load_config(None, ["data.shards=/x"]).data.batch_timeout == 600
    with pytest.raises(ConfigError, match="data.batch_timeout=-1.0: expected seconds > 0, or 0"):
        load_config(None, ["data.shards=/x", "data.batch_timeout=-1"])


def test_auto_workers(monkeypatch):
    """-1: the rank's cores minus one (its trainer), capped at 8; Slurm's per-task count when set."""
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    for cores, local, want in [(64, 8, 7), (128, 8, 8), (2, 2, 0), (2, 1, 1), (96, 8, 8), (48, 8, 5)]:
        monkeypatch.setattr("os.sched_getaffinity", lambda pid, c=cores: set(range(c)))
        assert resolve_workers(-1, local) == want
        assert resolve_workers(3, local) == 3
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "6")
    assert resolve_workers(-1, 8) == 5


@pytest.mark.skipif(dd.torchvision_decoder()[0] is None, reason="torchvision does not load here (PyPI's Linux "
                    "wheel is a CUDA build; a +cpu torch needs the CPU wheel): runs on the GPU check")
def test_torchvision_cpu_decode_against_pil(sets):
    """libjpeg-turbo through torchvision.io.decode_jpeg vs PIL on the shards' bytes: within MEAN_LEVELS."""
    decode, _ = dd.torchvision_decoder()
    ds = RankShardDataset(sets["jpeg"], 0, 2)
    blobs, _ = ds.read_stored(list(range(len(ds))))
    got = decode([torch.from_numpy(b) for b in blobs], 3, CPU)
    for b, img in zip(blobs, got):
        ref = torch.from_numpy(decode_image(b, [24, 24, 3])).permute(2, 0, 1)
        assert float((img.float() - ref.float()).abs().mean()) < MEAN_LEVELS


def test_gpu_decode_benchmark_cpu_path(tmp_path):
    """``bench_loader --gpu-decode``'s function on the CPU: the JSON the GPU check reads, its figures sane; on
    PIL (torchvision not loading) the two decodes' inputs are equal."""
    res = run_gpu_decode(str(tmp_path / "out"), 96, workers=0, seconds=0.05, device="cpu", batch_size=16)
    d = res["difference"]
    assert d["samples"] == 96 and (d["max_levels"] == 0 if d["decoder"].startswith("PIL") else
                                    d["worst_image_mean_levels"] < MEAN_LEVELS)
    assert [(r["decode"], r["workers"]) for r in res["rates"]] == [("cpu", 0), ("cpu", 1), ("gpu", 0), ("gpu", 1)]
    for r in res["rates"]:       # measure_loader_rate: a new loader each row, its warm-up excluded and reported
        assert r["samples_per_s"] > 0 and r["samples_per_cpu_s"] > 0 and r["batches_timed"] >= 1
        assert (r["warmup_batches"], r["input_shape"]) == (max(1, 2 * r["workers"]), [16, 3, 112, 112])
    assert (tmp_path / "out" / "gpu_decode.json").is_file()
