"""GPUMix executor: training worker, torchrun launcher, metrics store, job queue (torch)."""
