"""Training, whatever the task: the DDP engine, sampling, batch arithmetic and resume checkpoints."""
