"""Streaming shard builds (data_tools/stream.py): memory that does not grow with the sample count,
kill + restart, parts + assemble, a changed input or option refused. Builds run as subprocesses of the
CLI, as a user runs them. The 1M-record build is behind ``-m bigbuild`` (docs/data.md §6)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from data_tools.bench_build import write_synthetic_rec
from hvd_partialfc.data.shards import read_manifest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_rec(prefix, n: int, classes: int, seed: int = 0) -> None:
    """``n`` 8x8 grey PNG records, labels drawn from ``classes`` (every class used), no header record."""
    write_synthetic_rec(str(prefix), n, classes, seed)


def cli(*args, env=None, **kw) -> subprocess.Popen:
    e = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID", "SLURM_ARRAY_TASK_ID"):
        e.pop(k, None)
    e.update(env or {})
    return subprocess.Popen([sys.executable, "-m", "data_tools.shards_cli", *[str(a) for a in args]], env=e,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def run_cli(*args, env=None):
    p = cli(*args, env=env)
    out, err = p.communicate(timeout=600)
    return p.returncode, out, err


PEAK = """
import resource, subprocess, sys
rc = subprocess.call(sys.argv[1:], stdout=subprocess.DEVNULL)
print(rc, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""


def peak_rss_mb(*args) -> float:
    """Peak RSS (MB) of the largest process of a CLI build (the build or one of its workers):
    ``getrusage(RUSAGE_CHILDREN).ru_maxrss`` in a fresh wrapper process, so earlier children do not count."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.check_output([sys.executable, "-c", PEAK, sys.executable, "-m", "data_tools.shards_cli",
                                   *[str(a) for a in args]], env=env, text=True, timeout=900)
    rc, kb = out.split()
    assert rc == "0", out
    return int(kb) / 1024


def shas(path):
    return [(s.file, s.sha256, s.num_samples) for s in read_manifest(str(path)).shards]


# --- memory --------------------------------------------------------------------------------------------------

def test_peak_rss_does_not_grow_with_the_sample_count(tmp_path):
    """10k -> 100k records (raw decode, 2 workers): the peak RSS grows by the index (~30 bytes/sample,
    2.7 MB) and not by the samples (the in-memory path grows by > 25 MB here: pixels, one RecordRef and
    label object per sample)."""
    peaks = {}
    for n in (10_000, 100_000):
        make_rec(tmp_path / f"r{n}", n, 1000, seed=n)
        peaks[n] = peak_rss_mb("build", "recordio", tmp_path / f"r{n}", "--out", tmp_path / f"o{n}",
                               "--num-shards", 8, "--workers", 2, "--store", "raw")
        assert read_manifest(str(tmp_path / f"o{n}")).num_samples == n
    print("peaks MB", peaks)
    assert peaks[100_000] - peaks[10_000] < 12, peaks


@pytest.mark.bigbuild
def test_one_million_records_bounded_rss(tmp_path):
    """1M 8x8 records, raw: peak RSS of the largest process under 200 MB (measured ~130 MB: 48 MB of
    imports + the index and plan; the in-memory path grows by ~0.77 KB/sample, ~800 MB here)."""
    make_rec(tmp_path / "big", 1_000_000, 10_000)
    t = time.perf_counter()
    peak = peak_rss_mb("build", "recordio", tmp_path / "big", "--out", tmp_path / "o", "--num-shards", 16,
                       "--workers", 2, "--store", "raw")
    seconds = time.perf_counter() - t
    assert read_manifest(str(tmp_path / "o")).num_samples == 1_000_000
    print(f"1M records: peak RSS {peak:.0f} MB, {seconds:.0f} s")
    assert peak < 200


# --- restart ---------------------------------------------------------------------------------------------------

def test_kill_and_restart_gives_the_same_shards(tmp_path):
    make_rec(tmp_path / "r", 12_000, 400)
    base = ["build", "recordio", tmp_path / "r", "--num-shards", 12, "--store", "raw", "--holdout", "0.25",
            "--holdout-shards", 2]
    assert run_cli(*base, "--out", tmp_path / "straight", "--workers", 2)[0] == 0
    out = tmp_path / "killed"
    tmp = tmp_path / ".tmp-killed-resumable"
    # killed at a point the build reports (after its 3rd shard), however fast the machine
    p = cli(*base, "--out", out, "--workers", 1, env={"HVD_PARTIALFC_BUILD_PAUSE": "3"})
    said = p.stdout.readline()
    assert said.startswith("build: paused after 3 shards"), said + p.stderr.read()[-2000:]
    p.send_signal(signal.SIGKILL)
    p.wait()
    done = sorted(f for f in os.listdir(tmp) if f.endswith(".done.json"))
    assert len(done) == 3 and not out.exists()
    # A changed option or input is refused, and leaves the finished shards alone.
    rc, _, err = run_cli(*base[:-1], 3, "--out", out, "--workers", 1)
    assert rc == 2 and "option holdout_shards" in err and "--overwrite" in err
    rc, stdout, err = run_cli(*base, "--out", out, "--workers", 2)
    assert rc == 0, err
    assert f"{len(done)} already done" in stdout
    assert "saved by an earlier run" in stdout                   # the index pass was not repeated
    assert shas(out) == shas(tmp_path / "straight")
    assert shas(tmp_path / "killed-holdout") == shas(tmp_path / "straight-holdout")
    assert (out / "manifest.json").read_bytes().replace(b"killed", b"straight") == \
        (tmp_path / "straight" / "manifest.json").read_bytes()
    assert sorted(os.listdir(out)) == sorted(os.listdir(tmp_path / "straight"))    # no build records left


def test_changed_input_is_refused_and_overwrite_starts_afresh(tmp_path):
    make_rec(tmp_path / "r", 2_000, 50)
    args = ["build", "recordio", tmp_path / "r", "--out", tmp_path / "o", "--num-shards", 4, "--workers", 1]
    tmp = tmp_path / ".tmp-o-resumable"
    # An unfinished build: part 1 of 2 only.
    assert run_cli(*args, "--part", "1/2")[0] == 0
    assert len([f for f in os.listdir(tmp) if f.endswith(".done.json")]) == 2
    make_rec(tmp_path / "r", 2_000, 50, seed=1)              # the input changes
    rc, _, err = run_cli(*args)
    assert rc == 2 and "index_sha256" in err and "other inputs or options" in err
    rc, _, err = run_cli(*args, "--overwrite")
    assert rc == 0, err
    rc, _, err = run_cli("inspect", tmp_path / "o")
    assert rc == 0, err


def test_damaged_finished_shard_is_rewritten_on_restart(tmp_path):
    make_rec(tmp_path / "r", 2_000, 50)
    args = ["build", "recordio", tmp_path / "r", "--out", tmp_path / "o", "--num-shards", 4, "--workers", 1]
    assert run_cli(*args, "--part", "1/2")[0] == 0
    shard = tmp_path / ".tmp-o-resumable" / "shard-00000-of-00004.h5"
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF                                       # same size, other sha256
    shard.write_bytes(bytes(data))
    (tmp_path / ".tmp-o-resumable" / "index.npz").write_bytes(b"damaged")   # recomputed, not trusted
    rc, stdout, err = run_cli(*args)
    assert rc == 0, err
    assert "wrote 3 shards" in stdout and "1 already done" in stdout and "saved by" not in stdout
    assert run_cli("inspect", tmp_path / "o")[0] == 0


# --- parts ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("store", ["raw", "encoded"])
def test_parts_and_assemble_equal_one_process(tmp_path, store):
    make_rec(tmp_path / "r", 5_000, 120)
    base = ["build", "recordio", tmp_path / "r", "--num-shards", 6, "--store", store, "--holdout", "0.2",
            "--balance", "samples"]
    assert run_cli(*base, "--out", tmp_path / "one", "--workers", 2)[0] == 0
    rc, _, err = run_cli("assemble", tmp_path / "two")
    assert rc == 2 and "no unfinished build" in err
    rc, stdout, err = run_cli(*base, "--out", tmp_path / "two", "--workers", 1, "--part", "1/2")
    assert rc == 0 and "assemble" in stdout and not (tmp_path / "two").exists(), err
    rc, _, err = run_cli("assemble", tmp_path / "two")
    assert rc == 2 and "not written yet" in err
    # Part 2 from the launcher's environment (Open MPI rank 1 of 2), as under mpirun.
    rc, _, err = run_cli(*base, "--out", tmp_path / "two", "--workers", 1,
                         env={"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"})
    assert rc == 0, err
    rc, stdout, err = run_cli("assemble", tmp_path / "two")
    assert rc == 0, err
    assert shas(tmp_path / "two") == shas(tmp_path / "one")
    assert shas(tmp_path / "two-holdout") == shas(tmp_path / "one-holdout")
    a = json.loads((tmp_path / "one" / "manifest.json").read_text().replace("/one", "/X"))
    b = json.loads((tmp_path / "two" / "manifest.json").read_text().replace("/two", "/X"))
    assert a == b
    assert a["source"]["holdout"]["path"] == "../X-holdout"      # relative to the set's folder, as build.build
    assert read_manifest(str(tmp_path / "two-holdout")).source["holdout_of"] == "../two"


def test_part_from_slurm_array():
    from data_tools.stream_plan import parse_part
    env = {"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_MIN": "4", "SLURM_ARRAY_TASK_COUNT": "3"}
    old = {k: os.environ.pop(k, None) for k in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID", *env)}
    try:
        os.environ.update(env)
        assert parse_part(None) == (2, 3)
        assert parse_part("3/4") == (3, 4)
        with pytest.raises(ValueError):
            parse_part("0/2")
    finally:
        for k in env:
            os.environ.pop(k, None)
        os.environ.update({k: v for k, v in old.items() if v is not None})


@pytest.mark.parametrize("store", ["raw", "encoded"])
def test_streaming_equals_the_in_memory_build(tmp_path, store):
    """Same renumbering, held-out classes, --balance slices, samples and labels as `build.build` (the
    in-memory path), for RecordIO and list sources; only the HDF5 write pattern (hence sha256) may differ."""
    import h5py
    from data_tools import build as B
    from data_tools.importers import get_importer
    make_rec(tmp_path / "r", 3_000, 90)
    lst = tmp_path / "l.lst"
    pngs = tmp_path / "png"
    pngs.mkdir()
    with open(lst, "w") as f:
        for i, b in enumerate(gray_pngs_for_list()):
            (pngs / f"{i}.png").write_bytes(b)
            f.write(f"png/{i}.png {['x', 'b', 'a10', 'a9'][i % 4]}\n")
    for fmt, src in (("recordio", tmp_path / "r"), ("list", lst)):
        holdout = 0.3 if fmt == "recordio" else 0.25
        ref = B.build(get_importer(fmt), str(src), B.BuildOptions(
            out=str(tmp_path / f"{fmt}-mem"), num_shards=3, balance="samples", store=store, holdout=holdout,
            holdout_shards=1, seed=3, progress=False))
        hold = ["--holdout", str(holdout)]
        rc, _, err = run_cli("build", fmt, src, "--out", tmp_path / f"{fmt}-st", "--num-shards", 3, "--balance",
                             "samples", "--store", store, "--holdout-shards", 1, "--seed", 3, "--workers", 2, *hold)
        assert rc == 0, err
        for suffix, m_ref in (("", ref["manifest"]), ("-holdout", ref["holdout"])):
            m = read_manifest(str(tmp_path / f"{fmt}-st{suffix}"))
            assert m.class_names == m_ref.class_names and m.partition == m_ref.partition
            assert [(s.file, s.label_start, s.label_end, s.num_samples) for s in m.shards] == \
                [(s.file, s.label_start, s.label_end, s.num_samples) for s in m_ref.shards]
            assert m.sample_shape == m_ref.sample_shape and m.kind == m_ref.kind
            for s in m.shards:
                with h5py.File(tmp_path / f"{fmt}-st{suffix}" / s.file) as a, \
                        h5py.File(tmp_path / f"{fmt}-mem{suffix}" / s.file) as b:
                    assert (a["labels"][:] == b["labels"][:]).all()
                    assert sorted(a.attrs) == sorted(b.attrs)
                    for x, y in zip(a[m.kind][:], b[m.kind][:]):
                        assert np.array_equal(x, y)


def gray_pngs_for_list():
    import io
    from PIL import Image
    out = []
    for i in range(12):
        buf = io.BytesIO()
        Image.fromarray(np.full((5, 7), i * 20, np.uint8)).save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


@pytest.mark.parametrize("labels", [["01", "1", "2", "10", "-3"], ["b", "a10", "a9", "b", "A"]])
def test_list_index_renumbers_as_the_in_memory_importer(tmp_path, labels):
    """Integer labels sort numerically and "01" == "1" (one class); names sort as strings."""
    from data_tools.build import renumber
    from data_tools.importers.listfile import import_list
    from data_tools.stream_index import index_list
    lst = tmp_path / "l.lst"
    lst.write_text("".join(f"img{i}.png {y}\n" for i, y in enumerate(labels)))
    ix = index_list(str(lst))
    dense, names = renumber(import_list(str(lst)).labels)
    assert ix.classes == names and ix.codes.tolist() == dense.tolist()
    assert [ix.path(i) for i in range(len(labels))] == [str(tmp_path / f"img{i}.png") for i in range(len(labels))]


def test_no_check_passes_encoded_bytes_through_undecoded(tmp_path):
    """``--store encoded`` decodes every image to check it unless ``--no-check``: then a broken image is kept
    as it is (bytes identical)."""
    import io
    from PIL import Image
    rng = np.random.default_rng(0)
    lines = []
    for i in range(12):
        p = tmp_path / f"img{i}.png"
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (8, 8), dtype=np.uint8)).save(buf, format="PNG")
        p.write_bytes(buf.getvalue() if i != 5 else b"not an image")
        lines.append(f"{p} {i % 3}\n")
    lst = tmp_path / "l.lst"
    lst.write_text("".join(lines))
    common = ["build", "list", lst, "--num-shards", "1", "--store", "encoded", "--size", "8", "--color", "gray",
              "--workers", "1"]
    rc, out, err = run_cli(*common, "--out", tmp_path / "checked")
    assert rc != 0 and "img5.png" in err
    rc, out, err = run_cli(*common, "--out", tmp_path / "raw-bytes", "--no-check")
    assert rc == 0, err
    import h5py
    with h5py.File(tmp_path / "raw-bytes" / "shard-00000-of-00001.h5", "r") as f:
        blobs = sorted(bytes(b) for b in f["encoded"][:])
    assert b"not an image" in blobs and len(blobs) == 12
