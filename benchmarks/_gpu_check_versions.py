"""gpu_check.sh's first lines: what this machine offers (torch, CUDA, NCCL, driver, GPU), and whether the optional
pytest step can run. Needs only torch; prints the facts, and with --json PATH also writes them there.

    python3 benchmarks/_gpu_check_versions.py [--json PATH]     (exit 2 when torch itself is missing)
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys


def _driver() -> str:
    """The NVIDIA driver's version as nvidia-smi reports it (torch does not expose it)."""
    if shutil.which("nvidia-smi") is None:
        return "none (no nvidia-smi on PATH)"
    try:
        found = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return "unknown (nvidia-smi did not answer within 20 s)"
    return found.stdout.splitlines()[0].strip() if found.returncode == 0 and found.stdout else "unknown"


def facts() -> dict:
    import torch

    cuda = torch.cuda.is_available()
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if cuda and torch.distributed.is_nccl_available() else None
    return {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
            "nccl": nccl, "driver": _driver(), "gpus": [torch.cuda.get_device_name(i)
                                                      for i in range(torch.cuda.device_count())] if cuda else [],
            "pytest": importlib.util.find_spec("pytest") is not None}


def main(argv: list[str]) -> int:
    if importlib.util.find_spec("torch") is None:
        print(f"gpu_check: {sys.executable} has no torch: run it with an interpreter that has a CUDA build of torch "
              "(PYTHON=/path/to/python3 scripts/gpu_check.sh)", file=sys.stderr)
        return 2
    found = facts()
    gpus = ", ".join(found["gpus"]) or "none visible to torch"
    print(f"torch {found['torch']}  CUDA {found['cuda']}  NCCL {found['nccl']}  driver {found['driver']}  "
          f"python {found['python']}\nGPU: {gpus}", file=sys.stderr)
    if not found["pytest"]:
        print("pytest: not installed for this interpreter: the cuda_tests step is skipped (pip install pytest runs "
              "it; every other step needs only torch, numpy, pyyaml, safetensors, tokenizers and tqdm)",
              file=sys.stderr)
    if argv[:1] == ["--json"]:
        with open(argv[1], "w", encoding="utf-8") as f:
            json.dump(found, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
