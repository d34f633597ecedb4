"""The kernel wing: everything that computes attention on local tensors, and the one place that chooses among it.

    choice             which kernel runs for a config, device, dropout and context-parallel kind: every module
                       that depends on the device asks it at construction and when it moves
    core_attention     the block's core attention: one module per backend (SDPA, the CPU kernel, math, apex) and
                       how attention dropout draws its masks (dropout_rng), selective recomputation around it
    causal_chunks      the CPU kernel: causal self-attention in chunks of query rows, and per packed document
    document_kernels   SDPA over packed documents: one varlen_attn call on CUDA, else one SDPA call per document
    ring_blocks        the context-parallel ring's per-pair kernels (fused flash operators, explicit-lse math)
    flash_ops          the fused flash operators of each device, as one table, and the loop that runs them piece
                       by piece (documents.Piece) for the CPU kernel and the ring's pairs alike
    apex_kernels       NVIDIA apex, imported lazily (None where absent: the torch fallback runs)
    device_choice      ChosenByDevice: a module that chooses at construction and again when it moves
    kernel_paths       what each path runs in this environment, for logs and the self-check (read from choice)

What communicates (the ring exchange, the all-to-all, the zigzag layout) stays in `context_parallel/`.
Importing this package imports none of its modules: `attention_config` reads `apex_kernels` without pulling in
the kernels.
"""
