"""gpu_check.sh --gpus N's hang step: under the collective guard, a collective that one rank never joins ends the
others with CollectiveTimeoutError naming the operation and the group, on NCCL as on gloo (tests/test_timeouts.py
proves it on gloo; on NCCL it rests on the guard's TORCH_NCCL_BLOCKING_WAIT=1).

    torchrun --nproc-per-node N benchmarks/_gpu_check_hang.py [--timeout-s 20]   (rank 0 prints one JSON line)

Every rank but 0 sleeps past the timeout and leaves; rank 0 all-reduces over the tensor-parallel group (tp = N).
Exit 0 when rank 0's error names all_reduce and the tensor-parallel group within twice the timeout. The ranks leave
with os._exit: a communicator whose collective timed out may hang in its own teardown.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from parallel_attention.tensor_parallel import CollectiveTimeoutError, init_distributed
from parallel_attention.tensor_parallel.collective_log import enable_collective_log
from parallel_attention.tensor_parallel.collectives import all_reduce
from parallel_attention.tensor_parallel.parallel_state import get_tensor_model_parallel_group


def silent_peer(timeout_s: float, device: torch.device) -> dict:
    """Rank 0's all-reduce that nobody joins: what it raised, and after how long."""
    started = time.monotonic()
    try:
        all_reduce(torch.ones(4, device=device), get_tensor_model_parallel_group())
        if device.type == "cuda":
            torch.cuda.synchronize()
        raised = "nothing"
    except CollectiveTimeoutError as error:
        raised = str(error).splitlines()[0]
    waited = time.monotonic() - started
    named = raised.startswith("all_reduce on the tensor-parallel group")
    return {"raised": raised, "waited_s": round(waited, 1), "timeout_s": timeout_s,
            "ok": named and waited < 2 * timeout_s + 10}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout-s", type=float, default=20.0, help="the groups' timeout (parallel.timeout_s)")
    args = parser.parse_args(argv)
    enable_collective_log()  # before the groups exist: NCCL's blocking wait
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = init_distributed(world, timeout=args.timeout_s)
    if dist.get_rank() != 0:
        time.sleep(args.timeout_s + 5)
        os._exit(0)
    report = silent_peer(args.timeout_s, device)
    print(json.dumps(report), flush=True)
    os._exit(0 if report["ok"] else 1)


if __name__ == "__main__":
    sys.exit(main())
