"""The classifier: the registered modes (modes.py), their heads (heads.py), the margin softmax (margins.py),
the row-sparse step (rowsparse.py), cross-shard negatives (negatives.py) and the optimizers."""
