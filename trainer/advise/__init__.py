"""mode=advise: which configuration to run for a global batch, ranked by predicted step time.

- advisor.py: the candidates, the ranked table, advice.json and the command lines;
- predict.py: the predicted step time of one configuration (compute, exposed communication, optimizer);
- throughput.py: the fraction of a GPU's dense peak a step's matmuls reach, fitted to published runs;
- fp8.py: under bf16 on h100/h200, the predicted fp8 speed-up from the GEMM shapes, fitted to published points;
- host.py: an eager GPU step's host time, its dispatched ops times a per-op cost: where it exceeds the device's;
- calibrate.py: the rates that turn FLOPs and bytes into seconds (this host measured, or a table);
- accelerators.py: `advise.accelerators=[...]`: the advisor's search once per accelerator, the best fitting
  configuration of each in one table (its arithmetic and text: trainer/report/cost.py);
- verify.py: `advise.verify=K`: run the K best as jobs and set measured beside predicted;
- fit.py: what the plan says fits a rank: the remedies after an out-of-memory failure (the candidates,
  nearest first) and the micro-batch `micro_batch=auto` proposes.
"""
