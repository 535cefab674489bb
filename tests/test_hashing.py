from kvmemory import hashing


def test_block_id_depends_on_every_input():
    base = hashing.block_id("fp", hashing.ROOT_PARENT, [1, 2, 3], [0, 1, 2])
    assert len(base) == hashing.ID_BYTES
    assert base == hashing.block_id("fp", hashing.ROOT_PARENT, [1, 2, 3], [0, 1, 2])
    variants = [
        hashing.block_id("fq", hashing.ROOT_PARENT, [1, 2, 3], [0, 1, 2]),
        hashing.block_id("fp", b"\x01" * 16, [1, 2, 3], [0, 1, 2]),
        hashing.block_id("fp", hashing.ROOT_PARENT, [1, 2, 4], [0, 1, 2]),
        hashing.block_id("fp", hashing.ROOT_PARENT, [1, 2, 3], [1, 2, 3]),
        hashing.block_id("fp", hashing.ROOT_PARENT, [1, 2], [0, 1]),
    ]
    assert len({base, *variants}) == 6


def test_chain_ids_share_prefix_and_split_partial_block():
    a = hashing.chain_ids("fp", list(range(10)), 4)
    b = hashing.chain_ids("fp", list(range(13)), 4)
    assert len(a) == 3 and len(b) == 4
    assert a[:2] == b[:2]              # full blocks shared
    assert a[2] != b[2]                # partial [8, 9] differs from full [8..11]


def test_digest_is_order_sensitive_and_concatenating():
    assert hashing.digest(b"ab", b"c") == hashing.digest(b"abc")
    assert hashing.digest(b"abc") != hashing.digest(b"acb")
