"""Open-set evaluation: does the trained backbone tell *unseen* classes apart?

Training over many classes is only a means; the product is an embedding, judged as face recognition is
judged: on classes the model never saw. One module per job, so a new protocol is one small module:

* `metrics`: the figures, pure numpy (ROC, AUC, 10-fold accuracy, TAR@FAR, rank-k, TPIR@FPIR);
* `embedding`: running a backbone over images (batched, eval + inference mode, nothing changed);
* `align`: five-point alignment to the ArcFace template (numpy + Pillow);
* protocols: `pairs` (pair sets: LFW-style ``.bin`` and ``.h5``, with baselines), `all_pairs` (every
  pair of a shard set), `ijb` (IJB-B/C 1:1 templates), `identification` (1:N gallery/probes);
* `output`: tables, plots; `suite`: what ``hvd-partialfc eval`` runs, one ``eval.json``;
* `evaluator`: the training loop's component (buffer averaging included).

Nothing here imports Horovod. docs/evaluation.md describes every protocol and its figures.
"""
