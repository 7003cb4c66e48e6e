"""Memory snapshots."""
