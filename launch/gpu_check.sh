#!/usr/bin/env bash
# GPU check (one NVIDIA GPU, no network): build Horovod 0.28.1 with NCCL (from the pip package nvidia-nccl)
# against the machine's torch, run the trainer on CUDA (np=1, NCCL for GPU tensors), export/info, and a
# throughput figure, and the face workload (launch/gpu_face_check.py; on CPU: `--tiny`). Needs the Horovod sdist at $HOROVOD_SDIST (pip download --no-binary :all: horovod==0.28.1).
set -x
export PYTHONUNBUFFERED=1
T0=$(date +%s)
nvidia-smi -L
python3 -c "import torch;print('torch', torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))"
NCCL_DIR=$(python3 -c "import nvidia.nccl as n; print(list(n.__path__)[0])")
ls $NCCL_DIR $NCCL_DIR/include $NCCL_DIR/lib
mkdir -p /tmp/nccl/lib && for f in $NCCL_DIR/lib/libnccl.so*; do ln -sf $f /tmp/nccl/lib/; done
ln -sf $(ls $NCCL_DIR/lib/libnccl.so.* | head -1) /tmp/nccl/lib/libnccl.so
tar xzf "${HOROVOD_SDIST:-.dev/horovod-0.28.1.tar.gz}" -C /tmp
cd /tmp/horovod-0.28.1
sed -i 's/CMAKE_CXX_STANDARD 14/CMAKE_CXX_STANDARD 17/' CMakeLists.txt horovod/torch/CMakeLists.txt
sed -i 's/CMAKE_CUDA_STANDARD 11/CMAKE_CUDA_STANDARD 17/' horovod/common/ops/cuda/CMakeLists.txt
export HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_NCCL_INCLUDE=$NCCL_DIR/include HOROVOD_NCCL_LIB=/tmp/nccl/lib \
  HOROVOD_NCCL_LINK=SHARED HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
  HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_BUILD_CUDA_CC_LIST=90 CMAKE_POLICY_VERSION_MINIMUM=3.5 \
  MAKEFLAGS=-j16 HOROVOD_CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/hvd . > $OUT/build.log 2>&1
echo "build rc=$? after $(( $(date +%s) - T0 )) s"
tail -30 $OUT/build.log
cd - >/dev/null
export PYTHONPATH=$PWD:/tmp/hvd LD_LIBRARY_PATH=/tmp/nccl/lib:$LD_LIBRARY_PATH PATH=/tmp/hvd/bin:$PATH
python3 /tmp/hvd/bin/horovodrun --check-build
python3 - <<'PY'
import numpy as np, sys
sys.path.insert(0, 'tests')
from conftest import make_image_npz, build_shards
build_shards(make_image_npz('/tmp/i.npz', 64, 40, size=32), '/tmp/img', 1)
PY
python3 /tmp/hvd/bin/horovodrun -np 1 --gloo python3 -m hvd_partialfc.cli train --shards /tmp/img --out /tmp/run \
  --steps 60 --set train.device=cuda --set data.batch_size=64 --set model.kwargs='{width: 16}' \
  --set train.log_every=10 --set head.scale=32 --set head.margin=0.3 --set train.precision=bf16 2>&1 | tr '\r' '\n' | grep -v "it/s\]$" | tail -8
cat /tmp/run/metrics.jsonl | python3 -c "import sys,json; [print(json.loads(l)['step'], round(json.loads(l)['loss'],3), round(json.loads(l)['samples_per_s'])) for l in sys.stdin]"
python3 -m hvd_partialfc.cli info /tmp/run
python3 -m hvd_partialfc.cli export /tmp/run --out /tmp/bb.pt | head -3
cp /tmp/run/metrics.jsonl $OUT/ 2>/dev/null
# Throughput of the demo-sized backbone on the GPU (fp32 and bf16), plain PyTorch
python3 - <<'PY'
import torch, time
from hvd_partialfc.models import create_model
from hvd_partialfc.classifier.margins import LocalClassifier
for size, width, bs in [(32, 16, 256), (64, 16, 256), (112, 64, 256)]:
    for prec in ("fp32", "bf16"):
        m = create_model('resnet', in_shape=[size, size], embedding_dim=128, width=width).cuda()
        h = LocalClassifier(100000, 128, 'arcface', 32, 0.3).cuda()
        opt = torch.optim.SGD(list(m.parameters()) + list(h.parameters()), lr=0.1, momentum=0.9)
        x = torch.randn(bs, 1, size, size, device='cuda'); y = torch.randint(0, 100000, (bs,), device='cuda')
        def step():
            with torch.autocast('cuda', dtype=torch.bfloat16, enabled=prec == 'bf16'):
                f = m(x)
            loss = h(f.float(), y); opt.zero_grad(); loss.backward(); opt.step()
        for _ in range(5): step()
        torch.cuda.synchronize(); t = time.perf_counter(); n = 20
        for _ in range(n): step()
        torch.cuda.synchronize(); dt = (time.perf_counter() - t) / n
        print(f"resnet w{width} {size}px batch {bs} {prec} + 100k-class local head: {bs/dt:,.0f} samples/s")
PY
# The face workload (issue 13): iresnet50 at 112x112, fp16 and bf16, from encoded JPEG shards through the real
# loader; the step split (a) full step with a 125,000-class local classifier, (b) backbone alone, (c) loader alone
python3 launch/gpu_face_check.py /tmp/faces 2>&1 | tail -16
cp /tmp/faces/face_check.json $OUT/ 2>/dev/null
echo "total $(( $(date +%s) - T0 )) s"
