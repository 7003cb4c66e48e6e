"""hvd_partialfc: train a backbone over a huge number of classes with Horovod, each rank owning a disjoint,
contiguous slice of the labels and a local classifier exactly as wide as that slice (docs/method.md,
docs/architecture.md)."""
__version__ = "0.1.0"
MIN_TORCH = "2.6"     # the oldest torch supported: setup.cfg's install_requires says the same (a test keeps
# them equal), `doctor` checks the installed one against it, scripts/setup/torch_versions.sh runs the smoke subset on it
