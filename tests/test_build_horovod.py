"""The Horovod build's decisions (scripts/setup/horovod_build_env.py) on fake inputs: ``horovodrun --check-build`` as
Horovod 0.28.1 prints it, nvcc's version and architecture lists, a fake pip NCCL and system NCCL, fake
device capabilities; scripts/setup/build_horovod.sh's refusals; and the engine's refusal of a Horovod without NCCL
on a CUDA run. No GPU, no toolkit, no build: seconds."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import ROOT
from scripts.setup import horovod_build_env as hb

# `horovodrun --check-build` of this project's CPU build (Horovod 0.28.1, Gloo + MPI), captured.
CPU_BUILD = """Horovod v0.28.1:

Available Frameworks:
    [ ] TensorFlow
    [X] PyTorch
    [ ] MXNet

Available Controllers:
    [X] MPI
    [X] Gloo

Available Tensor Operations:
    [ ] NCCL
    [ ] DDL
    [ ] CCL
    [X] MPI
    [X] Gloo    
"""
# The same for an NCCL build without MPI (the GPU check's): 0.28.1's check_build with nccl_built() true and
# mpi_built() false (its MPI mark appears under both controllers and operations).
NCCL_BUILD = ("Horovod v0.28.1:\n\nAvailable Frameworks:\n    [ ] TensorFlow\n    [X] PyTorch\n    [ ] MXNet\n\n"
              "Available Controllers:\n    [ ] MPI\n    [X] Gloo\n\nAvailable Tensor Operations:\n    [X] NCCL\n"
              "    [ ] DDL\n    [ ] CCL\n    [ ] MPI\n    [X] Gloo    \n")
NVCC_13 = """nvcc: NVIDIA (R) Cuda compiler driver
Copyright (c) 2005-2025 NVIDIA Corporation
Built on Wed_Aug_20_01:58:59_PM_PDT_2025
Cuda compilation tools, release 13.0, V13.0.88
Build cuda_13.0.r13.0/compiler.36424714_0
"""
ARCH_13 = "compute_75\ncompute_80\ncompute_86\ncompute_87\ncompute_88\ncompute_89\ncompute_90\ncompute_100\n" \
          "compute_110\ncompute_103\ncompute_120\ncompute_121\n"     # nvcc 13.0 --list-gpu-arch, captured
ARCH_117 = "compute_35\ncompute_37\ncompute_50\ncompute_52\ncompute_53\ncompute_60\ncompute_61\ncompute_62\n" \
           "compute_70\ncompute_72\ncompute_75\ncompute_80\ncompute_86\ncompute_87\n"


def test_check_build_marks_are_read_per_section():
    cpu, gpu = hb.parse_check_build(CPU_BUILD), hb.parse_check_build(NCCL_BUILD)
    assert cpu["operations"]["NCCL"] is False and gpu["operations"]["NCCL"] is True
    assert cpu["controllers"]["MPI"] is True and gpu["controllers"]["MPI"] is False
    assert gpu["operations"]["Gloo"] is True and cpu["frameworks"] == {"TensorFlow": False, "PyTorch": True,
                                                                       "MXNet": False}
    assert hb.parse_check_build("\n" + CPU_BUILD) == cpu                   # --verbose starts with a newline
    assert hb.missing_features(CPU_BUILD, mpi=True, nccl=False) == []      # what install.sh accepts today
    assert hb.missing_features(CPU_BUILD, mpi=True, nccl=True) == ["NCCL"]
    assert hb.missing_features(NCCL_BUILD, mpi=False, nccl=True) == []
    # the operations' MPI mark does not stand in for the controller's
    assert hb.missing_features(NCCL_BUILD.replace("[ ] MPI\n    [X] Gloo    ", "[X] MPI\n    [X] Gloo    "),
                               mpi=True, nccl=True) == ["MPI"]
    assert hb.missing_features("", mpi=False, nccl=False) == ["PyTorch", "Gloo"]


def test_check_build_command_reads_stdin_and_fails_on_what_is_missing():
    script = os.path.join(ROOT, "scripts", "setup", "horovod_build_env.py")
    run = lambda text, *flags: subprocess.run([sys.executable, script, "check-build", *flags], input=text,
                                              capture_output=True, text=True)
    assert run(CPU_BUILD, "--mpi").returncode == 0
    r = run(CPU_BUILD, "--mpi", "--nccl")
    assert r.returncode == 1 and "lacks NCCL" in r.stderr


def test_nvcc_version_and_architectures():
    assert hb.nvcc_release(NVCC_13) == (13, 0)
    assert hb.nvcc_release("Cuda compilation tools, release 12.8, V12.8.93") == (12, 8)
    assert hb.nvcc_archs(ARCH_13) == [75, 80, 86, 87, 88, 89, 90, 100, 103, 110, 120, 121]
    with pytest.raises(hb.BuildError):
        hb.nvcc_release("sh: nvcc: not found")


def test_toolkit_major_must_be_torchs():
    assert hb.check_toolkit("13.0", "/cuda", NVCC_13) == (13, 0)
    with pytest.raises(hb.BuildError, match=r"torch was built with CUDA 12\.8 .* is 13\.0"):
        hb.check_toolkit("12.8", "/cuda", NVCC_13)


def test_compute_capabilities():
    known = hb.nvcc_archs(ARCH_13)
    assert hb.cc_list("90, 80", [], 13, known)[0] == [80, 90]                     # the user's list first
    assert hb.cc_list(None, [(9, 0), (8, 0), (9, 0)], 13, known)[0] == [80, 90]   # then the visible GPUs
    assert hb.cc_list(None, [], 13, known)[0] == [75, 80, 86, 89, 90]             # then the default list,
    assert hb.cc_list(None, [], 11, hb.nvcc_archs(ARCH_117))[0] == [75, 80, 86]   # less what nvcc lacks
    assert hb.cc_list("70,80", [], 12, hb.nvcc_archs(ARCH_117))[0] == [70, 80]    # Volta under CUDA 12: fine
    with pytest.raises(hb.BuildError, match=r"7\.0 \(from the visible GPUs\) is not supported by CUDA 13"):
        hb.cc_list(None, [(7, 0)], 13, known)
    with pytest.raises(hb.BuildError, match="6.1"):
        hb.cc_list("61,90", [], 13, [])
    with pytest.raises(hb.BuildError, match="unknown to this nvcc"):
        hb.cc_list("95", [], 13, known)
    with pytest.raises(hb.BuildError, match="expected numbers"):
        hb.cc_list("sm_90", [], 13, known)


def _fake_pip_nccl(root):
    (root / "include").mkdir(parents=True)
    (root / "lib").mkdir()
    (root / "include" / "nccl.h").write_text("#define NCCL_MAJOR 2\n")
    (root / "lib" / "libnccl.so.2").write_bytes(b"")
    return str(root)


def test_nccl_comes_from_the_user_then_pip_then_the_system(tmp_path):
    link = str(tmp_path / "link")
    assert hb.find_nccl({"HOROVOD_NCCL_HOME": "/opt/nccl"}, link, "/pip", "", [])[0] == {}
    pip = _fake_pip_nccl(tmp_path / "pip" / "nvidia" / "nccl")
    found, source = hb.find_nccl({}, link, pip, "", [])
    assert found == {"HOROVOD_NCCL_INCLUDE": os.path.join(pip, "include"), "HOROVOD_NCCL_LIB": link}
    assert os.readlink(os.path.join(link, "libnccl.so")) == os.path.join(pip, "lib", "libnccl.so.2")
    assert "pip" in source
    # NGC / conda: no pip package; ldconfig knows the library, the header is in an include folder
    sysdir = tmp_path / "sys"
    _fake_pip_nccl(sysdir)
    (sysdir / "lib" / "libnccl.so").symlink_to("libnccl.so.2")     # a -dev package's plain name
    ldconfig = ("1 libs found in cache `/etc/ld.so.cache'\n"
                f"\tlibnccl.so.2 (libc6,x86-64) => {sysdir}/lib/libnccl.so.2\n")
    found, source = hb.find_nccl({}, link, None, ldconfig, ["/nonexistent", str(sysdir / "include")])
    assert found == {"HOROVOD_NCCL_INCLUDE": str(sysdir / "include"), "HOROVOD_NCCL_LIB": str(sysdir / "lib")}
    with pytest.raises(hb.BuildError, match="no NCCL found"):
        hb.find_nccl({}, link, None, "", ["/nonexistent"])


def _fake_toolkit(root):
    (root / "bin").mkdir(parents=True)
    (root / "include").mkdir()
    (root / "include" / "cuda_runtime.h").write_text("")
    nvcc = root / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\necho fake\n")
    nvcc.chmod(0o755)
    return str(root)


def test_toolkit_is_found_from_the_variables_or_nvcc_on_path(tmp_path):
    home = _fake_toolkit(tmp_path / "cuda-13.0")
    assert hb.find_cuda_home({"CUDA_HOME": home}) == home
    with pytest.raises(hb.BuildError, match="has no bin/nvcc"):
        hb.find_cuda_home({"HOROVOD_CUDA_HOME": str(tmp_path)})
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").symlink_to(os.path.join(home, "bin", "nvcc"))  # /usr/bin/nvcc -> the toolkit's
    assert hb.find_cuda_home({}, which=lambda _: str(tmp_path / "bin" / "nvcc")) == home


def _facts(tmp_path, torch_cuda="13.0", caps=((9, 0),), env=None, nvcc=NVCC_13):
    home = _fake_toolkit(tmp_path / "cuda")
    return hb.Facts(env or {}, torch_cuda, caps, home if torch_cuda else None, nvcc, ARCH_13,
                    _fake_pip_nccl(tmp_path / "nccl"), "", [])


def test_gpu_build_environment(tmp_path):
    f = _facts(tmp_path)
    env, notes = hb.build_env(f, str(tmp_path / "link"), mpi=False, cpu_only=False)
    assert env["HOROVOD_GPU_OPERATIONS"] == "NCCL" and env["HOROVOD_NCCL_LINK"] == "SHARED"
    assert env["HOROVOD_CUDA_HOME"] == f.cuda_home and env["HOROVOD_BUILD_CUDA_CC_LIST"] == "90"
    assert env["HOROVOD_NCCL_LIB"] == str(tmp_path / "link") and env["HOROVOD_WITHOUT_MPI"] == "1"
    assert env["HOROVOD_WITH_PYTORCH"] == "1" and "HOROVOD_WITH_MPI" not in env
    assert any("NCCL from pip" in n for n in notes)
    assert hb.cache_key(f, cpu_only=False) == "cuda=13.0 gpu_ops=NCCL cc=90"
    a100 = _facts(tmp_path / "a100", caps=[(8, 0)] * 8)
    assert hb.cache_key(a100, cpu_only=False) != hb.cache_key(f, cpu_only=False)   # an H200 wheel is not reused
    with pytest.raises(hb.BuildError, match="CUDA 12"):                            # torch cu128, nvcc 13.0
        hb.build_env(_facts(tmp_path / "mismatch", torch_cuda="12.8"), str(tmp_path / "l2"), False, False)


def test_cpu_builds_and_the_choice_of_gpu_operations(tmp_path):
    cpu_torch = hb.Facts({}, None, [], None)
    env, _ = hb.build_env(cpu_torch, str(tmp_path), mpi=True, cpu_only=False)
    assert "HOROVOD_GPU_OPERATIONS" not in env and env["HOROVOD_WITH_MPI"] == "1"
    assert hb.cache_key(cpu_torch, cpu_only=False) == ""      # the CPU wheels' cache key is today's
    assert hb.gpu_ops({}, "13.0", "/cuda", cpu_only=False) == "NCCL"
    assert hb.gpu_ops({}, "13.0", None, cpu_only=False) == "none"        # no toolkit: CPU build, with a warning
    assert hb.gpu_ops({}, "13.0", "/cuda", cpu_only=True) == "none"
    assert hb.cache_key(_facts(tmp_path), cpu_only=True) == "cuda=13.0 gpu_ops=none"
    _, notes = hb.build_env(hb.Facts({}, "13.0", [], None), str(tmp_path), mpi=True, cpu_only=False)
    assert any("WARNING" in n and "allow_host_allreduce" in n for n in notes)
    with pytest.raises(hb.BuildError, match="choose one"):
        hb.gpu_ops({"HOROVOD_GPU_OPERATIONS": "NCCL"}, "13.0", "/cuda", cpu_only=True)
    with pytest.raises(hb.BuildError, match="no CUDA"):
        hb.build_env(hb.Facts({"HOROVOD_GPU_OPERATIONS": "NCCL"}, None, [], None), str(tmp_path), True, False)
    with pytest.raises(hb.BuildError, match="NCCL or no GPU"):
        hb.gpu_ops({"HOROVOD_GPU_OPERATIONS": "MPI"}, "13.0", "/cuda", cpu_only=False)


def test_build_script_refuses_bad_arguments_loudly(tmp_path):
    script = os.path.join(ROOT, "scripts", "setup", "build_horovod.sh")
    for args, msg in [([], "--wheel-dir is required"), (["--wheel-dir", str(tmp_path), "--sdist", "/nonexistent"],
                                                         "no such file"), (["--frobnicate"], "unknown option")]:
        r = subprocess.run(["bash", script, *args], capture_output=True, text=True, timeout=30)
        assert r.returncode != 0 and msg in r.stderr and r.stdout == ""


# --- the engine: a Horovod without NCCL on a CUDA run ------------------------------------------------------
def test_a_cuda_run_on_horovod_without_nccl_is_refused_unless_allowed():
    from hvd_partialfc.config import ConfigError
    from hvd_partialfc.engine.select import check_gpu_operations
    with pytest.raises(ConfigError, match="built without NCCL"):
        check_gpu_operations("cuda", cuda_available=True, nccl_version=0, allow_host_allreduce=False)
    with pytest.raises(ConfigError, match="allow_host_allreduce"):
        check_gpu_operations("auto", cuda_available=True, nccl_version=0, allow_host_allreduce=False)
    check_gpu_operations("cuda", True, 0, allow_host_allreduce=True)       # the explicit opt-in
    check_gpu_operations("cuda", True, 22703, False)                       # an NCCL build
    check_gpu_operations("cpu", True, 0, False)
    check_gpu_operations("auto", False, 0, False)


def test_train_on_cuda_with_this_cpu_horovod_stops_with_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    hvd = pytest.importorskip("horovod.torch")
    if hvd.nccl_built():
        pytest.skip("this Horovod has NCCL")
    for k in [k for k in os.environ if k.startswith(("HOROVOD_", "OMPI_", "PMI", "TORCHELASTIC_"))]:
        monkeypatch.delenv(k)
    from hvd_partialfc.cli import main
    rc = main(["train", "--shards", str(tmp_path), "--out", str(tmp_path / "run"), "--set", "train.device=cuda",
               "--set", "train.engine=horovod"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "built without NCCL" in err[0], err
