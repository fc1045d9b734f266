"""The megatron-core learner backend (DESIGN §6), one module per concern.

- `learner`: `MegatronLearner`, the backend `learners.protocol` builds for `backend: megatron`;
- `model`: the `GPTModel` and its `TransformerConfig`, read from the HF `config.json`;
- `weights`: the one HF ↔ megatron weight mapping, and TP/PP sharding of it;
- `parallel`: the process group and megatron's TP/PP/DP groups;
- `ranks`: the follower ranks one Ray actor starts when TP × PP > 1;
- `checkpoint`: megatron dist checkpoints (torch_dist backend);
- `compat`: what makes megatron-core run on a machine without CUDA.

Nothing is imported here: megatron-core is heavy, and the registry imports `learner` on first use.
"""
