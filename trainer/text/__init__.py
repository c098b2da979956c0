"""Training on local text: a model's own tokenizer, local files, a token cache, packed rows.

- tokenizer.py: the tokenizer of `data.tokenizer` (a tokenizer.json or a model directory) and its BOS/EOS;
- corpus.py: the documents of `data.files` (txt, json/jsonl, parquet), read by `datasets`;
- cache.py: the token stream, tokenised once and kept keyed by the files' content and the tokenizer
  (`python -m trainer.data make-tokens --tokenizer`);
- packed.py: the stream as a dataset of seq_len + 1 windows (concat or document packing) and its
  held-out split.

The job process tokenises (tokenizers and datasets are imported there only); ranks open the cache
with numpy.
"""
