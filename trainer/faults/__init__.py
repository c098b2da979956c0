"""How a job ends when something goes wrong, reported by rank and cause, never as a hang.

- failures.py: every rank failure recorded (out of memory, a crash, a lost peer) and the one that
  explains the job; memory caps for a rank;
- stop.py: a signal (Ctrl-C, preemption) stops every rank after an agreed step, saved.
"""
