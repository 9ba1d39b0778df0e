"""What every training loop shares (RL trainer, offline draft trainer, SFT warm start): packing,
learning-rate schedules, per-step seeds, crash-safe checkpoints."""
