"""What watches a run."""
