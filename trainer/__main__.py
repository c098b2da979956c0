"""`python -m trainer`: compose conf/ with Hydra, check it, run the job."""

import gc
import sys

import hydra
from omegaconf import DictConfig

from trainer.cli import check_group_overrides, one_line_config_errors, register_configs
from trainer.cluster import register_resolvers
from trainer.job import run_job

register_configs()
register_resolvers()  # the launcher presets' ${zerolab.gpus_per_node:...}
# torch and the trainer are imported for good: freezing them spares every later collection, and
# the one at exit (about a second), the walk over their millions of objects.
gc.freeze()


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> None:
    run_job(cfg)


if __name__ == "__main__":
    check_group_overrides(sys.argv[1:])
    with one_line_config_errors():
        main()
