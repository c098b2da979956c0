"""What the fork server imports before it forks the ranks (trainer/rank/main.py, `fork_server`).

Every rank needs these modules: the server imports them once and each rank forks with them
already in place; so too the modules torch itself imports on first use in every rank (DDP's and
FSDP2's constructors import torch._dynamo, and a CPU rank's first tracked step MemTracker):
imported in each rank after the fork, they cost every rank of every job about a CPU-second.
torch.distributed.optim, which only ZeRO-1's and local SGD's ranks use, is preloaded before this
module for their jobs alone (trainer/rank/main.py `fork_server`). Then everything imported is frozen (gc.freeze, as its documentation advises
before forking): no collection, in the server or in a rank, walks these objects again, so the
ranks share their pages instead of copying them, and no process spends its last second
collecting them at exit.
"""

import gc

from trainer.private_apis.of_torch import import_rank_lazy_modules
from trainer.rank.loop import train  # and everything it builds a rank's training from
from trainer.rank.main import rank_main

import_rank_lazy_modules()

__all__ = ["rank_main", "train"]

gc.freeze()
