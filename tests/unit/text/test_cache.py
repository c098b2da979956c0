"""trainer/text: make-tokens' cache holds exactly the tokenizer's ids with EOS between documents,
made once; the corpus readers; the packed windows and the held-out split."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import compose_config, train_tokenizer, write_documents
from trainer.config import ConfigError, DataConfig, DataKind
from trainer.data import main, text_entries
from trainer.text.cache import ensure_entry, read_meta, token_dtype
from trainer.text.corpus import check_files, documents
from trainer.text.packed import IGNORE_INDEX, PackedText, document_batch, held_out
from trainer.text.tokenizer import TokenizerFiles

pytest.importorskip("tokenizers")  # the `data` extra
pytest.importorskip("datasets")


HELD_OUT_1234 = [5, 6, 17, 18, 20, 24, 28, 34, 36, 38, 48, 49, 64, 71, 72, 75, 77, 80, 81, 83, 85, 89, 92, 93, 99, 103,
                 107, 114, 118]  # fmt: skip
"""held_out(120, 0.25, seed=1234): 29 documents."""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str], Path]:
    """A 120-document jsonl corpus and a 64-token BPE tokenizer trained on it."""
    tmp = tmp_path_factory.mktemp("corpus")
    texts = write_documents(tmp / "corpus.jsonl", 120)
    return tmp / "corpus.jsonl", texts, train_tokenizer(tmp / "tokenizer", texts)


def expected_stream(tokenizer_dir: Path, texts: list[str]) -> np.ndarray:
    """Tokenizer.encode_batch's ids, EOS after each document."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eos = tokenizer.token_to_id("</s>")
    return np.asarray([i for e in tokenizer.encode_batch(texts) for i in [*e.ids, eos]])


def make_tokens(
    corpus: Path, tokenizer: Path, cache: Path, capsys: pytest.CaptureFixture[str], *extra: str
) -> tuple[Path, str]:
    assert main(["make-tokens", "--tokenizer", str(tokenizer), *extra, str(corpus), str(cache)]) == 0
    out = capsys.readouterr().out
    return Path(out.rsplit(" at ", 1)[1].strip()), out


def test_make_tokens_writes_encode_batchs_ids_with_eos_between_documents_once(
    corpus: tuple[Path, list[str], Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, texts, tokenizer = corpus
    entry, out = make_tokens(path, tokenizer, tmp_path / "cache", capsys)
    tokens = np.load(entry / "tokens.npy")
    expected = expected_stream(tokenizer, texts)
    assert tokens.dtype == np.uint16 and np.array_equal(tokens, expected)
    starts = np.load(entry / "starts.npy")
    assert starts[-1] == len(expected) and len(starts) == len(texts) + 1
    assert np.all(expected[starts[1:] - 1] == read_meta(entry).eos_id)  # each document ends in EOS
    assert out.startswith("wrote ")

    written = (entry / "tokens.npy").stat().st_mtime_ns
    again, out = make_tokens(path, tokenizer, tmp_path / "cache", capsys)
    assert (
        again == entry and out.startswith("reused ") and (entry / "tokens.npy").stat().st_mtime_ns == written
    )

    # Worker processes write the same bytes, under the same key.
    workers, _ = make_tokens(path, tokenizer, tmp_path / "cache2", capsys, "--workers", "2")
    assert workers.name == entry.name
    assert (workers / "tokens.npy").read_bytes() == (entry / "tokens.npy").read_bytes()


def test_the_key_follows_the_content(corpus: tuple[Path, list[str], Path], tmp_path: Path) -> None:
    path, texts, tokenizer = corpus
    files = TokenizerFiles.of(str(tokenizer))
    first, _ = ensure_entry(str(tmp_path), [path], "text", files, "data.files")
    edited = tmp_path / "edited.jsonl"
    edited.write_text(path.read_text().replace("cat", "dog", 1))
    second, existed = ensure_entry(str(tmp_path), [edited], "text", files, "data.files")
    assert second != first and not existed


def test_the_key_changes_with_the_tokenizer_alone_or_the_text_field_alone(
    corpus: tuple[Path, list[str], Path], tmp_path: Path
) -> None:
    """data=text's cache entry (trainer/data.py text_entries, the job's own path to it): the same config
    twice and a byte-identical copy of the tokenizer elsewhere are the same entry; another tokenizer
    (trained on the same texts, 48 ids), another tokenizer_config.json alone, or data.text_field alone
    are each another entry. No tokenization: the key is the inputs' hash."""
    path, texts, tokenizer = corpus
    data = DataConfig(
        kind=DataKind.text, files=[str(path)], tokenizer=str(tokenizer), cache_dir=str(tmp_path)
    )

    def entry(tokenizer_dir: Path, text_field: str = "text") -> Path:
        return text_entries(dataclasses.replace(data, tokenizer=str(tokenizer_dir), text_field=text_field))[0]

    base = entry(tokenizer)
    assert base.parent == tmp_path and entry(tokenizer) == base
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (copy / name).write_bytes((tokenizer / name).read_bytes())
    assert entry(copy) == base  # the key is the files' content, not where they are
    other = train_tokenizer(tmp_path / "other", texts, vocab_size=48)
    assert (other / "tokenizer.json").read_bytes() != (tokenizer / "tokenizer.json").read_bytes()
    (other / "tokenizer_config.json").write_bytes((tokenizer / "tokenizer_config.json").read_bytes())
    assert entry(other) != base  # only tokenizer.json differs
    (copy / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "<unk>"}))
    assert entry(copy) != base  # only tokenizer_config.json differs
    assert entry(tokenizer, "body") != base  # only the field differs
    assert len({base, entry(other), entry(copy), entry(tokenizer, "body")}) == 4


def test_ids_past_uint16_are_kept_as_uint32(tmp_path: Path) -> None:
    assert token_dtype(1 << 16) == np.uint16 and token_dtype((1 << 16) + 1) == np.uint32
    texts = [" ".join(f"w{i}" for i in range(start, start + 7000)) for start in range(0, 70000, 7000)]
    (tmp_path / "big.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tokenizer = train_tokenizer(tmp_path / "tok", texts, vocab_size=70003, word_level=True)
    entry, _ = ensure_entry(
        str(tmp_path / "cache"),
        [tmp_path / "big.jsonl"],
        "text",
        TokenizerFiles.of(str(tokenizer)),
        "data.files",
    )
    tokens = np.load(entry / "tokens.npy")
    assert read_meta(entry).vocab_size == 70003
    assert tokens.dtype == np.uint32 and np.array_equal(tokens, expected_stream(tokenizer, texts))


def test_txt_paragraphs_parquet_records_and_their_errors(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "a.txt").write_text("one line\nsame paragraph\n\nsecond\n")
    pq.write_table(pa.table({"body": ["from parquet", ""]}), tmp_path / "b.parquet")
    paths = check_files([str(tmp_path / "a.txt"), str(tmp_path / "b.parquet")], "data.files")
    # Paragraphs as datasets' text builder splits them (sample_by="paragraph"); empty documents dropped.
    assert list(documents(paths, "body", "data.files")) == [
        "one line\nsame paragraph",
        "second\n",
        "from parquet",
    ]
    with pytest.raises(ConfigError, match=r"^data.text_field: .*b.parquet has a record without field 'text'"):
        list(documents(paths[1:], "text", "data.files"))
    with pytest.raises(ConfigError, match=r"^data.files: .*c.csv has suffix '.csv'; allowed: .txt, .json"):
        (tmp_path / "c.csv").write_text("x")
        check_files([str(tmp_path / "c.csv")], "data.files")


def test_a_0_byte_file_is_one_line_in_the_job_and_in_make_tokens(
    corpus: tuple[Path, list[str], Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 60: a 0-byte .jsonl was `generator raised StopIteration` from datasets' json builder."""
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ConfigError) as err:
        check_files([str(corpus[0]), str(tmp_path / "empty.jsonl")], "data.files")
    assert (
        str(err.value)
        == f"data.files: {tmp_path / 'empty.jsonl'} is empty (0 bytes); list files that hold documents"
    )
    with pytest.raises(SystemExit) as exit:
        main(
            [
                "make-tokens",
                "--tokenizer",
                str(corpus[2]),
                str(tmp_path / "empty.jsonl"),
                str(tmp_path / "cache"),
            ]
        )
    assert exit.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"python -m trainer.data: error: FILES: {tmp_path / 'empty.jsonl'} is empty (0 bytes); list files that "
        "hold documents"
    )


def test_windows_documents_and_the_held_out_split(
    corpus: tuple[Path, list[str], Path], tmp_path: Path
) -> None:
    path, texts, tokenizer = corpus
    entry, _ = ensure_entry(str(tmp_path), [path], "text", TokenizerFiles.of(str(tokenizer)), "data.files")
    stream, starts = np.load(entry / "tokens.npy"), np.load(entry / "starts.npy")
    dataset = PackedText(entry, 16, document=True)
    sample = dataset[3]  # the window at 3 * 16
    assert sample[0].tolist() == stream[48:65].tolist()
    assert sample[1].tolist() == (np.searchsorted(starts, np.arange(48, 65), side="right")).tolist()
    inputs, targets, numbers = document_batch(sample[None])
    crossing = (sample[1, 1:] != sample[1, :-1]).nonzero().flatten()
    assert crossing.numel() >= 1 and torch.all(targets[0, crossing] == IGNORE_INDEX)
    assert torch.equal(inputs[0], sample[0, :-1]) and torch.equal(numbers[0], sample[1, :-1])

    apart = held_out(len(texts), 0.25, seed=1234)
    # 29 of the 120 documents at fraction 0.25 and seed 1234, pinned: numpy's PCG64 from SeedSequence(1234),
    # each draw (raw >> 11) * 2**-53 < 0.25, computed once from the raw bits (not with held_out)
    assert (len(apart), int(apart.sum())) == (120, 29) and np.flatnonzero(apart).tolist() == HELD_OUT_1234
    train, validation = (PackedText(entry, 16, False, keep) for keep in (~apart, apart))
    assert train.num_tokens + validation.num_tokens == len(stream)
    first_held = HELD_OUT_1234[0]  # document 5: the held-out stream starts with it
    assert validation[0].tolist() == stream[starts[first_held] : starts[first_held] + 17].tolist()
    held_tokens = sum(int(starts[d + 1] - starts[d]) for d in HELD_OUT_1234)
    assert validation.num_tokens == held_tokens


def test_a_shuffled_epoch_reads_every_window_once_in_its_own_seeded_order(
    corpus: tuple[Path, list[str], Path], tmp_path: Path
) -> None:
    """data.shuffle: epoch e is a permutation of the stream's whole windows drawn from (data_seed, e); the
    same index gives the same window in a fresh dataset (a resume, another rank count)."""
    path, _, tokenizer = corpus
    entry, _ = ensure_entry(str(tmp_path), [path], "text", TokenizerFiles.of(str(tokenizer)), "data.files")
    stream = np.load(entry / "tokens.npy")
    dataset = PackedText(entry, 16, False, shuffle_seed=1234)
    n = dataset.windows
    assert n == (len(stream) - 1) // 16
    epochs = [[dataset.start(e * n + k) for k in range(n)] for e in (0, 1)]
    assert all(sorted(starts) == [16 * k for k in range(n)] for starts in epochs)
    assert epochs[0] != epochs[1] and epochs[0] != sorted(epochs[0])
    fresh = PackedText(entry, 16, False, shuffle_seed=1234)
    index = n + 7
    assert (
        fresh[index].tolist() == dataset[index].tolist() == stream[epochs[1][7] : epochs[1][7] + 17].tolist()
    )
    other = PackedText(entry, 16, False, shuffle_seed=99)
    assert [other.start(k) for k in range(n)] != epochs[0]  # another data_seed, another order


def test_model_hf_lends_data_text_the_tokenizer_of_its_directory() -> None:
    pytest.importorskip("transformers")
    config_json = Path(__file__).parents[2] / "configs" / "llama_config.json"
    config = compose_config(
        "model=hf", f"model.config={config_json}", "data=text", "data.files=[corpus.jsonl]"
    )
    assert config.data.tokenizer == str(config_json.resolve().parent)
    with pytest.raises(ConfigError, match=r"^data.tokenizer must name a tokenizer.json or a model directory"):
        compose_config("data=text", "data.files=[corpus.jsonl]")


def test_a_pool_worker_takes_sigterms_default_whatever_its_parent_handles(
    corpus: tuple[Path, list[str], Path], tmp_path: Path
) -> None:
    """make-tokens' workers fork from a process that may only note SIGTERM (one that handles stops):
    each takes SIGTERM's default back, so Pool.terminate, which signals the workers still waiting for
    a task, ends them and the pool's exit cannot wait forever (a test worker left holding a RankStop's
    handlers once did)."""
    import multiprocessing
    import signal

    from tests.helpers import keeping_stop_handlers
    from trainer.faults.stop import RankStop
    from trainer.text.cache import _init_worker

    _, _, tokenizer = corpus
    with keeping_stop_handlers():
        RankStop(tmp_path, watches_request=False)  # SIGTERM only noted in this process now
        assert signal.getsignal(signal.SIGTERM) != signal.SIG_DFL
        context = multiprocessing.get_context("fork")
        with context.Pool(1, initializer=_init_worker, initargs=(str(tokenizer / "tokenizer.json"),)) as pool:
            assert pool.apply(signal.getsignal, (signal.SIGTERM,)) == signal.SIG_DFL
