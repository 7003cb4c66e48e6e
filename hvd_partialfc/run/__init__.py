"""The run: build once (startup.py, parts.py), then loop (trainer.py, step.py); checkpoints, resume,
preemption, the simulator's driver and the metrics log."""
