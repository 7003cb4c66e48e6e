"""Offline shard building: importers, partition, HDF5 writing, inspection (the trainer only reads)."""
