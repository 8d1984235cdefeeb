"""The attention's key tables (tfq.kernels.attention.key_tables): row n of a forward attends to the cache rows
table[offsets[n] : offsets[n] + lengths[n]], its own keys in position order, whatever the forward holds. One lane's
decode row takes a shorter road (its own row of the decode group, as it is); both roads give each row its keys."""
from __future__ import annotations

import torch

from tfq.kernels.attention import key_tables
from tfq.kernels.contract import AttentionBatch, Chunk, DecodeGroup


def keys_of(tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor], rows: int) -> list[list[int]]:
    """Each query row's cache rows, read from the tables the way the kernel reads them."""
    table, offsets, lengths = (t.tolist() for t in tables)
    return [table[offsets[n]:offsets[n] + lengths[n]] for n in range(rows)]


def padded(rows: list[int], to: int) -> list[int]:
    return rows + [0] * (to - len(rows))  # past a stream's keys: masked, any row serves


def test_one_lane_decode_row_attends_to_its_own_keys():
    own = [40, 41, 42, 43, 44]
    batch = AttentionBatch(DecodeGroup(torch.tensor([0]), torch.tensor([padded(own, 64)]), torch.tensor([5])), [],
                           False)
    assert keys_of(key_tables(batch, 1), 1) == [own]


def test_decode_rows_and_a_chunk_each_attend_to_their_own_keys():
    a, b, c = [7, 8, 9], [100, 101, 102, 103, 104, 105, 106], [200, 201, 202, 203]
    decode = DecodeGroup(torch.tensor([0, 3]), torch.tensor([padded(a, 64), padded(b, 64)]), torch.tensor([3, 7]))
    chunk = Chunk(1, 2, 2, torch.tensor(padded(c, 64)))  # rows 1 and 2: positions 2 and 3 of stream c
    assert keys_of(key_tables(AttentionBatch(decode, [chunk], False), 4), 4) == [a, c[:3], c[:4], b]


def test_the_check_sees_a_row_given_another_rows_keys():
    """Control: tables whose offsets are shifted by one key give a row keys that are not its own."""
    own = [40, 41, 42]
    batch = AttentionBatch(DecodeGroup(torch.tensor([0]), torch.tensor([padded(own, 64)]), torch.tensor([3])), [],
                           False)
    table, offsets, lengths = key_tables(batch, 1)
    assert keys_of((table, offsets + 1, lengths), 1) != [own]
