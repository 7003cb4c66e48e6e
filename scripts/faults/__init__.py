"""The fault-injection harness: network-namespace nodes (twonode) and the seeded chaos run (chaos); run its modules from
the repository root, e.g. ``python -m scripts.faults.chaos --seed 1`` (scripts/README.md, docs/reliability.md)."""
