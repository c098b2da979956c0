"""`python -m trainer.export <save or run directory> <out directory> [--dtype fp32|bf16|fp16]`: a save
(a run's newest, given the run) written as a Hugging Face checkpoint (trainer/saves/hf_export.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trainer.config import ConfigError
from trainer.console import BAD_INPUT, error_line
from trainer.saves.hf_export import DTYPES, export_save, find_save, run_model_config


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m trainer.export", description=__doc__)
    parser.add_argument("path", type=Path, help="a save (checkpoints/step_XXXXXXXX) or a run directory")
    parser.add_argument("out", type=Path, help="the directory to write (created)")
    parser.add_argument(
        "--dtype", choices=list(DTYPES), default="fp32", help="the tensors' dtype (default fp32)"
    )
    args = parser.parse_args(argv)
    try:
        save = find_save(args.path.resolve())
        model = run_model_config(save.parent.parent)
        out = export_save(save, args.out, model, args.dtype)
    except ConfigError as err:
        error_line(str(err))
        raise SystemExit(BAD_INPUT) from None
    print(f"exported {save} to {out} ({args.dtype})", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
