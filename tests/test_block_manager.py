from kvturn.engine.block_manager import BlockManager, block_hashes


def test_hashes_chain_so_equal_hashes_mean_equal_prefixes():
    a = block_hashes(list(range(64)), 16)
    b = block_hashes([99] + list(range(1, 64)), 16)
    assert len(a) == 4
    assert all(x != y for x, y in zip(a, b))  # a change in block 0 changes every later hash


def test_partial_block_has_no_hash():
    assert len(block_hashes(list(range(31)), 16)) == 1


def test_cache_hit_needs_matching_tokens_not_only_the_hash():
    bm = BlockManager(4, 16)
    tokens = list(range(32))
    hashes = block_hashes(tokens, 16)
    block = bm.allocate_new()
    bm.publish(block, hashes[0], tuple(range(1, 17)))  # same hash, different tokens: a collision
    assert bm.cached_prefix(tokens, hashes) == []


def test_freed_blocks_stay_cached_and_are_reused_least_recently_freed_first():
    bm = BlockManager(3, 16)
    tokens = list(range(16))
    h = block_hashes(tokens, 16)
    first = bm.allocate_new()
    bm.publish(first, h[0], tuple(tokens))
    bm.release(first)
    assert bm.cached_prefix(tokens, h) == [first]
    second, third = bm.allocate_new(), bm.allocate_new()
    assert first not in (second, third)  # the other free blocks went first
    assert bm.cached_prefix(tokens, h) == [first]
    assert bm.allocate_new() == first and bm.cached_prefix(tokens, h) == []


def test_epoch_bumps_when_a_block_is_let_go_or_gets_new_contents():
    """A remote reader's (block, epoch) pair stays valid exactly while someone holds the block."""
    bm = BlockManager(1, 16)
    block = bm.allocate_new()
    held = int(bm.epochs[block])
    bm.take(block)  # a second holder (a lease): same contents, same epoch
    bm.release(block)
    assert bm.epochs[block] == held  # still held by the first
    bm.release(block)
    let_go = int(bm.epochs[block])
    assert let_go == held + 1
    bm.take(block)  # revived from the cache: same contents, the epoch it got when let go
    assert bm.epochs[block] == let_go
    bm.release(block)
    assert bm.allocate_new() == block and bm.epochs[block] > let_go


def test_prefix_caching_off_forgets_freed_blocks():
    bm = BlockManager(2, 16, enable_prefix_caching=False)
    tokens = list(range(16))
    h = block_hashes(tokens, 16)
    block = bm.allocate_new()
    bm.publish(block, h[0], tuple(tokens))
    bm.release(block)
    assert bm.cached_prefix(tokens, h) == []


def test_a_growing_sequence_gets_the_block_after_its_last_when_that_one_is_free():
    bm = BlockManager(8, 16)
    run = [bm.allocate_new() for _ in range(3)]  # 0, 1, 2
    other = bm.allocate_new()  # 3
    bm.release(bm.allocate_new())  # 4 freed last: least recently freed order is 5, 6, 7, 4
    assert bm.allocate_new(after=other) == 4  # the block after the sequence's last, out of LRU order
    assert bm.allocate_new(after=run[-1]) == 5  # block 3 is taken: the least recently freed instead
    assert bm.allocate_new(after=7) == 6  # past the pool's end: the least recently freed


def test_a_growing_sequence_does_not_take_the_next_block_out_of_lru_order_when_it_holds_cached_kv():
    """Conversations whose blocks lie side by side: the first one's next turn grows past its cached prefix, and
    the block after its last is the second conversation's, freed but cached. Taking it would evict that history
    while never-used blocks wait (a colocated worker recomputed every other conversation's whole history so)."""
    bm = BlockManager(16, 16)
    first, second = list(range(32)), list(range(100, 132))
    for tokens in (first, second):
        blocks = [bm.allocate_new() for _ in range(2)]
        for block, h, start in zip(blocks, block_hashes(tokens, 16), (0, 16)):
            bm.publish(block, h, tuple(tokens[start:start + 16]))
        bm.release_all(blocks)
    hit = bm.cached_prefix(first, block_hashes(first, 16))
    assert hit == [0, 1]
    for block in hit:
        bm.take(block)
    grown = bm.allocate_new(after=hit[-1])
    assert grown not in (2, 3)  # the second conversation's blocks
    assert bm.cached_prefix(second, block_hashes(second, 16)) == [2, 3]
    bm.release(grown)
    assert bm.allocate_new(after=grown - 1) == grown  # an uncached free block after the last is still taken


def test_the_count_of_cached_free_blocks_follows_every_change_of_the_pool():
    import random
    from kvturn.engine.block_manager import NO_HASH
    bm = BlockManager(16, 4)
    rng = random.Random(3)
    held: list[int] = []
    for step in range(400):
        action = rng.random()
        if action < 0.4 and bm.num_free_blocks:
            held.append(bm.allocate_new(after=rng.choice(held) if held and rng.random() < 0.5 else None))
        elif action < 0.6 and held:
            block_id = rng.choice(held)
            bm.publish(block_id, rng.randrange(1, 40), (step,))
        elif action < 0.9 and held:
            bm.release(held.pop(rng.randrange(len(held))))
        elif bm.free_block_ids:
            block_id = rng.choice(list(bm.free_block_ids))
            bm.take(block_id)
            held.append(block_id)
        walked = sum(1 for b in bm.free_block_ids if bm.blocks[b].hash != NO_HASH)
        assert bm.num_cached_free_blocks == walked
