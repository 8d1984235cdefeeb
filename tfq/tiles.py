"""The attention's fixed key tile and split sizes, independent of page size and batch."""

KEY_TILE = 64  # rows of keys one step of the online softmax reads; page rows must be a multiple of it
SPLIT_ROWS = 256  # rows of keys one split of the `partial` arithmetic covers (a multiple of KEY_TILE)
