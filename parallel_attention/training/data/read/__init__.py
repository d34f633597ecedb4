"""Reading: a run's prepared data (or Megatron-LM prefixes) as the batches of each step, a pure function of
(seed, step).

`run_data` builds it on every rank (rank 0 prepares data.data_dir through prepare/, a refusal on any rank is
every rank's); `batches` opens the blend and draws each step's global batch from it (the epoch and blend orders
are its own); the blend's sources are `token_source`s, each indexed once per filesystem (`source_index`, in
directories `index_cache` builds once); `batch_prefetch` reads the next batch ahead; `blend_history` carries epochs
across a changed blend; `data_identity` records and checks what a checkpoint trained on, `step_records` says what
any step read, and `validation` gives the fixed validation set and its loss per source.
"""
