"""Data: the shard format (shards.py), the rank layout (layout.py), label slices (partition.py), the
loader (loader.py) and its stall bound (stalls.py), augmentation (augment.py), undecodable samples
(bad_samples.py) and pair-set files (pair_files.py)."""
