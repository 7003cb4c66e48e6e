"""The decisions of the Horovod build (scripts/setup/build_horovod.sh) and of its install check
(scripts/setup/install.sh), in one place so both agree and the tests can try them with fake inputs (no GPU, no
toolkit, no build).

Standard library only: the install runs it with the venv's Python, and it imports torch only to read
``torch.version.cuda`` and the visible GPUs' compute capabilities.

What it decides:

* whether the build has GPU operations (NCCL): ``HOROVOD_GPU_OPERATIONS=NCCL`` asks for them; otherwise
  they come when torch has CUDA and a CUDA toolkit (nvcc) is found; ``--cpu-only`` (or
  ``HVD_PARTIALFC_HOROVOD_CPU_ONLY=1``) refuses them. A CUDA build needs nvcc of torch's CUDA major version:
  the pip wheels of torch ship neither nvcc nor the CUDA headers, and a kernel object built by another major
  version does not link against torch's runtime;
* where NCCL is: ``HOROVOD_NCCL_HOME`` or ``HOROVOD_NCCL_INCLUDE`` + ``HOROVOD_NCCL_LIB`` when set, else the pip
  package ``nvidia-nccl-cu*`` (``import nvidia.nccl``; it has only ``libnccl.so.2``, so a ``libnccl.so`` link is
  made in a folder of the caller's), else the system's (``ldconfig -p``, ``nccl.h`` under /usr/include or the
  toolkit). NGC containers and conda's torch bring no pip NCCL;
* the compute capabilities the kernels are built for (``HOROVOD_BUILD_CUDA_CC_LIST``): the user's variable,
  else the visible GPUs', else ``DEFAULT_CC``. CUDA 13 dropped capabilities below 7.5;
* whether an installed build is what was asked for: ``horovodrun --check-build``'s marks.

Commands (exit 2 with one ``error:`` line when the build cannot be done as asked):

    python scripts/setup/horovod_build_env.py gpu-ops     # NCCL | none: what a build here would have
    python scripts/setup/horovod_build_env.py key         # the GPU part of the wheel cache key ("" on CPU)
    python scripts/setup/horovod_build_env.py env --link-dir D [--mpi] [--cpu-only]   # export lines for the build
    horovodrun --check-build | python scripts/setup/horovod_build_env.py check-build [--mpi] [--nccl]
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

CPU_ONLY_ENV = "HVD_PARTIALFC_HOROVOD_CPU_ONLY"
# Without a visible GPU and without HOROVOD_BUILD_CUDA_CC_LIST: Turing, A100, A10/A40/RTX 30, L4/L40/RTX 40,
# H100/H200, each as native code, and PTX of the highest (Horovod's get_nvcc_flags), which newer GPUs
# (Blackwell, 10.0/12.0) compile at load. Entries the toolkit does not know are left out.
DEFAULT_CC = (75, 80, 86, 89, 90)
MIN_CC_CUDA13 = 75           # CUDA 13 removed Maxwell, Pascal and Volta (5.x, 6.x, 7.0, 7.2)

# The common keys of every build here: PyTorch and Gloo (both engines' tests), no TensorFlow/MXNet; the
# bundled Gloo's CMakeLists needs a policy floor under PyPI's cmake 4.x (Debian's 3.25 does not care).
BASE_ENV = {"HOROVOD_WITH_PYTORCH": "1", "HOROVOD_WITH_GLOO": "1", "HOROVOD_WITHOUT_TENSORFLOW": "1",
            "HOROVOD_WITHOUT_MXNET": "1", "CMAKE_POLICY_VERSION_MINIMUM": "3.5"}


class BuildError(Exception):
    """The build cannot be done as asked; the message says what to change."""


# --- horovodrun --check-build ---------------------------------------------------------------------------
_SECTIONS = {"Available Frameworks:": "frameworks", "Available Controllers:": "controllers",
             "Available Tensor Operations:": "operations"}


def parse_check_build(text: str) -> Dict[str, Dict[str, bool]]:
    """``horovodrun --check-build``'s marks by section (Horovod 0.28.1, runner/launch.py ``check_build``):
    ``{"frameworks": {"PyTorch": True, ...}, "controllers": {"MPI": ...}, "operations": {"NCCL": ...}}``.
    MPI appears twice (controller and tensor operations): the sections keep them apart."""
    out: Dict[str, Dict[str, bool]] = {v: {} for v in _SECTIONS.values()}
    section = None
    for line in text.splitlines():
        s = line.strip()
        if s in _SECTIONS:
            section = _SECTIONS[s]
            continue
        m = re.fullmatch(r"\[([X ])\]\s+(\S.*)", s)
        if m and section:
            out[section][m.group(2).strip()] = m.group(1) == "X"
    return out


def missing_features(text: str, mpi: bool, nccl: bool) -> List[str]:
    """What an installed build lacks of PyTorch, Gloo, MPI (when ``mpi``) and NCCL (when ``nccl``)."""
    marks = parse_check_build(text)
    need = [("frameworks", "PyTorch"), ("controllers", "Gloo")]
    need += [("controllers", "MPI")] if mpi else []
    need += [("operations", "NCCL")] if nccl else []
    return [name for sec, name in need if not marks[sec].get(name, False)]


# --- the CUDA toolkit ------------------------------------------------------------------------------------
def nvcc_release(version_text: str) -> Tuple[int, int]:
    """(major, minor) from ``nvcc --version`` ("Cuda compilation tools, release 13.0, V13.0.88")."""
    m = re.search(r"release (\d+)\.(\d+)", version_text)
    if not m:
        raise BuildError(f"cannot read the CUDA version from nvcc --version: {version_text.strip()[:200]!r}")
    return int(m.group(1)), int(m.group(2))


def nvcc_archs(list_text: str) -> List[int]:
    """Compute capabilities from ``nvcc --list-gpu-arch`` (compute_75 ... compute_120)."""
    return sorted({int(x) for x in re.findall(r"compute_(\d+)", list_text)})


def find_cuda_home(env: Mapping[str, str], which: Callable[[str], Optional[str]] = shutil.which) -> Optional[str]:
    """The toolkit folder (``bin/nvcc`` and ``include/cuda_runtime.h``): HOROVOD_CUDA_HOME, CUDA_HOME or
    CUDA_PATH when set (a set one without nvcc is an error), else nvcc on PATH (links followed; a wrapper
    script outside its toolkit falls back to /usr/local/cuda), else /usr/local/cuda, else None."""
    for var in ("HOROVOD_CUDA_HOME", "CUDA_HOME", "CUDA_PATH"):
        home = env.get(var)
        if home:
            if not os.access(os.path.join(home, "bin", "nvcc"), os.X_OK):
                raise BuildError(f"{var}={home} has no bin/nvcc: point it at a CUDA toolkit, or unset it")
            return home
    candidates = []
    nvcc = which("nvcc")
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    candidates.append(os.path.join(os.sep, "usr", "local", "cuda"))
    for home in candidates:
        if os.access(os.path.join(home, "bin", "nvcc"), os.X_OK) and \
                os.path.exists(os.path.join(home, "include", "cuda_runtime.h")):
            return home
    return None


def run_nvcc(home: str, arg: str) -> str:
    return subprocess.run([os.path.join(home, "bin", "nvcc"), arg], capture_output=True, text=True,
                          check=False).stdout


def check_toolkit(torch_cuda: str, home: str, version_text: str) -> Tuple[int, int]:
    """The toolkit's (major, minor); a BuildError when its major is not torch's."""
    major, minor = nvcc_release(version_text)
    want = int(torch_cuda.split(".")[0])
    if major != want:
        raise BuildError(f"torch was built with CUDA {torch_cuda} but the CUDA toolkit at {home} is {major}.{minor}: "
                         f"Horovod's GPU build needs nvcc and headers of CUDA {want}.x (torch's pip wheels ship "
                         f"neither). Install that toolkit and set CUDA_HOME, or build without GPU operations "
                         f"({CPU_ONLY_ENV}=1)")
    return major, minor


# --- NCCL -----------------------------------------------------------------------------------------------
def pip_nccl_dir() -> Optional[str]:
    """The folder of the pip package nvidia-nccl-cu* (``nvidia/nccl`` with include/ and lib/), or None."""
    try:
        import nvidia.nccl as n  # a namespace package: no __file__
    except ImportError:
        return None
    paths = list(getattr(n, "__path__", []))
    return paths[0] if paths else None


def ldconfig_nccl(ldconfig_text: str) -> Optional[str]:
    """The path of libnccl.so(.2) in ``ldconfig -p``'s output, or None."""
    m = re.search(r"^\s*libnccl\.so(?:\.\d+)?\s.*=>\s*(\S+)\s*$", ldconfig_text, re.M)
    return m.group(1) if m else None


def _libdir_with_link(lib: str, link_dir: str) -> str:
    """A folder where the linker finds ``libnccl.so`` for ``lib`` (``.../libnccl.so.2``): its own folder when
    it has one, else ``link_dir`` with a link made there (the pip package and some system packages ship
    only the versioned name, and cmake's find_library(nccl) looks for the plain one)."""
    folder = os.path.dirname(lib)
    if os.path.exists(os.path.join(folder, "libnccl.so")):
        return folder
    os.makedirs(link_dir, exist_ok=True)
    link = os.path.join(link_dir, "libnccl.so")
    if os.path.lexists(link):
        os.remove(link)
    os.symlink(lib, link)
    return link_dir


def find_nccl(env: Mapping[str, str], link_dir: str, pip_dir: Optional[str], ldconfig_text: str,
              include_dirs: Sequence[str]) -> Tuple[Dict[str, str], str]:
    """(variables for the build, where NCCL came from). See the module's docstring for the order."""
    if env.get("HOROVOD_NCCL_HOME") or (env.get("HOROVOD_NCCL_INCLUDE") and env.get("HOROVOD_NCCL_LIB")):
        return {}, "HOROVOD_NCCL_* as set"
    if pip_dir:
        libs = sorted(f for f in os.listdir(os.path.join(pip_dir, "lib")) if f.startswith("libnccl.so")) \
            if os.path.isdir(os.path.join(pip_dir, "lib")) else []
        header = os.path.join(pip_dir, "include", "nccl.h")
        if libs and os.path.exists(header):
            lib = os.path.join(pip_dir, "lib", libs[-1])
            return ({"HOROVOD_NCCL_INCLUDE": os.path.dirname(header),
                     "HOROVOD_NCCL_LIB": _libdir_with_link(lib, link_dir)}, f"pip package nvidia-nccl ({pip_dir})")
    lib = ldconfig_nccl(ldconfig_text)
    header = next((d for d in include_dirs if os.path.exists(os.path.join(d, "nccl.h"))), None)
    if lib and header:
        return ({"HOROVOD_NCCL_INCLUDE": header, "HOROVOD_NCCL_LIB": _libdir_with_link(lib, link_dir)},
                f"the system ({lib})")
    raise BuildError("no NCCL found (pip package nvidia-nccl-cu*, ldconfig -p with nccl.h): install one, or set "
                     "HOROVOD_NCCL_HOME (or HOROVOD_NCCL_INCLUDE and HOROVOD_NCCL_LIB)")


# --- compute capabilities --------------------------------------------------------------------------------
def cc_list(user: Optional[str], device_caps: Sequence[Tuple[int, int]], cuda_major: int,
            known: Sequence[int] = ()) -> Tuple[List[int], str]:
    """(capabilities as 80, 90, ..., where they came from): ``user`` (HOROVOD_BUILD_CUDA_CC_LIST, "80,90"),
    else the visible GPUs' ``device_caps`` ((9, 0) -> 90), else ``DEFAULT_CC`` less what the toolkit
    does not know (``known``, from ``nvcc --list-gpu-arch``; empty: unknown). A capability below 7.5 under
    CUDA >= 13, or one the toolkit does not know, is a BuildError naming it."""
    if user:
        try:
            ccs, source = sorted({int(x) for x in user.replace(" ", "").split(",") if x}), "HOROVOD_BUILD_CUDA_CC_LIST"
        except ValueError:
            raise BuildError(f"HOROVOD_BUILD_CUDA_CC_LIST={user!r}: expected numbers such as 80,90") from None
    elif device_caps:
        ccs, source = sorted({10 * a + b for a, b in device_caps}), "the visible GPUs"
    else:
        ccs = [c for c in DEFAULT_CC if not known or c in known]
        return ccs, "the default list (no GPU visible; set HOROVOD_BUILD_CUDA_CC_LIST to choose)"
    if not ccs:
        raise BuildError(f"HOROVOD_BUILD_CUDA_CC_LIST={user!r} names no capability")
    old = [c for c in ccs if c < MIN_CC_CUDA13]
    if cuda_major >= 13 and old:
        raise BuildError(f"compute capability {', '.join(f'{c // 10}.{c % 10}' for c in old)} (from {source}) is "
                         f"not supported by CUDA {cuda_major} (it needs >= 7.5): use a CUDA 12 torch and toolkit "
                         f"for those GPUs, or leave them out of HOROVOD_BUILD_CUDA_CC_LIST")
    unknown = [c for c in ccs if known and c not in known]
    if unknown:
        raise BuildError(f"compute capability {unknown} (from {source}) is unknown to this nvcc "
                         f"(it knows {list(known)})")
    return ccs, source


# --- the decision -----------------------------------------------------------------------------------------
def gpu_ops(env: Mapping[str, str], torch_cuda: Optional[str], cuda_home: Optional[str], cpu_only: bool) -> str:
    """``NCCL`` or ``none``: what a build here has (the module's docstring says when)."""
    asked = env.get("HOROVOD_GPU_OPERATIONS", "")
    if asked and asked != "NCCL":
        raise BuildError(f"HOROVOD_GPU_OPERATIONS={asked}: this recipe builds NCCL or no GPU operations")
    if cpu_only:
        if asked:
            raise BuildError(f"HOROVOD_GPU_OPERATIONS=NCCL and a CPU-only build ({CPU_ONLY_ENV} or --cpu-only) "
                             "were both asked for: choose one")
        return "none"
    if asked:
        return "NCCL"
    return "NCCL" if torch_cuda and cuda_home else "none"


class Facts:
    """What the decision reads from this machine; the tests build one from fakes."""

    def __init__(self, env: Mapping[str, str], torch_cuda: Optional[str], device_caps: Sequence[Tuple[int, int]],
                 cuda_home: Optional[str], nvcc_version: str = "", nvcc_arch_list: str = "",
                 pip_nccl: Optional[str] = None, ldconfig: str = "", include_dirs: Sequence[str] = ()):
        self.env, self.torch_cuda, self.device_caps = env, torch_cuda, list(device_caps)
        self.cuda_home, self.nvcc_version, self.nvcc_arch_list = cuda_home, nvcc_version, nvcc_arch_list
        self.pip_nccl, self.ldconfig, self.include_dirs = pip_nccl, ldconfig, list(include_dirs)

    @classmethod
    def here(cls, env: Mapping[str, str], need_toolkit: bool = True) -> "Facts":
        torch_cuda, caps = _torch_facts()
        home = find_cuda_home(env) if torch_cuda or env.get("HOROVOD_GPU_OPERATIONS") else None
        if not (home and need_toolkit):
            return cls(env, torch_cuda, caps, home)
        ld = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, check=False).stdout \
            if shutil.which("ldconfig") else ""
        return cls(env, torch_cuda, caps, home, run_nvcc(home, "--version"), run_nvcc(home, "--list-gpu-arch"),
                   pip_nccl_dir(), ld, ["/usr/include", "/usr/local/include", os.path.join(home, "include")])


def _torch_facts() -> Tuple[Optional[str], List[Tuple[int, int]]]:
    import torch
    caps = []
    if torch.version.cuda and torch.cuda.is_available():
        caps = [tuple(torch.cuda.get_device_capability(i)) for i in range(torch.cuda.device_count())]
    return torch.version.cuda, caps


def build_env(f: Facts, link_dir: str, mpi: bool, cpu_only: bool) -> Tuple[Dict[str, str], List[str]]:
    """(the variables to export for ``pip wheel``, lines saying what was chosen and why)."""
    out = dict(BASE_ENV)
    out["HOROVOD_WITH_MPI" if mpi else "HOROVOD_WITHOUT_MPI"] = "1"
    ops = gpu_ops(f.env, f.torch_cuda, f.cuda_home, cpu_only)
    if ops == "none":
        why = "asked for" if cpu_only else ("torch has no CUDA" if not f.torch_cuda else
                                            "torch has CUDA but no CUDA toolkit (nvcc) was found")
        notes = [f"GPU operations: none ({why})"]
        if f.torch_cuda and not cpu_only:
            notes.append(f"WARNING: without NCCL the Horovod engine refuses CUDA runs (train.allow_host_allreduce); "
                         f"install the CUDA {f.torch_cuda.split('.')[0]} toolkit and set CUDA_HOME to build it")
        return out, notes
    if not f.torch_cuda:
        raise BuildError("HOROVOD_GPU_OPERATIONS=NCCL but this torch has no CUDA (torch.version.cuda is None)")
    if not f.cuda_home:
        raise BuildError("HOROVOD_GPU_OPERATIONS=NCCL but no CUDA toolkit (nvcc) was found: set CUDA_HOME")
    major, minor = check_toolkit(f.torch_cuda, f.cuda_home, f.nvcc_version)
    ccs, cc_source = cc_list(f.env.get("HOROVOD_BUILD_CUDA_CC_LIST"), f.device_caps, major,
                             nvcc_archs(f.nvcc_arch_list))
    nccl, nccl_source = find_nccl(f.env, link_dir, f.pip_nccl, f.ldconfig, f.include_dirs)
    out.update({"HOROVOD_GPU_OPERATIONS": "NCCL", "HOROVOD_CUDA_HOME": f.cuda_home, "HOROVOD_NCCL_LINK": "SHARED",
                "HOROVOD_BUILD_CUDA_CC_LIST": ",".join(map(str, ccs))}, **nccl)
    return out, [f"GPU operations: NCCL from {nccl_source}", f"CUDA {major}.{minor} at {f.cuda_home} (torch: "
                 f"{f.torch_cuda})", f"compute capabilities {','.join(map(str, ccs))} from {cc_source}"]


def cache_key(f: Facts, cpu_only: bool) -> str:
    """The GPU part of the wheel's cache key: "" for a CPU torch built without GPU operations (the key of
    the CPU wheels cached before it existed stays the same), else torch's CUDA, the GPU operations and
    the capability list (a wheel for 9.0 only does not run on an A100)."""
    ops = gpu_ops(f.env, f.torch_cuda, f.cuda_home, cpu_only)
    if ops == "none":
        return f"cuda={f.torch_cuda} gpu_ops=none" if f.torch_cuda else ""
    major, _ = nvcc_release(f.nvcc_version) if f.nvcc_version else (int(f.torch_cuda.split(".")[0]), 0)
    ccs, _ = cc_list(f.env.get("HOROVOD_BUILD_CUDA_CC_LIST"), f.device_caps, major, nvcc_archs(f.nvcc_arch_list))
    return f"cuda={f.torch_cuda} gpu_ops=NCCL cc={','.join(map(str, ccs))}"


def main(argv: Sequence[str]) -> int:
    import argparse
    p = argparse.ArgumentParser(prog="horovod_build_env.py")
    p.add_argument("command", choices=("gpu-ops", "key", "env", "check-build"))
    p.add_argument("--link-dir", default="")
    p.add_argument("--mpi", action="store_true")
    p.add_argument("--nccl", action="store_true")
    p.add_argument("--cpu-only", action="store_true")
    a = p.parse_args(argv)
    cpu_only = a.cpu_only or os.environ.get(CPU_ONLY_ENV, "") not in ("", "0")
    try:
        if a.command == "check-build":
            missing = missing_features(sys.stdin.read(), a.mpi, a.nccl)
            if missing:
                print(f"horovodrun --check-build lacks {', '.join(missing)}", file=sys.stderr)
            return 1 if missing else 0
        facts = Facts.here(os.environ, need_toolkit=a.command != "gpu-ops")
        if a.command == "gpu-ops":
            print(gpu_ops(facts.env, facts.torch_cuda, facts.cuda_home, cpu_only))
        elif a.command == "key":
            print(cache_key(facts, cpu_only))
        else:
            if not a.link_dir:
                raise BuildError("env needs --link-dir (a fresh folder for the libnccl.so link)")
            exports, notes = build_env(facts, a.link_dir, a.mpi, cpu_only)
            for line in notes:
                print(f"[build_horovod] {line}", file=sys.stderr)
            for k, v in exports.items():
                print(f"export {k}={shlex.quote(v)}")
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
