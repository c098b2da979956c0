"""`model.weights=<dir>`: a Hugging Face checkpoint's weights in zerolab's decoder, and back out.

The key map is torchtitan's (torchtitan/models/llama3/model/state_dict_adapter.py, and its qwen3
adapter for q_norm / k_norm): one Hugging Face name per decoder parameter, the same for the
four dense families `model=hf` reads (Llama, Mistral, Qwen2 with q/k/v biases, Qwen3 with q/k norms).
A mixture of experts (model.n_experts > 0) is read as Mixtral, or as Qwen3-MoE where it has q/k norms
(hf_config.py `export_architecture`): the router's gate is one tensor (`block_sparse_moe.gate` /
`mlp.gate`), but each of the three stacked expert weights (E, ., .) is E tensors in the files, one per
expert (`block_sparse_moe.experts.{e}.w1/w2/w3`, `mlp.experts.{e}.gate_proj/down_proj/up_proj`): what
the Hub's checkpoints hold and what transformers 5's save_pretrained writes, though its modules hold
the experts fused (gate_up_proj, down_proj) once loaded. The router's aux-loss-free bias is a buffer,
not a parameter: zero after a load, and not exported.

Rotary layouts differ. zerolab rotates adjacent pairs (x[2i], x[2i+1]) of each head (Meta's
layout); transformers rotates the two halves (x[i], x[i + Q/2]) (`rotate_half`), and Meta's
weights are converted to it by permuting each head's output rows (transformers'
convert_llama_weights_to_hf.py `permute`). So every tensor whose rows are query or key head
features is permuted back within each head: wq, wk, their Qwen2 biases and Qwen3's q/k norm
weights (one head's worth). Everything else is copied as it is.

What each rank reads (`load_weights`): the tensors that are not permuted go through
torch.distributed.checkpoint with its `HuggingFaceStorageReader`, which reads from the
safetensors files only the slice of each tensor that the rank's parameter holds (a DTensor
shard under FSDP2, tensor parallelism or both, planned from its placements; the whole tensor under
DDP alone). A permuted tensor's shard is not one slice of
the file's tensor (the permutation moves rows within each head, and a shard boundary may cut a
head), so those are read one whole tensor at a time with safetensors' `safe_open`, permuted,
and only the rank's slice kept (`distribute_tensor` on the parameter's own mesh and
placements, `copy_full_into`): besides its shard, a rank holds for a moment one such tensor
twice (as read and permuted), or one slice DCP reads. A stacked expert weight is no one tensor of the
files either, but E of them: a rank reads the tensors of the experts whose rows it holds (all under DDP;
its share of dim 0 under FSDP2 or expert parallelism), stacks them and copies them in (`load_experts`),
so it holds for a moment at most one stacked weight, all E experts of one projection of one layer.
A pipeline stage's model holds its own blocks only, under the whole decoder's names, so it asks both
readers for those tensors alone.

The checks (`check_weights`, in the job process before any rank starts) read only the files'
headers: missing, unexpected and mis-shaped tensors, and a config.json that is not the model.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainer.config import ConfigError, ModelConfig
from trainer.model.decoder import build_model, canonical_name, copy_full_into, find_transformer

INDEX = "model.safetensors.index.json"

# zerolab's name -> Hugging Face's, `{}` the layer (torchtitan's from_hf_map, inverted).
_TO_HF = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "layers.{}.attention.wq.weight": "model.layers.{}.self_attn.q_proj.weight",
    "layers.{}.attention.wk.weight": "model.layers.{}.self_attn.k_proj.weight",
    "layers.{}.attention.wv.weight": "model.layers.{}.self_attn.v_proj.weight",
    "layers.{}.attention.wo.weight": "model.layers.{}.self_attn.o_proj.weight",
    "layers.{}.attention.wq.bias": "model.layers.{}.self_attn.q_proj.bias",
    "layers.{}.attention.wk.bias": "model.layers.{}.self_attn.k_proj.bias",
    "layers.{}.attention.wv.bias": "model.layers.{}.self_attn.v_proj.bias",
    "layers.{}.attention.q_norm.weight": "model.layers.{}.self_attn.q_norm.weight",
    "layers.{}.attention.k_norm.weight": "model.layers.{}.self_attn.k_norm.weight",
    "layers.{}.feed_forward.w1.weight": "model.layers.{}.mlp.gate_proj.weight",
    "layers.{}.feed_forward.w2.weight": "model.layers.{}.mlp.down_proj.weight",
    "layers.{}.feed_forward.w3.weight": "model.layers.{}.mlp.up_proj.weight",
    "layers.{}.attention_norm.weight": "model.layers.{}.input_layernorm.weight",
    "layers.{}.ffn_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
}

# A mixture of experts, by the family it is read and exported as: the router's gate, and each stacked expert
# weight's per-expert tensors (`{{}}` the expert: formatted after the layer).
_MOE_TO_HF = {
    "MixtralForCausalLM": {
        "layers.{}.feed_forward.router.gate.weight": "model.layers.{}.block_sparse_moe.gate.weight",
        "layers.{}.feed_forward.experts.w1": "model.layers.{}.block_sparse_moe.experts.{{}}.w1.weight",
        "layers.{}.feed_forward.experts.w2": "model.layers.{}.block_sparse_moe.experts.{{}}.w2.weight",
        "layers.{}.feed_forward.experts.w3": "model.layers.{}.block_sparse_moe.experts.{{}}.w3.weight",
    },
    "Qwen3MoeForCausalLM": {
        "layers.{}.feed_forward.router.gate.weight": "model.layers.{}.mlp.gate.weight",
        "layers.{}.feed_forward.experts.w1": "model.layers.{}.mlp.experts.{{}}.gate_proj.weight",
        "layers.{}.feed_forward.experts.w2": "model.layers.{}.mlp.experts.{{}}.down_proj.weight",
        "layers.{}.feed_forward.experts.w3": "model.layers.{}.mlp.experts.{{}}.up_proj.weight",
    },
}
# A per-expert tensor's name: what comes before and after the expert's index.
_EXPERT_KEY = re.compile(r"(.*\.experts\.)\d+(\..*)")

# Tensors a checkpoint may carry that the model does not need: transformers' old rotary buffers,
# and a tied head written out anyway (transformers ignores it when tie_word_embeddings is set).
_IGNORED = re.compile(r"(.*rotary_emb\.inv_freq|lm_head\.weight)$")


@dataclass(frozen=True)
class HfTensor:
    """Where a decoder parameter lives in a Hugging Face checkpoint."""

    key: str
    heads: int | None
    """Heads whose rows are permuted between the rotary layouts (None: copied as is)."""
    experts: int | None = None
    """A stacked expert weight: `key` names each expert's tensor, `{}` its index (`keys`)."""

    @property
    def keys(self) -> list[str]:
        """The tensors of the files it is: one, or one per expert in expert order."""
        return [self.key] if self.experts is None else [self.key.format(e) for e in range(self.experts)]


def key_map(config: ModelConfig) -> dict[str, str]:
    """zerolab's names -> Hugging Face's for `config`'s decoder: a mixture's by its family."""
    if not config.is_moe:
        return _TO_HF
    from trainer.model.hf_config import export_architecture

    return _TO_HF | _MOE_TO_HF[export_architecture(config)]


def hf_tensor(name: str, config: ModelConfig) -> HfTensor:
    """The Hugging Face tensor of zerolab parameter `name` (canonical, no wrapper segments)."""
    layer = re.match(r"layers\.(\d+)\.", name)
    abstract = name.replace(f"layers.{layer.group(1)}.", "layers.{}.", 1) if layer else name
    names = key_map(config)
    if abstract not in names:
        raise KeyError(f"{name} has no Hugging Face counterpart")
    key = names[abstract].format(layer.group(1)) if layer else names[abstract]
    if ".feed_forward.experts." in name:
        return HfTensor(key, None, experts=config.n_experts)
    heads = None
    if ".wq." in name:
        heads = config.n_heads
    elif ".wk." in name:
        heads = config.n_kv_heads
    elif name.endswith(("q_norm.weight", "k_norm.weight")):
        heads = 1  # one head's weight, shared by every head
    return HfTensor(key, heads)


def to_meta_layout(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """Hugging Face's rotary layout (halves) -> zerolab's (adjacent pairs), within each head's rows.

    The inverse of transformers' convert_llama_weights_to_hf.py `permute` (and torchtitan's
    `_reverse_permute`): rows (h, 2, Q/2) become (h, Q/2, 2)."""
    rows, rest = tensor.shape[0], tensor.shape[1:]
    return tensor.reshape(heads, 2, rows // heads // 2, *rest).transpose(1, 2).reshape(tensor.shape)


def to_hf_layout(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """zerolab's rotary layout -> Hugging Face's: transformers' `permute`, rows (h, Q/2, 2) -> (h, 2, Q/2)."""
    rows, rest = tensor.shape[0], tensor.shape[1:]
    return tensor.reshape(heads, rows // heads // 2, 2, *rest).transpose(1, 2).reshape(tensor.shape)


def expected_tensors(config: ModelConfig) -> dict[str, tuple[HfTensor, torch.Size]]:
    """Every parameter of the decoder `config` builds (on meta): its canonical name, Hugging Face
    tensor and shape. A tied head is the embedding's one parameter, so lm_head.weight is not asked for."""
    model = build_model(config, device="meta")
    return {name: (hf_tensor(name, config), p.shape) for name, p in model.named_parameters()}


def hf_shapes(config: ModelConfig) -> dict[str, list[int]]:
    """Every tensor the checkpoint must hold for `config` and its shape: a stacked expert weight's
    (E, ., .) is E tensors of its (., .)."""
    shapes: dict[str, list[int]] = {}
    for tensor, shape in expected_tensors(config).values():
        rows = shape if tensor.experts is None else shape[1:]
        shapes.update((key, list(rows)) for key in tensor.keys)
    return shapes


# ----------------------------------------------------------------------------- the files


def safetensors_files(weights: Path) -> list[Path]:
    """The checkpoint's safetensors files (one `model.safetensors`, or the shards its index names)."""
    index = weights / INDEX
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [weights / name for name in names]
    return sorted(weights.glob("*.safetensors"))


def header_shapes(files: list[Path]) -> dict[str, tuple[list[int], Path]]:
    """Each tensor's shape and file, from the safetensors headers only (no tensor data is read)."""
    from safetensors import SafetensorError, safe_open

    shapes: dict[str, tuple[list[int], Path]] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    shapes[key] = (list(f.get_slice(key).get_shape()), path)
        except SafetensorError as err:  # what check_sizes does not catch: safetensors' own word, one line
            raise ConfigError(
                f"model.weights={path.parent}: {path.name} is not a readable safetensors file "
                f"({str(err).splitlines()[0]}); give the files transformers' save_pretrained wrote"
            ) from None
    return shapes


def read_header(path: Path) -> tuple[int, dict[str, Any]]:
    """A safetensors file's header length and JSON header (the format: an 8-byte little-endian
    length, then the header, then the tensors' bytes); ConfigError naming the file where it is cut
    short or unreadable."""
    size = path.stat().st_size
    with path.open("rb") as f:
        length = int.from_bytes(f.read(8), "little") if size >= 8 else None
        if length is None or size < 8 + length:
            raise ConfigError(
                f"model.weights={path.parent}: {path.name} is truncated: {size} bytes, less than its "
                f"header{'' if length is None else f' ({8 + length} bytes)'}; copy the file again"
            )
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError):
            header = None
    if not isinstance(header, dict):
        raise ConfigError(
            f"model.weights={path.parent}: {path.name} has no safetensors header (not JSON); "
            "give the files transformers' save_pretrained wrote"
        )
    return length, header


def check_sizes(files: list[Path]) -> None:
    """Each file holds the bytes its header promises: 8 + the header + the largest `data_offsets`
    end (a copy cut short, which safetensors reports as a traceback, is named in one line)."""
    for path in files:
        length, header = read_header(path)
        data = max(
            (entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"), default=0
        )
        size = path.stat().st_size
        if size < 8 + length + data:
            raise ConfigError(
                f"model.weights={path.parent}: {path.name} is truncated: {size} bytes, its header "
                f"describes {8 + length + data}; copy the file again"
            )


def largest_tensor_bytes(files: list[Path]) -> int:
    """The bytes of the checkpoint's largest tensor as stored, from the headers only: each entry's
    `data_offsets` (safe_open gives shapes and dtype names, not sizes). A mixture's per-expert tensors
    count together, all E of one projection of one layer: `load_experts` stacks them whole."""
    sizes: dict[str, int] = {}
    for path in files:
        for key, entry in read_header(path)[1].items():
            if key != "__metadata__":
                expert = _EXPERT_KEY.fullmatch(key)
                group = f"{expert.group(1)}*{expert.group(2)}" if expert else key
                sizes[group] = sizes.get(group, 0) + entry["data_offsets"][1] - entry["data_offsets"][0]
    return max(sizes.values(), default=0)


def fingerprint(files: list[Path]) -> str:
    """sha256 of the safetensors files' bytes in order, its first 16 hex digits: which weights a run
    started from (read once, in the job process; about a second per GB)."""
    digest = hashlib.sha256()
    for path in files:
        with path.open("rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()[:16]


# ----------------------------------------------------------------------------- checks (the job)


def check_weights(config: ModelConfig) -> list[Path]:
    """`model.weights` against the model, from headers only: one ConfigError line for a directory
    without safetensors, a shard missing, a file cut short, a config.json that is another model (naming
    the differing keys), and the first missing, mis-shaped or unexpected tensor (naming it and both
    shapes). Its files on success."""
    weights = Path(config.weights or "")
    files = safetensors_files(weights) if weights.is_dir() else []
    if not files:
        raise ConfigError(
            f"model.weights={weights}: no safetensors files there (model.safetensors, or shards with "
            f"{INDEX}); give a directory written by transformers' save_pretrained"
        )
    missing = [path.name for path in files if not path.is_file()]
    if missing:
        raise ConfigError(
            f"model.weights={weights}: {INDEX} names {missing[0]}, which is not there "
            f"({len(missing)} of {len(files)} shards missing); copy the checkpoint again"
        )
    check_sizes(files)
    check_family(config, weights)
    check_config_json(config, weights)
    check_shapes(config, weights, header_shapes(files))
    return files


def check_family(config: ModelConfig, weights: Path) -> None:
    """A mixture of experts neither Mixtral nor Qwen3-MoE is (shared experts, sigmoid scores...) has no
    Hugging Face names for its tensors: refused in one line naming the key."""
    from trainer.model.hf_config import HfConfigError, export_architecture

    try:
        export_architecture(config)
    except HfConfigError as err:
        raise ConfigError(f"model.weights={weights}: {err.detail}") from None


def check_config_json(config: ModelConfig, weights: Path) -> None:
    """The weights' own config.json, where they have one, must describe the model being built."""
    from trainer.model.hf_config import HfConfigError, model_fields

    if not (weights / "config.json").is_file():
        return
    try:
        fields = model_fields(weights / "config.json")
    except HfConfigError as err:
        raise ConfigError(f"model.weights={weights}: its config.json: {err.detail}") from None
    here = {key: _value(getattr(config, key)) for key in fields} | {"head_dim": config.head_width}
    differing = [
        f"{key} ({value} there, {here[key]} here)" for key, value in fields.items() if value != here[key]
    ]
    if differing:
        raise ConfigError(
            f"model.weights={weights}: its config.json is another model than model={config.name}: "
            f"{', '.join(differing)}; model=hf model.weights={weights} alone builds the model its config.json describes"
        )


def _value(value: Any) -> Any:
    return getattr(value, "value", value)  # an Enum's name, as config.json's fields have it


def check_shapes(config: ModelConfig, weights: Path, found: dict[str, tuple[list[int], Path]]) -> None:
    expected = hf_shapes(config)
    for key, shape in expected.items():
        if key not in found:
            raise ConfigError(
                f"model.weights={weights}: tensor {key} missing (the model needs {shape}, the checkpoint "
                f"has none; {len(set(expected) - set(found))} missing in all)"
            )
        if found[key][0] != shape:
            raise ConfigError(
                f"model.weights={weights}: tensor {key} has shape {found[key][0]} in {found[key][1].name}, "
                f"the model needs {shape}"
            )
    extra = [key for key in found if key not in expected and not _IGNORED.match(key)]
    if extra:
        raise ConfigError(
            f"model.weights={weights}: tensor {extra[0]} of shape {found[extra[0]][0]} in {found[extra[0]][1].name} "
            f"is not in the model (no such tensor there; {len(extra)} unexpected in all): another architecture or options"
        )


# ----------------------------------------------------------------------------- loading (each rank)


def import_readers() -> None:
    """Import what `load_weights` reads with, so that a measurement of the load (trainer/telemetry/
    memory.py measure_load) does not count the modules' code and objects as what loading holds."""
    import safetensors.torch  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401


@torch.no_grad()
def load_weights(model: nn.Module, weights: Path) -> None:
    """Fill this rank's (possibly sharded) materialised parameters from the checkpoint: every rank
    calls it (DCP's load plans collectively). See the module docstring for what a rank reads."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    config = find_transformer(model).config
    direct: dict[str, torch.Tensor] = {}
    permuted: dict[str, tuple[torch.Tensor, int]] = {}
    experts: dict[str, tuple[torch.Tensor, HfTensor]] = {}
    for name, param in model.named_parameters():
        tensor = hf_tensor(canonical_name(name), config)
        if tensor.experts is not None:
            experts[tensor.key] = (param, tensor)
        elif tensor.heads is None:
            direct[tensor.key] = param  # DCP fills a DTensor's local shard, reading only that slice
        else:
            permuted[tensor.key] = (param, tensor.heads)
    dcp.load(direct, storage_reader=HuggingFaceStorageReader(str(weights)))
    load_permuted(permuted, weights)
    load_experts(experts, weights)


def load_permuted(permuted: dict[str, tuple[torch.Tensor, int]], weights: Path) -> None:
    """Read each permuted tensor whole (safe_open reads one tensor at a time), into zerolab's
    rotary layout, and keep this rank's slice: DCP's reader can only copy slices as stored."""
    from safetensors import safe_open

    by_file: dict[Path, list[str]] = {}
    for key, (_, path) in header_shapes(safetensors_files(weights)).items():
        if key in permuted:
            by_file.setdefault(path, []).append(key)
    for path, keys in by_file.items():
        with safe_open(str(path), framework="pt") as f:
            for key in keys:
                param, heads = permuted[key]
                copy_full_into(param, to_meta_layout(f.get_tensor(key), heads))


def load_experts(experts: dict[str, tuple[torch.Tensor, HfTensor]], weights: Path) -> None:
    """Each stacked expert weight from its per-expert tensors, in expert order: only the experts whose rows
    this rank holds (`held_experts`), copied into its local tensor; where a shard cuts another dim, all E
    stacked and this rank's slice kept (`copy_full_into`, as for the permuted tensors). DCP's reader
    copies slices of one stored tensor only, and an expert weight is E of them."""
    from safetensors import safe_open

    if not experts:
        return
    where = {key: path for key, (_, path) in header_shapes(safetensors_files(weights)).items()}
    needed = {where[key] for _, tensor in experts.values() for key in tensor.keys}
    with contextlib.ExitStack() as stack:
        files = {path: stack.enter_context(safe_open(str(path), framework="pt")) for path in needed}
        for param, tensor in experts.values():
            keys, held = tensor.keys, held_experts(param, len(tensor.keys))
            if held is None:
                copy_full_into(param, torch.stack([files[where[key]].get_tensor(key) for key in keys]))
            elif held:
                rows = torch.stack([files[where[keys[e]]].get_tensor(keys[e]) for e in held])
                (param.to_local() if hasattr(param, "to_local") else param).copy_(rows)


def held_experts(param: torch.Tensor, count: int) -> list[int] | None:
    """The experts (indices on dim 0) whose whole rows `param` holds on this rank: all of a plain tensor's;
    a DTensor's share where only dim 0 is sharded (expert parallelism, FSDP2's dim-0 shards), found by
    distributing the experts' indices as the parameter is (no communication); None where a shard cuts
    another dim."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    if not isinstance(param, DTensor):
        return list(range(count))
    if any(isinstance(p, Shard) and p.dim != 0 for p in param.placements):
        return None
    index = distribute_tensor(torch.arange(count), param.device_mesh, param.placements, src_data_rank=None)
    return index.to_local().tolist()
