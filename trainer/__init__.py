"""zerolab: declarative experiments in sharded, mixed-precision LLM training.

A job flows config -> plan -> launch -> each rank's loop -> telemetry -> report; the advisor,
saves, faults and the cluster stand beside that flow. The packages are layers, each importing
only the layers below it and the leaves (tests/unit/test_imports.py holds the order):

- `__main__.py`, `cli.py`: `python -m trainer`: compose, check, dispatch (the entry); `export.py`:
  `python -m trainer.export`, a save written as a Hugging Face checkpoint;
- `job.py`, `launch.py`, `cluster.py`, `sweep.py`, `autobatch.py`: the job process (check -> plan ->
  train, plan or advise), starting and joining its ranks, multi-node placement, the Hydra sweep
  callbacks, `micro_batch=auto`'s proposal and probe runs;
- `advise/`: `mode=advise`: candidates, predicted step time, rates, verification;
- `rank/`: one rank's training: its entry point, sharding, precision, optimizer, the loop;
- `saves/`: saving, loading and resuming the training state (DCP);
- `report/`: `python -m trainer.report`, the sweep report, its fit table and the W&B Report;
- `faults/`: rank failures recorded and explained, signals that stop a job;
- `telemetry/`: what a rank measures and how the job process records it (metrics, memory,
  communication, summary.json, the W&B run);
- `plan/`: the memory and communication plan, known before any rank starts;
- `model/`: the decoder and what wraps its blocks (attention kernel, checkpointing, compile);
- `data.py`: the global sample stream (`python -m trainer.data make-tokens`);
- `text/`: local text through a model's tokenizer: the token cache and packed rows (`data=text`);
- `world.py`, `cuda.py`: where a process stands (rank, device, process group) and its CUDA setup;
- `layout.py`: the job's parallel axes (pp, dp_replicate, dp_shard, cp, tp), their order and the one formula
  that places a rank on them (`coords`, `group`), free of torch.distributed;
- `config/`: the typed schema, one module per config group and the root;
- leaves, which any layer may import: `console.py`, `devices.py`, `units.py`, `jsonl.py`,
  `files.py`, `overrides.py` (one-line errors and warnings, the device table, byte units,
  JSON-lines files, directories claimed on a shared file system, command-line overrides read
  back), `private_apis/` (every private torch, wandb and submitit API called, and the version
  checked), `telemetry/keys.py` (the contract's metric keys and statuses), `rank/trainee.py`,
  `model/op_names.py` and `model/hf_config.py`.
"""
