"""The cluster self-check: `python -m parallel_attention.check`, the first thing to run on a new cluster.

    torchrun --standalone --nproc-per-node N -m parallel_attention.check [--tp P] [--dtype bfloat16]

It runs at any world size (P defaults to the world size and must divide it) and checks, at this p,
on this device and dtype:

    collectives       all-reduce, all-gather and reduce-scatter give the right sums on the
                      tensor-parallel, data-parallel and world groups; all-reduce bus bandwidth
    attention         ParallelSelfAttention (MHA, GQA with rotary and padding, MQA; each with and
                      without sequence parallelism) against a plain float64 CPU attention from the
                      same canonical weights: output, input gradient, every canonical weight gradient
    model             a 2-layer GPTModel (GPT-2-like and Llama-like, +-SP) against the same model at
                      p = 1 in float64 on CPU: loss and every canonical weight gradient
    init              the canonical weights after the same seed are bitwise those of p = 1
    replicas          replicated parameters (and k/v replica rows) are identical across the
                      tensor-parallel group, every parameter across the data-parallel group
    collective-count  one attention block issues exactly the documented collectives, all on the
                      tensor-parallel group: forward 1 all-reduce, backward 1 all-reduce
                      (sequence parallel: 1 all-gather + 1 reduce-scatter each way); p = 1: none

Output (a contract for scripts): informational lines start with `# `; then one line per check,
`[ok] NAME: detail` or `[FAIL] NAME: detail`; then a last line `check: PASS`, or `check: FAIL`
followed by the failed names. Exit status 0 or 1. Only global rank 0 prints; a check fails if it
failed on any rank. `--inject-fault {replica,layout}` (hidden, for testing this tool) perturbs one
replicated parameter on the last rank, or loads a mis-sharded fused QKV weight.

May import tensor_parallel and transformer; nothing imports this package eagerly.
"""
