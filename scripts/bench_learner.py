"""One learner step on SmolLM2-135M: the Megatron backend against a plain torch loop.

Run (about 3 minutes on 2 CPU cores):  python scripts/bench_learner.py
Options: --rows 8 --seq-len 256 --steps 3 --dtype float32 --no-engine
Cluster (one GPU, any HF folder of a supported family):
    python scripts/bench_learner.py --model /path/to/Qwen3-1.7B --rows 16 --seq-len 2048

Both sides do the same work on the same batch (DESIGN §6): a no-grad forward for the proximal
logprobs, then forward + backward of the decoupled-PPO loss from `learners.losses`, gradient
clipping and one Adam step. The Megatron side is `MegatronLearner.train_step` (megatron's
schedule, DDP buffers, megatron optimizer with fp32 main weights under bf16); the torch side is
transformers + `torch.optim.AdamW` written out as a loop. Tokens per second count the padded
tokens of the batch (rows × length) and use the median of `--steps` timed steps per side after
one warm-up step each; the two sides' steps alternate, so a load change on a shared machine
hits both alike.

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

from learners.batch import TrainBatch  # noqa: E402
from learners.config import LearnerConfig  # noqa: E402
from learners.losses import decoupled_ppo_loss  # noqa: E402
from learners.megatron_learner import MegatronLearner, token_logprobs  # noqa: E402
from runtime.models import resolve_model  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="provisioned name or HF folder")
    parser.add_argument("--rows", type=int, default=8, help="sequences in the batch")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt tokens (no loss)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"],
                        help="learner dtype (bfloat16 is the fastest on AMX CPUs)")
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


def seconds(step) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def torch_step(model_path: str, cfg: LearnerConfig, batch: TrainBatch):
    """The same step as the learners, written as a plain transformers + AdamW loop."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, cfg.dtype))
    model.eval()  # no dropout, as in both learners
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)

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
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


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
    torch.set_num_threads(args.threads)
    model_path = str(resolve_model(args.model))
    from learners.megatron_model import ModelSpec

    vocab = ModelSpec.from_hf_folder(model_path).vocab_size
    batch = make_batch(args.rows, args.seq_len, args.prompt_len, vocab)
    cfg = learner_config(args, batch)
    tokens = batch.input_ids.numel()
    print(f"model {model_path}, dtype {args.dtype}, batch {args.rows}×{args.seq_len} = "
          f"{tokens} tokens ({batch.num_tokens} in the loss), {args.threads} threads")

    with tempfile.TemporaryDirectory(prefix="bench-learner-") as tmp:
        learner = MegatronLearner(cfg, "bench", model_path, str(Path(tmp) / "weights"))
        sides = {"megatron": lambda: learner.train_step(batch),
                 "torch": torch_step(model_path, cfg, batch)}
        times: dict[str, list[float]] = {name: [] for name in sides}
        for _ in range(args.steps + 1):  # the first round is warm-up
            for name, step in sides.items():
                times[name].append(seconds(step))
        median = {name: statistics.median(values[1:]) for name, values in times.items()}
        for name, values in times.items():
            print(f"{name:9s} {median[name]:.2f} s/step, {tokens / median[name]:.0f} tokens/s "
                  f"(steps: {', '.join(f'{v:.2f}' for v in values[1:])})")
        del sides
        gc.collect()
        if not args.no_engine:
            publish_s, load_s = publish_and_load(learner, model_path, args.dtype)
            print(f"publish {publish_s:.2f} s + engine load {load_s:.2f} s = "
                  f"{(publish_s + load_s) / median['megatron']:.3f} of a megatron step")
    print(f"megatron/torch tokens per second: {median['torch'] / median['megatron']:.3f}")


if __name__ == "__main__":
    main()
