"""Arrow rows -> right-padded training tensors, and token-balanced micro-batches (DESIGN §6).

Layout of one row b with prompt p (P tokens) and response q (R tokens), sequence s = p ++ q of
n = P + R tokens, right-padded to L:

    position j        0 .. P−2        P−1 .. P+R−2         P+R−1       P+R .. L−1
    input_ids         p[j]            s[j]                 q[R−1]      pad
    target_ids        s[j+1]          q[j−P+1]             pad         pad
    loss_mask         0               1                    0           0
    behavior_logprobs 0               blp[j−P+1]           0           0

Logits at position j predict token j+1, so `log_softmax(logits)[:, j].gather(target_ids[:, j])`
is the logprob of the response token q[j−P+1] exactly where `loss_mask` is 1, and every
per-token tensor (behaviour logprobs, advantages, learner logprobs) shares that alignment.
Prompts must be non-empty: the first response token needs a position that predicts it.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch


@dataclass
class TrainBatch:
    """Padded tensors for B rows of max sequence length L (alignment in the module docstring).

    Attributes:
        input_ids: int64 [B, L], prompt ++ response, right-padded with the pad id.
        attention_mask: int64 [B, L], 1 on the n_b real tokens of each row.
        loss_mask: float32 [B, L], 1 at positions whose next token is a response token.
        target_ids: int64 [B, L], input_ids shifted left by one (pad past the end).
        behavior_logprobs: float32 [B, L], engine logprobs of target_ids under the mask.
        advantages: float32 [B, L], each row's advantage under the mask, 0 elsewhere.
        seq_lens: int64 [B], n_b = P_b + R_b.
        num_tokens: number of loss tokens (= loss_mask.sum() = Σ R_b), a host int.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    target_ids: torch.Tensor
    behavior_logprobs: torch.Tensor
    advantages: torch.Tensor
    seq_lens: torch.Tensor
    num_tokens: int

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])


def _list_column(table: pa.Table, name: str) -> tuple[np.ndarray, np.ndarray]:
    """Flattened values and per-row lengths of a list column (handles chunks and slices).

    Returns:
        (values [Σ lengths], lengths int64 [N]); values are a zero-copy view where the Arrow
        buffer allows it.
    """
    column = table.column(name).combine_chunks()
    # flatten() honours the array's offset, so a sliced table yields only its own rows' values.
    values = column.flatten().to_numpy(zero_copy_only=False)
    lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False).astype(np.int64)
    return values, lengths


def _ragged_positions(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For a ragged layout with `lengths` [N], the (row, index-within-row) of every element."""
    rows = np.repeat(np.arange(len(lengths)), lengths)
    starts = np.cumsum(lengths) - lengths
    return rows, np.arange(int(lengths.sum())) - starts[rows]


def build_train_batch(table: pa.Table, advantages: np.ndarray, pad_id: int) -> TrainBatch:
    """Turn rows in STEP_SCHEMA into a padded TrainBatch, vectorised over all tokens.

    Args:
        table: N rows with prompt_ids, response_ids, behavior_logprobs.
        advantages: float [N], one advantage per row.
        pad_id: token id used for padding (never attended to, never in the loss).

    Returns:
        a TrainBatch with B = N and L = max(P + R).
    """
    prompt_values, prompt_lens = _list_column(table, "prompt_ids")
    response_values, response_lens = _list_column(table, "response_ids")
    behavior_values, behavior_lens = _list_column(table, "behavior_logprobs")
    num_rows = table.num_rows
    if len(advantages) != num_rows:
        raise ValueError(f"build_train_batch: {len(advantages)} advantages for {num_rows} rows")
    if not np.array_equal(behavior_lens, response_lens):
        bad = int(np.flatnonzero(behavior_lens != response_lens)[0])
        raise ValueError(
            f"build_train_batch: row {bad} has {response_lens[bad]} response tokens but "
            f"{behavior_lens[bad]} behavior_logprobs"
        )
    if num_rows and prompt_lens.min() == 0:
        raise ValueError(
            "build_train_batch: a row has an empty prompt; nothing predicts its first token"
        )

    seq_lens = prompt_lens + response_lens
    max_len = int(seq_lens.max()) if num_rows else 0
    input_ids = np.full((num_rows, max_len), pad_id, dtype=np.int64)
    p_rows, p_cols = _ragged_positions(prompt_lens)
    input_ids[p_rows, p_cols] = prompt_values
    r_rows, r_cols = _ragged_positions(response_lens)
    r_cols = r_cols + prompt_lens[r_rows]  # response token k sits at position P + k
    input_ids[r_rows, r_cols] = response_values

    target_ids = np.full_like(input_ids, pad_id)
    # Shifting the padded input also puts pad at each row's last real position (n − 1).
    target_ids[:, :-1] = input_ids[:, 1:]

    # The position predicting response token k is P + k − 1.
    predict_cols = r_cols - 1
    loss_mask = np.zeros((num_rows, max_len), dtype=np.float32)
    loss_mask[r_rows, predict_cols] = 1.0
    behavior_logprobs = np.zeros((num_rows, max_len), dtype=np.float32)
    behavior_logprobs[r_rows, predict_cols] = behavior_values
    token_advantages = np.zeros((num_rows, max_len), dtype=np.float32)
    token_advantages[r_rows, predict_cols] = np.asarray(advantages, dtype=np.float32)[r_rows]
    attention_mask = (np.arange(max_len)[None, :] < seq_lens[:, None]).astype(np.int64)

    return TrainBatch(
        input_ids=torch.from_numpy(input_ids),
        attention_mask=torch.from_numpy(attention_mask),
        loss_mask=torch.from_numpy(loss_mask),
        target_ids=torch.from_numpy(target_ids),
        behavior_logprobs=torch.from_numpy(behavior_logprobs),
        advantages=torch.from_numpy(token_advantages),
        seq_lens=torch.from_numpy(seq_lens),
        num_tokens=int(response_lens.sum()),
    )


def with_advantages(batch: TrainBatch, advantages: np.ndarray) -> TrainBatch:
    """`batch` with its advantages replaced: row b's `advantages[b]` on its loss tokens.

    Lets a caller build the batch first (the reference forward of `learners.prepare` needs
    its tensors) and set the advantages once they are known; the other tensors are shared.

    Args:
        batch: B rows.
        advantages: float [B], one advantage per row.
    """
    if len(advantages) != batch.num_rows:
        raise ValueError(f"with_advantages: {len(advantages)} advantages for "
                         f"{batch.num_rows} rows")
    per_row = torch.as_tensor(np.asarray(advantages, dtype=np.float32))[:, None]  # [B, 1]
    return replace(batch, advantages=torch.where(batch.loss_mask > 0, per_row, 0.0))


def micro_batch_indices(seq_lens: torch.Tensor, max_tokens: int) -> list[torch.Tensor]:
    """Partition rows into micro-batches of at most `max_tokens` padded tokens.

    Rows are sorted longest first and packed greedily: a micro-batch takes the next row while
    (rows + 1) × (its longest row) ≤ max_tokens. Sorting keeps rows of similar length together,
    so padding is small and micro-batches have near-equal padded size (only the last one may
    be smaller). A row longer than `max_tokens` goes alone (rows are never split).

    Args:
        seq_lens: int64 [B].
        max_tokens: the padded-token budget per micro-batch.

    Returns:
        index tensors (int64) into the B rows; together they cover each row exactly once.
    """
    lengths = seq_lens.tolist()
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    for i in order:
        # The group's first row is its longest, so its padded size is rows × lengths[first].
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return [torch.tensor(g, dtype=torch.int64) for g in groups]


def select_rows(batch: TrainBatch, rows: torch.Tensor) -> TrainBatch:
    """The sub-batch of `rows`, trimmed to its own longest sequence."""
    length = int(batch.seq_lens[rows].max()) if len(rows) else 0
    parts = {}
    for f in fields(TrainBatch):
        value = getattr(batch, f.name)
        if f.name == "seq_lens":
            parts[f.name] = value[rows]
        elif isinstance(value, torch.Tensor):
            parts[f.name] = value[rows, :length]
    loss_tokens = int(parts["loss_mask"].sum())
    return TrainBatch(**parts, num_tokens=loss_tokens)


def micro_batches(batch: TrainBatch, max_tokens: int) -> list[TrainBatch]:
    """Split `batch` into token-balanced micro-batches (see `micro_batch_indices`)."""
    return [select_rows(batch, rows) for rows in micro_batch_indices(batch.seq_lens, max_tokens)]
