"""A run's data, from text to batches, in two wings that share a few modules.

`prepare/` (once, streaming, resumable) tokenizes a corpus into shards; `read/` opens them and draws each step's
batches. Both use the pieces here: `indexed_dataset` (Megatron-LM's shard format, written and read), `token_files`
(meta.json, what it records and the sha256 checks, with `preparation_command` to prepare a directory again; the
previous format in `previous_format` alone), `chunk_hashes` (files verified piece by piece) and `document_split` (the
validation hold-out rule); the tokenizer and its identity are `training/tokenizer.py`. read/ may import prepare/ (a
run prepares its data_dir first), never the reverse.
"""
