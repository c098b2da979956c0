"""zerolab: declarative experiments in sharded, mixed-precision LLM training.

A job flows config -> plan -> launch -> each rank's loop -> telemetry -> report; the advisor,
saves, faults and the cluster stand beside that flow. The tree shows it:

- `__main__.py`, `cli.py`, `config.py`: `python -m trainer`: compose, check, dispatch; the typed schema;
- `job.py`, `launch.py`, `world.py`, `cluster.py`, `sweep.py`, `files.py`: the job process (check ->
  plan -> train, plan or advise), how its ranks start and join, multi-node placement, the Hydra
  sweep callbacks, directories claimed on a shared file system;
- `plan/`: the memory and communication plan, known before any rank starts;
- `model/`: the decoder and what wraps its blocks (attention kernel, checkpointing, compile);
- `rank/`: one rank's training: sharding, precision, optimizer, the loop;
- `data.py`: the global sample stream (`python -m trainer.data make-tokens`);
- `telemetry/`: what a rank measures and how the job process records it (metrics, memory,
  communication, summary.json, the W&B run), and the contract's metric keys and statuses (`keys.py`);
- `report/`: `python -m trainer.report`, the sweep report and the W&B Report;
- `advise/`: `mode=advise`: candidates, predicted step time, rates, verification;
- `saves/`: saving, loading and resuming the training state (DCP);
- `faults/`: rank failures recorded and explained, signals that stop a job;
- `private_apis/`: every private torch, wandb and submitit API called, and the version checked;
- `console.py`, `devices.py`, `units.py`, `jsonl.py`: one-line errors and warnings, the device
  table, byte units, JSON-lines files.
"""
