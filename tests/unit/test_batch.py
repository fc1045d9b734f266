"""Arrow rows -> TrainBatch alignment, padding, and token-balanced micro-batches."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from buffers.schema import StepRecord, records_to_table
from learners.batch import build_train_batch, micro_batch_indices, micro_batches

PAD = 0


def make_table(rows) -> pa.Table:
    """rows: (prompt ids, response ids, behaviour logprobs)."""
    records = [
        StepRecord(
            step_id=f"s{i}", run_id="r", model_id="m", agent="a", workflow="w", task_id="t",
            episode_id="e", branch="", turn=0, group_key=b"k" * 16, group_size=1, candidate=0,
            prompt_ids=np.array(p, np.int32), response_ids=np.array(r, np.int32),
            behavior_logprobs=np.array(b, np.float32),
            token_versions=np.zeros(len(r), np.int32), finish_reason="stop", reward=1.0,
        )
        for i, (p, r, b) in enumerate(rows)
    ]
    return records_to_table(records)


ROWS = [([1, 2, 3], [4, 5], [-0.1, -0.2]), ([6], [7, 8, 9], [-0.3, -0.4, -0.5])]


def test_alignment_and_padding_by_hand():
    batch = build_train_batch(make_table(ROWS), np.array([1.5, -0.5]), PAD)
    t = lambda x, dtype=torch.int64: torch.tensor(x, dtype=dtype)  # noqa: E731
    f32 = torch.float32
    torch.testing.assert_close(batch.input_ids, t([[1, 2, 3, 4, 5], [6, 7, 8, 9, 0]]))
    torch.testing.assert_close(batch.target_ids, t([[2, 3, 4, 5, 0], [7, 8, 9, 0, 0]]))
    torch.testing.assert_close(batch.attention_mask, t([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]))
    # Position j carries the loss of token j+1: row 0 predicts 4, 5 at positions 2, 3.
    torch.testing.assert_close(batch.loss_mask, t([[0, 0, 1, 1, 0], [1, 1, 1, 0, 0]], f32))
    torch.testing.assert_close(
        batch.behavior_logprobs,
        t([[0, 0, -0.1, -0.2, 0], [-0.3, -0.4, -0.5, 0, 0]], f32))
    torch.testing.assert_close(
        batch.advantages, t([[0, 0, 1.5, 1.5, 0], [-0.5, -0.5, -0.5, 0, 0]], f32))
    torch.testing.assert_close(batch.seq_lens, t([5, 4]))
    assert batch.num_tokens == 5
    assert batch.input_ids.dtype == torch.int64 and batch.loss_mask.dtype == torch.float32
    # The targets under the mask are exactly the response tokens, in order.
    assert batch.target_ids[batch.loss_mask > 0].tolist() == [4, 5, 7, 8, 9]


def test_sliced_and_chunked_tables_read_only_their_rows():
    table = make_table(ROWS + [([10, 11], [12], [-0.6])])
    sliced = build_train_batch(table.slice(1, 2), np.array([1.0, 2.0]), PAD)
    assert sliced.target_ids[sliced.loss_mask > 0].tolist() == [7, 8, 9, 12]
    chunked = pa.concat_tables([table.slice(0, 1), table.slice(1)])
    full = build_train_batch(chunked, np.zeros(3), PAD)
    assert full.target_ids[full.loss_mask > 0].tolist() == [4, 5, 7, 8, 9, 12]


def test_empty_prompt_and_length_mismatch_are_rejected():
    with pytest.raises(ValueError, match="empty prompt"):
        build_train_batch(make_table([([], [4], [-0.1])]), np.zeros(1), PAD)
    table = make_table(ROWS)
    wrong = pa.array([[-0.1], [-0.3, -0.4, -0.5]], pa.large_list(pa.float32()))
    table = table.set_column(table.schema.get_field_index("behavior_logprobs"),
                             table.schema.field("behavior_logprobs"), wrong)
    with pytest.raises(ValueError, match="row 0 has 2 response tokens but 1"):
        build_train_batch(table, np.zeros(2), PAD)


def test_micro_batches_pack_by_padded_tokens():
    # Lengths 10, 3, 7, 2, 9, 4 with budget 20, longest first:
    # [10, 9] -> 2·10 = 20; [7, 4] -> 14 (adding 3 would make 21); [3, 2] -> 6.
    lengths = [10, 3, 7, 2, 9, 4]
    rows = [(list(range(1, n)), [n], [-0.5]) for n in lengths]
    batch = build_train_batch(make_table(rows), np.arange(6, dtype=np.float32), PAD)
    groups = micro_batch_indices(batch.seq_lens, 20)
    assert [g.tolist() for g in groups] == [[0, 4], [2, 5], [1, 3]]
    parts = micro_batches(batch, 20)
    assert [tuple(p.input_ids.shape) for p in parts] == [(2, 10), (2, 7), (2, 3)]
    assert all(p.input_ids.numel() <= 20 for p in parts)
    assert sum(p.num_tokens for p in parts) == batch.num_tokens
    # Each part keeps its rows' data: row 2 (length 7) holds advantage 2 at position 5.
    assert parts[1].advantages[0, 5].item() == 2.0 and parts[1].loss_mask[0].sum() == 1


def test_a_row_longer_than_the_budget_goes_alone():
    batch = build_train_batch(make_table([([1] * 8, [2, 3], [0, 0]), ([1], [2], [0])]),
                              np.zeros(2), PAD)
    assert [g.tolist() for g in micro_batch_indices(batch.seq_lens, 4)] == [[0], [1]]
