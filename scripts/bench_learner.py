"""One learner step on SmolLM2-135M: the Megatron backend against a plain torch loop.

Tiny CPU run (one timed step, no engine):
    python scripts/bench_learner.py --rows 2 --seq-len 128 --steps 1 --no-engine
Default (measured: 7.6 min in bf16 on a 2-core AMD EPYC with avx512_bf16 and no AMX, shared
with other jobs at load average 3-10, single steps 10-47 s; on an AVX2-only CPU `auto` picks
fp32, as a bf16 step there does not finish in 20 minutes):
    python scripts/bench_learner.py
Cluster (one GPU, any HF folder of a supported family):
    python scripts/bench_learner.py --model /path/to/Qwen3-1.7B --rows 16 --seq-len 2048

`--dtype auto` (the default) resolves through runtime/dtype.py: bf16 where the machine computes
it natively, fp32 elsewhere (a bf16 step is ~100× slower on an AVX2-only CPU); the choice and
its reason are printed first.

Both sides do the same work on the same batch (DESIGN §6): a no-grad forward for the proximal
logprobs, then forward + backward of the decoupled-PPO loss from `learners.losses`, gradient
clipping and one AdamW step, at the same optimizer precision. The Megatron side is
`MegatronLearner.train_step` (megatron's schedule, DDP buffers, megatron's mixed-precision
optimizer: under bf16 the gradients accumulate in bf16 and are copied to fp32 main weights,
which torch.optim.AdamW updates with fp32 states before they are copied back to bf16); the
torch side is transformers + `torch.optim.AdamW` written out as a loop, with the same fp32
main weights and states under bf16 (under fp32 both update the parameters directly). The
parameter count per dtype of each side is printed: they are not identical (under bf16 the
megatron model keeps its RMSNorm weights in fp32, the transformers model in bf16). Tokens
per second count the padded tokens of the batch (rows × length) and use the median of
`--steps` timed steps per side after one warm-up step each; the two sides' steps alternate,
so a load change on a shared machine hits both alike.

Then one SGLang engine serves the model, and the Megatron learner publishes its weights
(HF safetensors) which the engine loads with `update_weights_from_disk`; that time is printed
as a fraction of one Megatron step. The last line reads
`megatron/torch tokens per second: <ratio>`.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a bare checkout

import torch  # noqa: E402

from bench_env import dtype_header  # noqa: E402
from learners.batch import TrainBatch  # noqa: E402
from learners.config import LearnerConfig  # noqa: E402
from learners.losses import decoupled_ppo_loss, token_logprobs  # noqa: E402
from learners.megatron.learner import MegatronLearner  # noqa: E402
from runtime.models import resolve_model  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="provisioned name or HF folder")
    parser.add_argument("--rows", type=int, default=8, help="sequences in the batch")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt tokens (no loss)")
    parser.add_argument("--steps", type=int, default=5,
                        help="timed steps after one warm-up (their median is reported)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="learner and engine dtype; auto: bf16 where native (runtime/dtype.py)")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--no-engine", action="store_true", help="skip the publish + load part")
    return parser.parse_args()


def make_batch(rows: int, seq_len: int, prompt_len: int, vocab: int) -> TrainBatch:
    """Random tokens, one micro-batch; advantages ±1, behaviour logprobs a little off-policy."""
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, vocab, (rows, seq_len), generator=generator)
    loss_mask = torch.zeros(rows, seq_len)
    loss_mask[:, prompt_len - 1: seq_len - 1] = 1.0
    advantages = torch.tensor([1.0 if i % 2 else -1.0 for i in range(rows)])[:, None] * loss_mask
    target_ids = torch.roll(input_ids, -1, dims=1)
    return TrainBatch(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                      loss_mask=loss_mask, target_ids=target_ids,
                      behavior_logprobs=torch.full((rows, seq_len), -11.0) * loss_mask,
                      advantages=advantages, seq_lens=torch.full((rows,), seq_len),
                      num_tokens=int(loss_mask.sum()))


def learner_config(args: argparse.Namespace, batch: TrainBatch) -> LearnerConfig:
    return LearnerConfig(backend="megatron", lr=1e-5, dtype=args.dtype, num_threads=args.threads,
                         micro_batch_tokens=batch.input_ids.numel(), grad_clip=1.0)


def param_dtypes(module: torch.nn.Module) -> str:
    """Parameter count per dtype, e.g. "bfloat16 134.5M, float32 0.0M" (what each side keeps)."""
    counts: dict[str, int] = {}
    for param in module.parameters():
        name = str(param.dtype).removeprefix("torch.")
        counts[name] = counts.get(name, 0) + param.numel()
    return ", ".join(f"{name} {n / 1e6:.2f}M" for name, n in sorted(counts.items()))


def seconds(step) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def torch_step(model_path: str, cfg: LearnerConfig, batch: TrainBatch):
    """The same step as the learners, written as a plain transformers + AdamW loop.

    Returns (step, model).

    Under bf16 it keeps what megatron's mixed-precision optimizer keeps: bf16 weights and
    gradients for forward and backward, fp32 main weights that AdamW (fp32 states) updates
    after the gradients are copied to fp32 and clipped there, then copied back to bf16.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, cfg.dtype))
    model.eval()  # no dropout, as in both learners
    params = list(model.parameters())
    mixed = cfg.dtype != "float32"
    main = [p.detach().float() for p in params] if mixed else params
    optimizer = torch.optim.AdamW(main, lr=cfg.lr, weight_decay=cfg.weight_decay)

    def logprobs(entropy: str):
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       use_cache=False).logits
        return token_logprobs(logits, batch.target_ids, batch.loss_mask, cfg.temperature,
                              entropy)[0]

    def step() -> None:
        with torch.no_grad():
            prox = logprobs("none")
        loss, _ = decoupled_ppo_loss(
            logprobs("metric"), prox, batch.behavior_logprobs, batch.advantages, batch.loss_mask,
            clip_eps_low=cfg.clip_eps_low, clip_eps_high=cfg.clip_eps_high,
            behavior_correction=cfg.behavior_correction, behavior_cap=cfg.behavior_cap)
        loss.backward()
        if mixed:
            for weight, param in zip(main, params):
                weight.grad = param.grad.float()
        torch.nn.utils.clip_grad_norm_(main, cfg.grad_clip)
        optimizer.step()
        if mixed:
            with torch.no_grad():
                for weight, param in zip(main, params):
                    param.copy_(weight)
        optimizer.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)

    return step, model


def publish_and_load(learner: MegatronLearner, model_path: str, dtype: str) -> tuple[float, float]:
    """Seconds to publish the learner's weights and to load them into a running engine."""
    from actors.engines.sglang import EngineConfig, SGLangEngine

    engine = SGLangEngine("bench", model_path, EngineConfig(dtype=dtype, max_total_tokens=4096))
    engine.start()
    try:
        start = time.perf_counter()
        ref = learner.publish_weights(1)
        published = time.perf_counter()
        engine.update_weights_from_disk(ref.path, ref.version)
        return published - start, time.perf_counter() - published
    finally:
        engine.close()


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    choice, header = dtype_header(device)
    print(header)
    if args.dtype == "auto":
        args.dtype = choice.dtype
    else:
        print(f"dtype {args.dtype} given on the command line (auto would be {choice.dtype})")
    torch.set_num_threads(args.threads)
    model_path = str(resolve_model(args.model))
    from learners.megatron.model import ModelSpec

    vocab = ModelSpec.from_hf_folder(model_path).vocab_size
    batch = make_batch(args.rows, args.seq_len, args.prompt_len, vocab)
    cfg = learner_config(args, batch)
    tokens = batch.input_ids.numel()
    print(f"model {model_path}, dtype {args.dtype}, batch {args.rows}×{args.seq_len} = "
          f"{tokens} tokens ({batch.num_tokens} in the loss), {args.threads} threads")
    print("optimizer, both sides: torch.optim.AdamW, lr "
          f"{cfg.lr:g}, grad clip {cfg.grad_clip:g}, "
          + ("fp32 main weights and states under bf16 weights and grads" if args.dtype != "float32"
             else "fp32 weights, grads and states"))

    with tempfile.TemporaryDirectory(prefix="bench-learner-") as tmp:
        learner = MegatronLearner(cfg, "bench", model_path, str(Path(tmp) / "weights"))
        torch_train, torch_model = torch_step(model_path, cfg, batch)
        sides = {"megatron": lambda: learner.train_step(batch), "torch": torch_train}
        print(f"parameters by dtype: megatron {param_dtypes(learner.model)}; "
              f"torch {param_dtypes(torch_model)}")
        del torch_model
        times: dict[str, list[float]] = {name: [] for name in sides}
        for _ in range(args.steps + 1):  # the first round is warm-up
            for name, step in sides.items():
                times[name].append(seconds(step))
        median = {name: statistics.median(values[1:]) for name, values in times.items()}
        for name, values in times.items():
            print(f"{name:9s} {median[name]:.2f} s/step, {tokens / median[name]:.0f} tokens/s "
                  f"(steps: {', '.join(f'{v:.2f}' for v in values[1:])})")
        del sides, torch_train
        gc.collect()
        if not args.no_engine:
            publish_s, load_s = publish_and_load(learner, model_path, args.dtype)
            print(f"publish {publish_s:.2f} s + engine load {load_s:.2f} s = "
                  f"{(publish_s + load_s) / median['megatron']:.3f} of a megatron step")
    print(f"wall time {(time.perf_counter() - started) / 60:.1f} min")
    print(f"megatron/torch tokens per second: {median['torch'] / median['megatron']:.3f}")


if __name__ == "__main__":
    main()
