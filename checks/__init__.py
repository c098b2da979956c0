"""The acceptance checks: scripts that hold zerolab's claims against measurements and exit 1 on a miss.

What separates checks/ from benchmarks/: a check judges whether a figure the docs publish is right
(the memory plan's peak, the advisor's ranking, the fitted GPU constants, that a fault loses
nothing, that the CUDA paths work), against real jobs or published runs, with a pass rule the tests
import and call with fake measurements; a benchmark (benchmarks/, plain scripts loaded by path)
measures what something costs (speed, memory, start-up), side by side. Each check is a command run
from the repository root (`python checks/<name>.py --help`) and a module of this package that the
tests import (`from checks import plan_accuracy`: pytest puts the repository root on sys.path, as
tests/ is a package; a script that imports from checks/ puts the root there itself).

- gpu_check.py: the GPU check, one command for one H200 (docs/gpu.md; `--dry-run` on CPU);
- gpucheck/: the GPU check's jobs, schedule, rows and report (its `__init__` maps them);
- headroom_probe.py: what a CUDA rank holds besides its tensors, run by the GPU check's headroom
  row against the figures trainer/plan/headroom.py assumes;
- plan_accuracy.py: the memory plan against what real multi-rank CPU jobs hold (docs/memory_plan.md);
- pipeline_plan.py: the same for the pipeline's stages (plan_accuracy.py's rows and pass rule);
- plan_vs_published.py: GPU reserved memory and tokens/s against published torchtitan runs, and the
  fits of trainer/plan/headroom.py and trainer/advise/throughput.py refitted and compared;
- advisor_accuracy.py: mode=advise's ranking against a grid of real 2-rank CPU jobs (docs/advisor.md);
- fault_drills.py: every everyday fault done to a real 2-rank job, and whether anything was lost
  (docs/faults.md);
- plan_snapshot.py: every moment of every plan over a fixed grid, and its sha256: a refactor that moves
  code and changes no figure leaves the checksum as it was.
"""
