"""Pair files from elsewhere: ``.bin`` loads through the restricted unpickler (InsightFace's bins of every
Python and protocol load; a bin that asks for any other callable is refused before it runs), and every
unreadable pair file is an error naming the file and what to do. Plain pytest, no Horovod, no model."""
from __future__ import annotations

import io
import os
import pickle
import pickletools
import re
import struct

import numpy as np
import pytest
from PIL import Image

from hvd_partialfc.verification.evaluator import Evaluator
from data_tools.pair_sets import write_bin, write_pairs_h5
from hvd_partialfc.data.pair_files import PairSetError, read_pairs


def _images(n, size=16, seed=0):
    """Even images flat (a PNG under 256 bytes), odd ones noise (over 256): both py2 string opcodes."""
    rng = np.random.default_rng(seed)
    out = (rng.random((n, size, size)) * 255).astype(np.uint8)
    out[0::2] = out[0::2, :1, :1]
    return out


def _png(image):
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    return buf.getvalue()


def _py2_pickle(obj):
    """What Python 2's ``cPickle.dump(obj, f, 2)`` writes (memo opcodes left out) for tuples, lists, str
    (bytes here: SHORT_BINSTRING / BINSTRING), bools and numpy bools (``numpy.core.multiarray.scalar``
    of ``dtype('b1', 0, 1)`` and a one-byte str): the original InsightFace bins."""
    out = [b"\x80\x02"]                                                      # PROTO 2

    def emit(o):
        if isinstance(o, bytes):                                             # a Python 2 str
            out.append(b"U" + bytes([len(o)]) + o if len(o) < 256 else b"T" + struct.pack("<i", len(o)) + o)
        elif type(o) is bool:
            out.append(b"\x88" if o else b"\x89")                            # NEWTRUE / NEWFALSE
        elif isinstance(o, np.bool_):
            out.append(b"cnumpy.core.multiarray\nscalar\ncnumpy\ndtype\n")
            emit(b"b1")
            out.append(b"K\x00K\x01\x87R(K\x03")                             # dtype('b1', 0, 1), BUILD (3,
            emit(b"|")                                                       # '|', None x3, -1, -1, 0)
            out.append(b"NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb")
            emit(b"\x01" if o else b"\x00")
            out.append(b"\x86R")                                             # scalar(dtype, data)
        elif isinstance(o, tuple):
            out.append(b"(")
            for x in o:
                emit(x)
            out.append(b"t")
        elif isinstance(o, list):
            out.append(b"](")
            for x in o:
                emit(x)
            out.append(b"e")
        else:
            raise TypeError(type(o))
    emit(obj)
    out.append(b".")
    return b"".join(out)


def _ops(data):
    return {op.name for op, _, _ in pickletools.genops(data)}


# ------------------------------------------------------------------------------------ what must load

ISSAME = [k % 3 == 0 for k in range(10)]


@pytest.mark.parametrize("variant", ["py2", "py2-numpy-bools", "py3-protocol2", "py3-protocol4",
                                     "py3-protocol4-arrays", "py3-protocol5-arrays"])
def test_insightface_bins_of_every_python_and_protocol_load(tmp_path, variant):
    images = _images(20)
    blobs = [_png(im) for im in images]
    issame = [np.bool_(s) for s in ISSAME]                   # what a bin built from a numpy array holds
    if variant == "py2":
        data = _py2_pickle((blobs, list(ISSAME)))
        assert {"SHORT_BINSTRING", "BINSTRING"} <= _ops(data)
    elif variant == "py2-numpy-bools":
        data = _py2_pickle((blobs, issame))
        assert "GLOBAL" in _ops(data)
    elif variant.endswith("-arrays"):                        # uint8 arrays: _reconstruct, or _frombuffer at 5
        protocol = int(variant[len("py3-protocol")])
        data = pickle.dumps(([np.frombuffer(b, np.uint8) for b in blobs], np.array(ISSAME)), protocol=protocol)
    else:                                                    # bytes below protocol 3 need _codecs.encode
        data = pickle.dumps((blobs, issame), protocol=int(variant[-1]))
    path = tmp_path / "lfw.bin"
    path.write_bytes(data)
    ps = read_pairs(str(path))
    assert ps.name == "lfw" and ps.num_pairs == 10
    np.testing.assert_array_equal(ps.images, images)
    np.testing.assert_array_equal(ps.same, ISSAME)
    np.testing.assert_array_equal(ps.left, np.arange(0, 20, 2))


def test_write_bin_writes_what_insightface_writes(tmp_path):
    blobs = [_png(im) for im in _images(4)]
    write_bin(str(tmp_path / "w.bin"), blobs, [True, False])
    # a plain pickle of (list of bytes, list of bools): what InsightFace's load_bin unpickles
    assert pickle.loads((tmp_path / "w.bin").read_bytes()) == (blobs, [True, False])
    assert os.listdir(tmp_path) == ["w.bin"]                 # no temporary file left behind


# ------------------------------------------------------------------------------------ what must not

class _Open:
    """A pickle that opens (creates) a file when loaded: ``io.open(path, "w")``."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


class _System:
    """A pickle that runs a shell command when loaded: ``posix.system("touch path")``."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


@pytest.mark.parametrize("payload,asks", [(_Open, "io.open"), (_System, f"{os.system.__module__}.system")])
@pytest.mark.parametrize("protocol", [0, 2, 4])
def test_a_bin_holding_code_is_refused_before_it_runs(tmp_path, payload, asks, protocol):
    made = tmp_path / "made-by-the-pickle"
    path = tmp_path / "LFW.bin"
    blobs = [_png(im) for im in _images(2)]
    path.write_bytes(pickle.dumps((blobs + [payload(str(made))], [True]), protocol=protocol))
    with pytest.raises(PairSetError) as err:
        read_pairs(str(path))
    assert str(err.value) == (f"{path}: refused to load: the pickle asks for {asks}; a .bin pair file holds "
                              f"only lists of image bytes and bools")
    assert not made.exists()
    with pytest.raises(PairSetError, match="refused to load"):     # the loader training uses (rank 0)
        Evaluator([str(path)], every=0)
    assert not made.exists()


@pytest.mark.parametrize("obj,message", [
    ({"a": 1, "b": 2}, "holds a dict, not (images, issame)"),
    (([b"x", b"y"], [True], [False]), "holds a tuple, not (images, issame)"),
    ((b"xy", [True]), "the images are a bytes, not a list"),
    ((["not bytes", b"y"], [True]), "image 0 is a str, not encoded bytes"),
    (([b"x", b"y"], "T"), "the same/different flags are a str, not a list"),
    (([b"x", b"y"], [2]), "flag 0 is 2, not a bool"),
    (([b"x", b"y"], [0.5]), "flag 0 is 0.5, not a bool"),
    (([b"x", b"y", b"z"], [True]), "3 images for 1 pairs"),
    (([b"x", b"y"], [True]), "image 0 cannot be decoded"),
])
def test_a_bin_of_the_wrong_shape_is_a_clear_error(tmp_path, obj, message):
    path = tmp_path / "odd.bin"
    path.write_bytes(pickle.dumps(obj, protocol=4))
    with pytest.raises(PairSetError, match=f"^{re.escape(str(path))}: .*{re.escape(message)}"):
        read_pairs(str(path))


# ------------------------------------------------------------------------------------ damaged files

def _pair_files(tmp_path):
    images = _images(8)
    write_bin(str(tmp_path / "p.bin"), [_png(im) for im in images], [True, False, True, False])
    write_pairs_h5(str(tmp_path / "p.h5"), images, np.arange(8).reshape(4, 2), np.arange(4) % 2 == 0)
    return tmp_path / "p.bin", tmp_path / "p.h5"


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_damaged_pair_files_name_the_file_and_what_to_do(tmp_path, damage):
    binary, h5 = _pair_files(tmp_path)
    for path in (binary, h5):
        data = path.read_bytes()
        path.write_bytes(data[:len(data) // 2] if damage == "truncated" else os.urandom(len(data)))
    with pytest.raises(PairSetError, match=f"^{re.escape(str(binary))}: cannot read the .bin pair file .*truncated or not an "
                                           f"InsightFace pair pickle; download or write it again"):
        read_pairs(str(binary))
    with pytest.raises(PairSetError, match=f"^{re.escape(str(h5))}: cannot open pair set \\(h5py: .*\\); the file is truncated "
                                           f"or not HDF5; write it again with `hvd-partialfc-shards pairs`"):
        read_pairs(str(h5))


def test_a_missing_pair_file_names_the_path_to_check(tmp_path):
    for name in ("gone.bin", "gone.h5"):
        with pytest.raises(FileNotFoundError, match=f"^{re.escape(str(tmp_path / name))}: no such pair set file; check the path"):
            read_pairs(str(tmp_path / name))
