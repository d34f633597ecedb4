"""gpu_check.sh's summary: every step's outcome plus the facts and figures each one shows, as one JSON file, with
the performance targets (issue 31) reported whether met or not.

    python benchmarks/_gpu_check_summary.py [--dry-run] LOGS OUT.json     (exit 1 when a step failed or timed out;
                                                                         a skipped step says why and fails nothing)

--dry-run: the steps only checked that they would start (status dry_run); there are no figures to read.
Every step that failed, timed out or was skipped carries `reason` (in words) and `log_tail`, the last TAIL_LINES
lines of its log: the summary alone says what to fix next.
"""

from __future__ import annotations

import json
import math
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def _rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _pretrain(logs: Path, dtype: str) -> dict:
    """Losses finite and falling; for fp16 also the loss scale the checkpoint saved."""
    run = logs / f"run_{dtype}"
    rows = [r for r in _rows(run / "metrics.jsonl") if "loss" in r]
    losses = [r["loss"] for r in rows]
    facts = {"steps": len(rows), "first_loss": losses[0] if losses else None,
             "last_loss": losses[-1] if losses else None, "mfu_last": rows[-1].get("mfu") if rows else None,
             "first_finite_grad_norm": next((r["grad_norm"] for r in rows if r.get("grad_norm") is not None), None)}
    facts["ok"] = bool(losses) and all(x is not None and math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    manifests = sorted(run.glob("checkpoints/step_*/manifest.json"))
    if dtype == "fp16":
        scale = json.loads(manifests[-1].read_text())["extra"]["loss_scaler"]["scale"] if manifests else None
        facts["loss_scale"] = scale
        facts["ok"] = facts["ok"] and scale is not None and scale > 1
    return facts


def _junit(path: Path) -> dict:
    if not path.exists():
        return {}
    suite = ET.parse(path).getroot()
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    return {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}


def _json(path: Path, keys: tuple[str, ...]) -> dict:
    if not path.exists():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return {k: data.get(k) for k in keys if k in data} if keys else data


TAIL_LINES = 30


def _reason(status: str) -> str:
    """What a step's status means, in words."""
    kind, _, detail = status.partition("(")
    detail = detail.rstrip(")")
    if kind == "skipped":
        return f"skipped: {detail}"
    if kind == "timeout":
        return f"interrupted at its limit ({detail})" if detail.endswith("s") else f"not run: {detail}"
    if detail == "check":
        return "it ran to its end, but the facts it reports fail their check (see this entry's figures)"
    if detail == "plumbing":
        return "it would not start (its log names what is missing)"
    return f"its command exited with status {detail}"


def _explain(logs: Path, steps: dict) -> None:
    """`reason` and `log_tail` on every step that did not pass."""
    for step in steps.values():
        if step["status"] in ("passed", "dry_run"):
            continue
        log = logs / step["log"]
        lines = log.read_text(encoding="utf-8", errors="replace").splitlines() if log.exists() else []
        step["reason"], step["log_tail"] = _reason(step["status"]), lines[-TAIL_LINES:]


TARGETS = {"attention_block": ("fraction_of_peak", 0.5), "train_1b": ("mfu", 0.4)}


def _last_json_line(logs: Path, step: dict) -> dict:
    log = logs / step["log"]
    lines = log.read_text(encoding="utf-8").splitlines() if log.exists() else []
    return json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}


def _targets(steps: dict) -> dict:
    """Each target with the figure measured (None when its step produced none) and whether it is met."""
    found = {}
    for name, (key, target) in TARGETS.items():
        figure = steps.get(name, {}).get(key, steps.get(name, {}).get("result", {}).get(key))
        found[name] = {key: figure, "target": target, "met": figure is not None and figure >= target}
    return found


def _figures(logs: Path, steps: dict) -> None:
    """Every step's facts and figures, added to its entry; a step whose facts fail turns failed(check)."""
    steps.get("cuda_tests", {}).update(_junit(logs / "cuda_tests.xml"))
    bf16, fp16 = _pretrain(logs, "bf16"), _pretrain(logs, "fp16")
    if bf16["first_finite_grad_norm"] and fp16["first_finite_grad_norm"]:  # unscaled: the same size as bf16's
        ratio = fp16["first_finite_grad_norm"] / bf16["first_finite_grad_norm"]
        fp16["grad_norm_ratio_to_bf16"], fp16["ok"] = ratio, fp16["ok"] and 0.5 < ratio < 2
    for name, facts in (("pretrain_bf16", bf16), ("pretrain_fp16", fp16)):
        steps.get(name, {}).update(facts)
        if name in steps and not facts["ok"] and steps[name]["status"] == "passed":
            steps[name]["status"] = "failed(check)"
    for name in ("probe", "flash_sdpa", "kernels", "attention_block", "fp8", "moe", "ring_cp",
                 "hang_named"):
        if name in steps:
            steps[name].update(_last_json_line(logs, steps[name]))
    steps.get("bench_attention", {}).update(result=_json(logs / "bench_attention.json", ()))
    for name in ("train_1b", "train_1b_fp8"):
        steps.get(name, {}).update(result=_json(logs / f"{name}.json", (
            "step_ms", "tokens_per_s", "tflops", "mfu", "peak_tflops", "flops_per_token",
            "optimizer_state_bytes_per_rank", "saved_activation_bytes")))
    bf16_ms, fp8_ms = (steps.get(name, {}).get("result", {}).get("step_ms") for name in ("train_1b", "train_1b_fp8"))
    if bf16_ms and fp8_ms:  # the same step in bf16 over FP8: > 1 where FP8 pays
        steps["train_1b_fp8"]["fp8_step_speedup"] = round(bf16_ms / fp8_ms, 3)


def main(logs: Path, out: Path, dry_run: bool = False) -> int:
    steps = {}
    for line in (logs / "steps.tsv").read_text(encoding="utf-8").splitlines():
        name, status, seconds = line.split("\t")
        steps[name] = {"status": status, "seconds": int(seconds), "log": f"{name}.log"}  # in the logs' tarball
    if not dry_run:
        _figures(logs, steps)
    _explain(logs, steps)
    ok = all(s["status"] in ("passed", "dry_run") or s["status"].startswith("skipped") for s in steps.values())
    skipped = [name for name, s in steps.items() if s["status"].startswith("skipped")]
    summary = {"ok": ok, "dry_run": dry_run, "versions": _json(logs / "versions.json", ()),
               "logs": str(out.with_name(out.stem + "_logs.tar.gz")), "steps": steps, "skipped": skipped,
               "targets": {} if dry_run else _targets(steps)}
    out.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    verdict = ("dry run: every step would start" if dry_run else "all passed") if ok else "FAILED"
    if ok and skipped:
        verdict += f" but {', '.join(skipped)} (skipped: see its reason)"
    print(f"gpu_check: {verdict}; summary in {out}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    dry = sys.argv[1:2] == ["--dry-run"]
    sys.exit(main(Path(sys.argv[1 + dry]), Path(sys.argv[2 + dry]), dry))
