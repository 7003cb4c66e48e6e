"""Compatibility names: the evaluation code lives in the `hvd_partialfc.verification` package.

Scripts and notebooks that did ``from hvd_partialfc import evaluate`` keep working; new code imports
from the sub-package's modules (docs/evaluation.md has the module map).
"""
from __future__ import annotations

from .verification.all_pairs import ALL_PAIRS_BINS, ALL_PAIRS_FARS, all_pairs_metrics, evaluate_all_pairs  # noqa: F401
from .verification.embedding import (embed, frozen, pair_scores, pixel_embed, random_init_backbone,  # noqa: F401
                                     score_pairs)
from .verification.evaluator import Evaluator  # noqa: F401
from .verification.metrics import (FARS, N_FOLDS, best_threshold, check_scores, far_key, jsonable,  # noqa: F401
                                   kfold_accuracy, roc_auc, roc_curve, roc_points, tar_at_far, verification_metrics)
from .verification.output import (BASELINE_LABELS, default_out_dir, format_all_pairs, format_table,  # noqa: F401
                                  plot_roc)
from .verification.verify_pairs import check_input_shape, evaluate_backbone, evaluate_baselines  # noqa: F401
from .verification.suite import evaluate_files  # noqa: F401
