"""The trainer and its support modules: checkpoints, EMA weights and run logs."""
