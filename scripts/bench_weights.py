"""Weight sync after a learner step: tensors through shared memory against a folder on disk.

Tiny CPU run (tiny model, one dtype, ~2 min):
    python scripts/bench_weights.py --model tiny --dtypes float32 --reps 2
Default (SmolLM2-135M, fp32 and bf16, the learner step of bench_learner.py):
    python scripts/bench_weights.py

For each dtype one Megatron learner takes timed steps on a random batch (the step of
`bench_learner.py`: 8 rows × 256 tokens by default), and one SGLang server of that dtype
runs on the same host. Both paths start from the learner's parameters and end with the server
answering that it serves the new version; each is timed `--reps` times (median printed):
- disk: `publish_weights` (gather the HF state, write safetensors + config under a temporary
  name, rename) then the server's `/update_weights_from_disk` (`SGLangEngine`), as a run does;
- tensor: gather the same HF state, then `SGLangEngine.update_weights_from_tensor` (the
  tensors travel as shared-memory handles between `/begin_weight_update` and
  `/end_weight_update`; the server copies them into its parameters).
Both updates pause generation in place around the load (`EngineConfig.weight_update:
continue`, the default); the server is idle here, so no request waits. The figure of merit is
(sync seconds) / (learner step seconds); the issue's goal is at most 0.05. The tensor path
applies only where learner and server share a host; across nodes the folder is the path.
The last line reads `tensor/disk sync time: <fp32 ratio> fp32, <bf16 ratio> bf16`.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a bare checkout

import torch  # noqa: E402

from bench_env import dtype_header  # noqa: E402
from bench_learner import learner_config, make_batch, seconds  # noqa: E402
from actors.engines.sglang import EngineConfig, SGLangEngine  # noqa: E402
from learners.megatron.learner import MegatronLearner  # noqa: E402
from learners.megatron.model import ModelSpec  # noqa: E402
from runtime.models import resolve_model  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="provisioned name or HF folder")
    parser.add_argument("--dtypes", default="float32,bfloat16",
                        help="comma-separated learner and engine dtypes")
    parser.add_argument("--rows", type=int, default=8, help="sequences in the learner batch")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt tokens (no loss)")
    parser.add_argument("--steps", type=int, default=2,
                        help="timed learner steps after one warm-up (median reported)")
    parser.add_argument("--reps", type=int, default=3,
                        help="timed syncs per path, after one warm-up sync each")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    return parser.parse_args()


def median_s(values: list[float]) -> float:
    return statistics.median(values)


def bench_dtype(args: argparse.Namespace, model_path: str, dtype: str, tmp: Path) -> dict:
    """Step, disk-sync and tensor-sync seconds (medians) for one dtype."""
    spec = ModelSpec.from_hf_folder(model_path)
    batch = make_batch(args.rows, args.seq_len, args.prompt_len, spec.vocab_size)
    args.dtype = dtype
    learner = MegatronLearner(learner_config(args, batch), "bench", model_path,
                              str(tmp / f"weights-{dtype}"))
    steps = [seconds(lambda: learner.train_step(batch)) for _ in range(args.steps + 1)][1:]
    engine = SGLangEngine(f"bench-{dtype}", model_path,
                          EngineConfig(dtype=dtype, max_total_tokens=4096), tmp / "logs")
    engine.start()
    disk, disk_load, tensor, tensor_load = [], [], [], []
    version = 0
    try:
        for rep in range(args.reps + 1):  # the first round warms both paths up (imports)
            if rep == 1:
                disk, disk_load, tensor, tensor_load = [], [], [], []
            version += 1
            start = time.perf_counter()
            ref = learner.publish_weights(version)
            answer = engine.update_weights_from_disk(ref.path, version)
            disk.append(time.perf_counter() - start)
            disk_load.append(answer["update_s"])
            version += 1
            start = time.perf_counter()
            state = learner._gather_hf_state()  # what publish_weights writes, in memory
            answer = engine.update_weights_from_tensor(list(state.items()), version)
            tensor.append(time.perf_counter() - start)
            tensor_load.append(answer["update_s"])
            if engine.weight_version != version:
                raise RuntimeError(f"engine serves v{engine.weight_version}, expected "
                                   f"v{version}")
    finally:
        engine.close()
    return {"step": median_s(steps), "steps": steps, "disk": median_s(disk),
            "disk_load": median_s(disk_load), "tensor": median_s(tensor),
            "tensor_load": median_s(tensor_load),
            "bytes": sum(t.numel() * t.element_size() for t in state.values())}


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    _, header = dtype_header(device)
    print(header)
    torch.set_num_threads(args.threads)
    model_path = str(resolve_model(args.model))
    print(f"model {model_path}; learner batch {args.rows}×{args.seq_len}; {args.reps} syncs "
          f"per path, medians")
    ratios = {}
    with tempfile.TemporaryDirectory(prefix="bench-weights-") as tmp:
        for dtype in args.dtypes.split(","):
            r = bench_dtype(args, model_path, dtype, Path(tmp))
            ratios[dtype] = r["tensor"] / r["disk"]
            print(f"{dtype}: {r['bytes'] / 2**20:.0f} MiB of weights; learner step "
                  f"{r['step']:.2f} s (steps: {', '.join(f'{s:.2f}' for s in r['steps'])})")
            for name in ("disk", "tensor"):
                print(f"  {name:6s} sync {r[name]:.3f} s (server load {r[name + '_load']:.3f} s)"
                      f" = {r[name] / r['step']:.3f} of a learner step")
    print(f"wall time {(time.perf_counter() - started) / 60:.1f} min")
    print("tensor/disk sync time: " + ", ".join(
        f"{ratio:.2f} {'fp32' if d == 'float32' else 'bf16' if d == 'bfloat16' else d}"
        for d, ratio in ratios.items()))


if __name__ == "__main__":
    main()
