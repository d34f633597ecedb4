"""A run's data, from text to batches.

Preparation (once, streaming, resumable): `corpus` and `corpus_formats` read documents, `encoding` tokenizes them
with `tokenizer`, `preparation` writes shards of Megatron-LM's indexed format (`indexed_dataset`), resuming through
`partial_preparation`; `prepared` prepares a run's `data_dir` when it does not exist and `token_files` verifies what
was written. Reading: `token_source` opens a prepared directory or a Megatron prefix, `blend` a weighted list of
them, `sampling` orders the windows (epochs without replacement, the blend's interleaving), `batches` draws each
step's global batch, `batch_prefetch` reads the next one ahead. `agreement`, `identity` and `step_records` check
that every rank and every resume read the same data, and record what each step read.
"""
