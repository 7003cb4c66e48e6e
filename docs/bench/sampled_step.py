"""The sampled classifier's update alone: gradient into the weight, then the optimizer step, one thread.

    PYTHONPATH=. .venv/bin/python docs/bench/sampled_step.py [ROWS [RATE ...]]

*dense*: ``weight[index]`` (autograd scatters the K sampled rows' gradient into a fresh (W, D) zero
gradient) and torch's fused SGD over every row: what sampled ``global`` (PartialFC v2) does, and what
sampled ``local`` would do without ``rowsparse``. *sparse*: ``rowsparse.gather_rows`` (a row-sparse
gradient) and ``SampledRowsOptimizer`` (only the K rows step). SGD momentum 0.9, weight decay 5e-4,
D = 128; the loss is a stand-in of the head's (a (K, D) gradient). Median of 5 steps after one, dense and
sparse alternating twice.
"""
import sys
import time

import torch

from hvd_partialfc.rowsparse import SampledRowsOptimizer, gather_rows, sample_rows


def run(sparse: bool, width: int, rate: float, dim: int = 128):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(width, dim) * 0.01)
    opt = (SampledRowsOptimizer([w], "sgd", 0.1, momentum=0.9, weight_decay=5e-4) if sparse else
           torch.optim.SGD([w], lr=0.1, momentum=0.9, weight_decay=5e-4, fused=True))
    grads, steps = [], []
    for _ in range(6):
        index, _ = sample_rows(torch.randint(0, width, (64,)), width, rate, "cpu")
        opt.zero_grad(set_to_none=True)
        rows = gather_rows(w, index) if sparse else w[index]
        loss = (rows.sum(1) * torch.randn(rows.shape[0])).sum()
        t0 = time.perf_counter()
        loss.backward()
        t1 = time.perf_counter()
        opt.step()
        grads.append(t1 - t0)
        steps.append(time.perf_counter() - t1)
    return sorted(grads[1:])[2] * 1e3, sorted(steps[1:])[2] * 1e3


def main():
    torch.set_num_threads(1)
    width = int(float(sys.argv[1])) if len(sys.argv) > 1 else 500_000
    for rate in [float(r) for r in sys.argv[2:]] or [0.1, 0.3]:
        for sparse in (False, True, False, True):
            g, s = run(sparse, width, rate)
            print(f"{'sparse' if sparse else 'dense ':6} W={width:,} r={rate:g}: gradient into the weight "
                  f"{g:6.1f} ms, step {s:6.1f} ms, both {g + s:6.1f} ms", flush=True)


if __name__ == "__main__":
    main()
