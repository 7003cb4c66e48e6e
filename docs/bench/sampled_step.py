"""The sampled classifier's update alone: gradient into the weight, then the optimizer step, one thread.

    PYTHONPATH=. .venv/bin/python docs/bench/sampled_step.py [ROWS [RATE ...]]

*dense*: ``weight[index]`` (autograd scatters the K sampled rows' gradient into a fresh (W, D) zero
gradient) and torch's fused SGD over every row: what sampled ``global`` (PartialFC v2) does, and
``head.sampled_step=dense``. *lazy*: ``rowsparse.gather_rows`` (a row-sparse gradient) and
``SampledRowsOptimizer`` (only the K rows step; unsampled rows wait). *exact*: the same plus the catch-up
of the K rows before they are scored, and the sweep of every row each 64 steps (``head.sampled_step=exact``,
the default); its "step" column includes the catch-up and the sweep amortised (the mean over 64 steps, where
the others give the median of 5). SGD momentum 0.9, weight decay 5e-4, D = 128; the loss is a stand-in of
the head's (a (K, D) gradient). The three alternate twice.
"""
import sys
import time

import torch

from hvd_partialfc.classifier.rowsparse import SampledRowsOptimizer, gather_rows, sample_rows


def run(rule: str, width: int, rate: float, dim: int = 128):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(width, dim) * 0.01)
    sparse = rule != "dense"
    opt = (SampledRowsOptimizer([w], "sgd", 0.1, momentum=0.9, weight_decay=5e-4, rule=rule) if sparse else
           torch.optim.SGD([w], lr=0.1, momentum=0.9, weight_decay=5e-4, fused=True))
    grads, steps = [], []
    for _ in range(65 if rule == "exact" else 6):
        index, _ = sample_rows(torch.randint(0, width, (64,)), width, rate, "cpu")
        opt.zero_grad(set_to_none=True)
        tc = time.perf_counter()
        if rule == "exact":
            opt.catch_up(w, index)
        catch_up = time.perf_counter() - tc
        rows = gather_rows(w, index) if sparse else w[index]
        loss = (rows.sum(1) * torch.randn(rows.shape[0])).sum()
        t0 = time.perf_counter()
        loss.backward()
        t1 = time.perf_counter()
        opt.step()
        grads.append(t1 - t0)
        steps.append(time.perf_counter() - t1 + catch_up)
    if rule == "exact":                 # 64 steps after the first: one sweep among them, amortised
        return sum(grads[1:]) / 64 * 1e3, sum(steps[1:]) / 64 * 1e3
    return sorted(grads[1:])[2] * 1e3, sorted(steps[1:])[2] * 1e3


def main():
    torch.set_num_threads(1)
    width = int(float(sys.argv[1])) if len(sys.argv) > 1 else 500_000
    for rate in [float(r) for r in sys.argv[2:]] or [0.1, 0.3]:
        for rule in ("dense", "lazy", "exact") * 2:
            g, s = run(rule, width, rate)
            print(f"{rule:6} W={width:,} r={rate:g}: gradient into the weight "
                  f"{g:6.1f} ms, step {s:6.1f} ms, both {g + s:6.1f} ms", flush=True)


if __name__ == "__main__":
    main()
