"""GPUMix executor: training worker, torchrun launcher, metrics store, job queue (torch).

Public API (import from the modules; this package imports nothing, so the torch-free
store reader stays cheap for the dashboard):
- executor.launch: the door to a run. `launch_run(plan, steps, run_dir, seed=0, ...) -> str` (blocking;
  "done" | "failed" | "stopped"), `start_run(...) -> RunHandle` (non-blocking, a new session),
  `stop_run(run_dir, timeout_s=30) -> str`, `multinode_commands(...)`, `runs_here(plan)`; the settings
  become a contracts.run.RunConfig, run by a backend (executor.backend: executor.local, executor.slurm).
- executor.store: `read_metrics(run_dir) -> dict`, `list_runs(root=None) -> list[dict]`, `MetricsStore`.
- executor.worker: the rank process (`python -m torch.distributed.run ... -m executor.worker`).
- executor.corpus: the training corpus (byte-level or a tokenizer.json) and the plan-independent global sampler.
- executor.checkpoint: torch.distributed.checkpoint save/resume.
- profiler.memtrack: measured peak memory (CUDA allocator / CPU live tensor bytes).
"""
