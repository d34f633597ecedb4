"""Pipeline parallelism: the layers cut into stages (`layout`), the schedules as action lists (`schedules`), and
the runner that executes a stage's actions and exchanges activations and gradients with its neighbours (`runner`).
May import `tensor_parallel` and `transformer`; the trainer's use of it is `training/step.py` (every pp)."""
