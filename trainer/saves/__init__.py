"""Saving and resuming the full training state with torch.distributed.checkpoint.

- dcp.py: what a rank does to save and load (DCP, atomic rename, resharding) (rank);
- background.py: a rank's saves in place or in the background (save.async_mode: DCP's
  async_save), at most one in flight, listed once whole, timed (rank);
- resume.py: where a run starts: the save to resume from, the directory, the history to rewind;
- restarts.py: the launcher restarts a run recorded (restarts.jsonl), counted by the job process;
- hf_export.py: a save written as a Hugging Face checkpoint (`python -m trainer.export`, save.hf=last);
- integrity.py: a save that cannot be written, and one that is not whole when a run resumes.
"""
