"""The full-size rows of docs/faces.md's ONNX table: each backbone at D = 512, BatchNorm statistics from two
training-mode batches of random inputs, then ``onnx_export.export_onnx`` (export, onnxruntime vs PyTorch on
64 inputs, atomic write).

    PYTHONPATH=. .venv/bin/python docs/bench/onnx_diffs.py OUT mobilefacenet iresnet50 iresnet100
"""
import os
import sys
import time

import torch

from hvd_partialfc.models import create_model
from hvd_partialfc.tools.onnx_export import export_onnx

out_dir, names = sys.argv[1], sys.argv[2:]
os.makedirs(out_dir, exist_ok=True)
for name in names:
    torch.manual_seed(0)
    model = create_model(name, in_shape=[112, 112, 3], embedding_dim=512)
    with torch.no_grad():
        for _ in range(2):
            model.train()(torch.rand(8, 3, 112, 112) * 2 - 1)
    t = time.time()
    info = export_onnx(model, [112, 112, 3], os.path.join(out_dir, f"{name}.onnx"))
    print(f"{name}: max abs diff {info['max_abs_diff_normalised']:.3g}, {info['bytes']:,} bytes, "
          f"{time.time() - t:.0f} s", flush=True)
