"""docs/scaling.md, "Sampled softmax at scale": `local`-r against PartialFC-r (`global` with head.sample_rate=r) from
the estimator: memory per rank, logits per rank per step, bytes handed to collectives per step.

    PYTHONPATH=. .venv/bin/python docs/bench/sampled_scaling.py
"""
from hvd_partialfc.tools.estimate import estimate, backbone_figures, human
bb = backbone_figures("resnet18", 512, 128, [112, 112, 3])
print("| ranks N | classes C | r | `local`-r memory / rank | PartialFC-r memory / rank | `local`-r logits / rank | PartialFC-r logits / rank | `local`-r bytes / step | PartialFC-r bytes / step |")
print("|---|---|---|---|---|---|---|---|---|")
for n in (8, 64, 1024):
    for c in (10**6, 10**7, 10**8):
        for r in (0.1, 0.3):
            l = estimate(c, n, 512, 128, "resnet18", "local", "fp32", sample_rate=r, bb=bb)
            g = estimate(c, n, 512, 128, "resnet18", "global", "fp32", sample_rate=r, bb=bb)
            kl = max(1, int(l["width"] * r)); kg = max(1, int(g["width"] * r))
            print(f"| {n:,} | {c:.0e} | {r} | {human(l['memory_total'])} | {human(g['memory_total'])} | "
                  f"{128 * kl:,} | {128 * n * kg:,} | {human(l['traffic_total'])} | {human(g['traffic_total'])} |")
