"""`data:`, `dataloader:` and `eval:` (DataConfig, DataloaderConfig, EvalConfig): where tokens come from,
how they are loaded, and the held-out loss."""

from __future__ import annotations

from dataclasses import dataclass, field

from trainer.config.enums import DataKind, Packing
from trainer.config.errors import _require


@dataclass
class DataloaderConfig:
    """conf/dataloader/*.yaml: options handed to torch.utils.data.DataLoader."""

    num_workers: int = 0
    """Worker processes per rank; 0 loads in the rank's own process."""
    prefetch_factor: int | None = None
    """Batches each worker loads ahead; needs num_workers > 0."""
    pin_memory: bool = False
    """Page-lock batches for faster host-to-GPU copies."""
    persistent_workers: bool = False
    """Keep workers alive between epochs; needs num_workers > 0."""

    def __post_init__(self) -> None:
        _require(self.num_workers >= 0, f"dataloader.num_workers must be >= 0, got {self.num_workers}")
        if self.num_workers == 0:
            _require(
                self.prefetch_factor is None, "dataloader.prefetch_factor needs dataloader.num_workers > 0"
            )
            _require(
                not self.persistent_workers, "dataloader.persistent_workers needs dataloader.num_workers > 0"
            )
        _require(
            self.prefetch_factor is None or self.prefetch_factor >= 1,
            f"dataloader.prefetch_factor must be >= 1, got {self.prefetch_factor}",
        )


@dataclass
class DataConfig:
    """conf/data/*.yaml: where training tokens come from."""

    kind: DataKind = DataKind.synthetic
    """synthetic (a learnable Markov stream), tokens (a memory-mapped .npy of token ids) or text (local
    files through a model's tokenizer, trainer/text/)."""
    path: str | None = None
    """tokens only: the .npy file made by `python -m trainer.data make-tokens`."""
    branching: int = 4
    """synthetic only: how many next tokens each token may be followed by."""
    data_seed: int = 1234
    """synthetic: seed of the Markov chain's transition table (fixed across runs); text: of the held-out split
    and of data.shuffle's permutations."""
    files: list[str] = field(default_factory=list)
    """text only: .txt (one document per blank-line-separated paragraph), .json/.jsonl, .parquet files."""
    text_field: str = "text"
    """text only: the field of a json/jsonl/parquet record that holds the document."""
    tokenizer: str | None = None
    """text only: a tokenizer.json, or a model directory holding one (BOS/EOS from its tokenizer_config.json)."""
    packing: Packing = Packing.concat
    """text only: concat (documents joined with EOS, attending across) or document (block-causal: a row's
    documents do not attend to each other, and no target crosses a document boundary)."""
    shuffle: bool = False
    """text only: each epoch reads the corpus's seq_len windows in a permutation drawn from data_seed and
    the epoch (the same on any number of ranks; a resume reads on exactly); false: in stream order."""
    validation_files: list[str] = field(default_factory=list)
    """text only: held-out files for eval (loss/val); else `validation_fraction` of the documents (not both)."""
    validation_fraction: float = 0.0
    """text only: the fraction of documents set apart for eval, chosen by `data_seed`; 0 with no
    validation_files: no held-out text."""
    cache_dir: str = "~/.cache/zerolab/tokens"
    """text only: where token streams are cached, keyed by the files' content and the tokenizer."""

    def __post_init__(self) -> None:
        _require(self.branching >= 1, f"data.branching must be >= 1, got {self.branching}")
        if self.kind == DataKind.tokens:
            _require(bool(self.path), "data.path must name a token file (.npy) when data=tokens")
        _require(
            0 <= self.validation_fraction < 1,
            f"data.validation_fraction must be in [0, 1), got {self.validation_fraction}",
        )
        # Both would hold the fraction out of training yet evaluate only the files: refused, not dropped.
        _require(
            not (self.validation_files and self.validation_fraction > 0),
            f"data.validation_files and data.validation_fraction={self.validation_fraction}: choose one (held-out "
            "files, or that fraction of data.files' documents); set data.validation_fraction=0 with validation_files",
        )

    @property
    def masks_documents(self) -> bool:
        """data.packing=document, which data=text alone reads: attention gets a block-causal mask."""
        return self.kind == DataKind.text and self.packing == Packing.document

    @property
    def has_validation(self) -> bool:
        """Held-out text: validation files or a fraction of the documents (synthetic: always, trainer/data.py)."""
        return bool(self.validation_files) or self.validation_fraction > 0


@dataclass
class EvalConfig:
    """conf/train.yaml `eval:`: the held-out loss (`loss/val`), on the same batches every time (trainer/rank/evaluate.py)."""

    every: int = 0
    """Optimizer steps between evaluations (and after the last step); 0: none."""
    batches: int = 4
    """Global batches (micro_batch * grad_accum * ranks sequences each) of held-out data per evaluation."""

    def __post_init__(self) -> None:
        _require(self.every >= 0, f"eval.every must be >= 0, got {self.every}")
        _require(self.batches >= 1, f"eval.batches must be >= 1, got {self.batches}")
