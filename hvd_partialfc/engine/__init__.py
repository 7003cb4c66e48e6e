"""The distributed engine: the ``Comm`` interface (base.py) and its implementations: Horovod (horovod.py),
the simulator's virtual ranks (sim.py), one rank without communication (local.py); sync BatchNorm."""
