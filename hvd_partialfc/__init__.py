"""hvd_partialfc: train a backbone over a huge number of classes with Horovod, each rank owning a disjoint,
contiguous slice of the labels and a local classifier exactly as wide as that slice (docs/method.md,
docs/architecture.md)."""
__version__ = "0.1.0"
