"""zerolab's launchers for `hydra/launcher=slurm|local` (conf/hydra/launcher/): hydra-submitit-launcher's,
requeued after preemption (trainer/cluster.py). Hydra instantiates launchers only from this package."""

from hydra_plugins.hydra_submitit_launcher.submitit_launcher import LocalLauncher as SubmititLocalLauncher
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher as SubmititSlurmLauncher
from trainer.cluster import Requeueing


class SlurmLauncher(Requeueing, SubmititSlurmLauncher):
    """hydra/launcher=slurm: one SLURM job per sweep point, requeued after preemption."""


class LocalLauncher(Requeueing, SubmititLocalLauncher):
    """hydra/launcher=local: submitit's local executor, the SLURM path on one host."""
