"""How a job ends when something goes wrong, reported by rank and cause, never as a hang.

- failures.py: every rank failure recorded (out of memory, a crash, a lost peer) and the one that
  explains the job; memory caps for a rank;
- leftovers.py: nothing left behind: ranks die with their fork server and with the job process,
  every process of a job carries its mark, and what outlives the launcher is ended;
- oom.py: an out-of-memory failure explained: its moment, the plan's figure there by category beside
  what the rank held, the category most over its plan;
- tensor_cap.py: `device_memory_gib` on CPU: the bytes a rank's tensors hold, counted op by op and
  refused past the cap with torch's out-of-memory error;
- stop.py: a signal (Ctrl-C, preemption) stops every rank after an agreed step, saved.
"""
