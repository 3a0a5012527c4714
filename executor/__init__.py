"""GPUMix executor: training worker, torchrun launcher, metrics store, job queue (torch).

Public API (import from the modules; this package imports nothing, so the torch-free
store reader stays cheap for the dashboard):
- executor.launch: `launch_run(plan, steps, run_dir, seed=0, resume=False, checkpoint_every=0,
  corpus_dir=None) -> str` (blocking; "done" | "failed" | "stopped"), `start_run(...) -> RunHandle`
  (non-blocking, a new session), `stop_run(run_dir, timeout_s=30) -> str`,
  `multinode_commands(...)`, `runs_here(plan)`.
- executor.store: `read_metrics(run_dir) -> dict`, `list_runs(root=None) -> list[dict]`, `MetricsStore`.
- executor.worker: the rank process (`python -m torch.distributed.run ... -m executor.worker`).
- executor.corpus: the training corpus (byte-level or a tokenizer.json) and the plan-independent global sampler.
- executor.checkpoint: torch.distributed.checkpoint save/resume.
- profiler.memtrack: measured peak memory (CUDA allocator / CPU live tensor bytes).
"""
