"""Reading: a run's prepared data (or Megatron-LM prefixes) as the batches of each step, a pure function of
(seed, step).

`run_data` builds it on every rank (rank 0 prepares data.data_dir through prepare/, a refusal on any rank is
every rank's); `blend_sources` opens the blend's sources, each a `token_source` indexed once per filesystem
(`source_index`, `document_index`, `index_cache`); `sampling` orders their windows, `batches` draws each step's
global batch and `batch_prefetch` reads the next one ahead; `blend_history` carries epochs across a changed blend;
`data_identity` records and checks what a checkpoint trained on, `step_records` says what any step read, and
`validation_metrics` gives the validation loss per source.
"""
