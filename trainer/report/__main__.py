"""`python -m trainer.report`: the command line lives in trainer/report/command.py."""

import sys

from trainer.report.command import main

main(sys.argv[1:])
