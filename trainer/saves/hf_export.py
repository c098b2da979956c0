"""A save exported as a Hugging Face checkpoint: `python -m trainer.export` and `save.hf=last`.

The save's `model` entry (canonical names, whatever stage and world size wrote it) is read in one
process with torch.distributed.checkpoint, mapped to Hugging Face's names and rotary layout
(trainer/model/hf_weights.py), cast to the chosen dtype and written by DCP's own
`HuggingFaceStorageWriter`: consolidated safetensors and their `model.safetensors.index.json`,
beside the config.json of transformers' class of the family (trainer/model/hf_config.py). A mixture of
experts is written as Mixtral, or Qwen3-MoE where it has q/k norms: each stacked expert weight as its E
per-expert tensors, the layout of the Hub's checkpoints, which transformers 5's from_pretrained fuses
on load; one neither family can hold (shared experts, sigmoid scores) is refused before the save is read.
DCP's writer takes one state dict, so this process holds the whole model: read in fp32, each
tensor replaced by its cast as it is converted (about the fp32 model at the peak).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageWriter

from trainer.config import ConfigError, ModelConfig, from_plain
from trainer.model.hf_config import HfConfigError, export_config
from trainer.model.hf_weights import expected_tensors, to_hf_layout
from trainer.saves.dcp import METADATA, latest_save

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""--dtype's choices and the torch dtype each writes."""


def find_save(path: Path) -> Path:
    """The save `path` names: itself (a `checkpoints/step_XXXXXXXX` directory) or a run's newest."""
    if (path / METADATA).is_file():
        return path
    save = latest_save(path)
    if save is None:
        raise ConfigError(
            f"export: {path} is neither a save (checkpoints/step_XXXXXXXX) nor a run directory with one"
        )
    return save


def hf_state_dict(save: Path, model: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The save's weights under Hugging Face's names and rotary layout, in `dtype`."""
    expected = expected_tensors(model)
    state = {"model": {name: torch.empty(shape) for name, (_, shape) in expected.items()}}
    with warnings.catch_warnings():  # DCP warns that there is no process group: that is the intent here
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=save, no_dist=True)
    out: dict[str, torch.Tensor] = {}
    for name in list(state["model"]):
        tensor, (hf, _) = state["model"].pop(name), expected[name]  # the fp32 copy goes as its cast comes
        if hf.experts is not None:  # each expert its own tensor, a copy (not a view of the stacked one)
            out |= {key: tensor[e].to(dtype, copy=True) for e, key in enumerate(hf.keys)}
            continue
        value = tensor if hf.heads is None else to_hf_layout(tensor, hf.heads)
        out[hf.key] = value.to(dtype).contiguous()
    return out


def export_save(save: Path, out_dir: Path, model: ModelConfig, dtype: str = "fp32") -> Path:
    """Write `save`'s model to `out_dir` as a checkpoint AutoModelForCausalLM.from_pretrained loads."""
    try:
        config = export_config(model, str(DTYPES[dtype]).removeprefix("torch."))
    except HfConfigError as err:  # a model transformers has no class for: refused before the save is read
        raise ConfigError(f"export: {err.detail}") from None
    tensors = hf_state_dict(save, model, DTYPES[dtype])
    out_dir.mkdir(parents=True, exist_ok=True)
    writer = HuggingFaceStorageWriter(str(out_dir), fqn_to_index_mapping=dict.fromkeys(tensors, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(tensors, storage_writer=writer, no_dist=True)
    config.save_pretrained(out_dir)
    return out_dir


def run_model_config(run_dir: Path) -> ModelConfig:
    """The model a run trained, as its job resolved it: summary.json's config, else the one Hydra stored."""
    from omegaconf import OmegaConf

    summary = run_dir / "summary.json"
    if summary.is_file():
        plain = json.loads(summary.read_text()).get("config")
    else:
        stored = run_dir / ".hydra" / "config.yaml"
        if not stored.is_file():
            raise ConfigError(
                f"export: {run_dir} has neither summary.json nor .hydra/config.yaml: not a run directory"
            )
        plain = OmegaConf.to_container(OmegaConf.load(stored), resolve=True)
    return from_plain(plain).model  # type: ignore[arg-type]
