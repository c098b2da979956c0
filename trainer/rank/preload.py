"""What the fork server imports before it forks the ranks (trainer/rank/main.py, `fork_server`).

Every rank needs these modules: the server imports them once and each rank forks with them
already in place. Then everything imported is frozen (gc.freeze, as its documentation advises
before forking): no collection, in the server or in a rank, walks these objects again, so the
ranks share their pages instead of copying them, and no process spends its last second
collecting them at exit.
"""

import gc

from trainer.rank.loop import train  # and everything it builds a rank's training from
from trainer.rank.main import rank_main

__all__ = ["rank_main", "train"]

gc.freeze()
