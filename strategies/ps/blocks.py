"""Which server holds which part of which parameter.

Dense parameters are cut into blocks the way Paddle's transpiler slices variables: a parameter
of ``n`` elements becomes ``min(server_num, ceil(n / MIN_BLOCK_SIZE))`` blocks of near-equal
length (so small parameters stay whole and large ones spread over the servers), and each block
goes to the server holding the fewest elements so far (ties to the lowest index). Workers and
servers compute the same plan from the same parameter sizes.

Rows of sparse tables go to servers by ``id % server_num``; server ``s`` keeps the row at
local index ``id // server_num``.
"""
import math

import numpy as np

MIN_BLOCK_SIZE = 8192


class Block:
    """Elements ``[start, stop)`` of parameter ``param`` (flattened), held by ``server``."""

    def __init__(self, param, start, stop, server):
        self.param = param
        self.start = start
        self.stop = stop
        self.server = server

    @property
    def size(self):
        return self.stop - self.start

    def __repr__(self):
        return f"Block(param={self.param}, [{self.start}, {self.stop}), server={self.server})"


def plan_blocks(sizes, server_num, min_block_size=MIN_BLOCK_SIZE):
    """The blocks of parameters of ``sizes`` elements over ``server_num`` servers."""
    load = [0] * server_num
    blocks = []
    for index, size in enumerate(sizes):
        pieces = max(1, min(server_num, math.ceil(size / min_block_size)))
        bounds = [size * k // pieces for k in range(pieces + 1)]
        for start, stop in zip(bounds[:-1], bounds[1:]):
            server = min(range(server_num), key=lambda s: (load[s], s))
            load[server] += stop - start
            blocks.append(Block(index, start, stop, server))
    return blocks


def server_blocks(blocks, server):
    return [b for b in blocks if b.server == server]


def row_owner(ids, server_num):
    """The server of each row id."""
    return ids % server_num


def local_rows(ids, server_num):
    """Each row's index in its server's shard."""
    return ids // server_num


def shard_rows(num_rows, server, server_num):
    """How many rows of a ``num_rows`` table server ``server`` holds."""
    return len(range(server, num_rows, server_num))


def split_by_owner(ids, server_num):
    """``[(server, positions)]``: where in ``ids`` each server's rows are, for every server."""
    owners = row_owner(ids, server_num)
    return [(s, np.flatnonzero(owners == s)) for s in range(server_num)]
