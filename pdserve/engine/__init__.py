"""The engine: one per worker, whatever its role. Scheduler and block pool move ids; the model
runner turns them into tensors; the model does the math."""
