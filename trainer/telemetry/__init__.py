"""What is measured and where it is written. Rank halves measure; the job-process halves record.

- keys.py: the metric keys of docs/design.md section 4 and summary.json's statuses, named once (both);
- metrics.py: a rank's figures over a log window, gathered to rank 0 into metrics.jsonl (rank);
- memory.py: one rank's peak memory (MemTracker / RSS on CPU, allocator counters on GPU) (rank);
- snapshot.py: `memory.snapshot`, the CUDA allocator's history dumped on OOM or named steps (rank);
- comm.py: the communication a rank measured from c10d's flight recorder (rank);
- layer_norms.py: `telemetry.layer_norms`, each layer's gradient and parameter norm over the whole model,
  in one all-reduce a log step (rank);
- traces.py: `telemetry.trace_steps`, torch.profiler's chrome trace of chosen steps on chosen ranks (rank),
  and the traces and memory snapshots a run's W&B artifacts and the sweep report list (job process);
- creep.py: memory that creeps, the per-window peak growing beyond the plan's steady state (job process);
- summary.py: summary.json, how a job ended and its steady-state figures (job process);
- wandb_logger.py: the job's W&B run, fed from metrics.jsonl (job process: a launched rank never
  imports wandb; under torchrun rank 0's process is the job process too and owns the run);
- wandb_run.py: what that run says about itself: tags, swept values, metric definitions.
"""
