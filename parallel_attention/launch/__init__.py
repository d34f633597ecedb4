"""What every torchrun entry point does around its work (pretraining, generation, the self-check): the ranks
agree on their settings (`agreement`), and an error that every rank found is said once, by rank 0
(`report_once`); which process is rank 0 is decided in one place (`rank_zero`). Imports `tensor_parallel` only."""
