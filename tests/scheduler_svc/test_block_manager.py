import hashlib
import subprocess
import sys
from array import array

import pytest

from pagedserve.scheduler_svc.block_manager import NULL_BLOCK, BlockManager, hash_blocks


def hashes_of(token_ids: list[int], block_size: int = 4, cache_salt: str = "") -> list[bytes]:
    hashes: list[bytes] = []
    hash_blocks(hashes, token_ids, block_size, cache_salt)
    return hashes


def computed(bm: BlockManager, token_ids: list[int]) -> list[int]:
    """Allocates blocks for token_ids and registers the full ones, as if their KV were computed."""
    hashes = hashes_of(token_ids, bm.block_size)
    block_ids = bm.allocate(-(-len(token_ids) // bm.block_size))
    for block_id, h in zip(block_ids, hashes):
        bm.cache(block_id, h)
    return block_ids


def test_null_block_is_never_allocated():
    bm = BlockManager(5, 4, True)
    assert bm.num_free_blocks == 4
    block_ids = bm.allocate(4)
    assert NULL_BLOCK not in block_ids and sorted(block_ids) == [1, 2, 3, 4]
    assert bm.usage == 1.0 and not bm.can_allocate(1)
    with pytest.raises(ValueError, match="at least 2 blocks"):
        BlockManager(1, 4, True)


def test_allocate_and_free_restore_the_pool():
    bm = BlockManager(9, 4, False)
    a = bm.allocate(3)
    b = bm.allocate(2)
    assert set(a).isdisjoint(b)
    assert bm.num_free_blocks == 3 and bm.usage == pytest.approx(5 / 8)
    assert all(bm.blocks[i].ref_count == 1 for i in a + b)
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8 and bm.usage == 0.0
    assert all(block.ref_count == 0 for block in bm.blocks)


def test_shared_prefix_blocks_are_ref_counted():
    bm = BlockManager(9, 4, True)
    tokens = list(range(10))
    a = computed(bm, tokens)
    cached, num_cached = bm.lookup(hashes_of(tokens), len(tokens))
    assert cached == a[:2] and num_cached == 8
    b = bm.allocate(1, cached)
    assert b[:2] == a[:2] and b[2] != a[2]
    assert [bm.blocks[i].ref_count for i in a] == [2, 2, 1]
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in b] == [1, 1, 1]
    assert bm.num_free_blocks == 8 - 3
    bm.free(b)
    assert bm.num_free_blocks == 8


def test_free_blocks_are_reused_least_recently_freed_first():
    bm = BlockManager(7, 4, False)
    a, b, c = bm.allocate(2), bm.allocate(2), bm.allocate(2)
    bm.free(b)
    bm.free(a)
    bm.free(c)
    assert bm.allocate(6) == list(reversed(b)) + list(reversed(a)) + list(reversed(c))


def test_request_frees_in_reverse_so_chain_tails_are_evicted_first():
    bm = BlockManager(4, 4, True)
    tokens = list(range(13))
    a = computed(bm, tokens[:12])
    bm.free(a)
    assert bm.allocate(1) == [a[2]]
    cached, num_cached = bm.lookup(hashes_of(tokens), len(tokens))
    assert cached == a[:2] and num_cached == 8


def test_freed_block_is_revived_by_a_prefix_hit():
    bm = BlockManager(5, 4, True)
    tokens = list(range(9))
    a = computed(bm, tokens)
    bm.free(a)
    assert bm.num_free_blocks == 4
    cached, num_cached = bm.lookup(hashes_of(tokens), len(tokens))
    assert cached == a[:2] and num_cached == 8
    assert bm.can_allocate(2, cached) and not bm.can_allocate(3, cached)
    b = bm.allocate(1, cached)
    assert b[:2] == a[:2]
    assert bm.num_free_blocks == 1
    assert [bm.blocks[i].ref_count for i in b] == [1, 1, 1]


def test_reallocation_evicts_the_stale_hash():
    bm = BlockManager(3, 4, True)
    tokens = list(range(9))
    a = computed(bm, tokens[:8])
    bm.free(a)
    bm.allocate(1)
    assert bm.lookup(hashes_of(tokens), len(tokens)) == ([a[0]], 4)
    assert bm.blocks[a[1]].hash is None and len(bm.hash_to_block) == 1
    bm.allocate(1)
    assert bm.lookup(hashes_of(tokens), len(tokens)) == ([], 0)
    assert bm.hash_to_block == {}


def test_lookup_stops_at_the_first_miss_and_leaves_the_last_token():
    bm = BlockManager(9, 4, True)
    tokens = list(range(12))
    a = computed(bm, tokens)
    hashes = hashes_of(tokens)
    assert bm.lookup(hashes, 12) == (a[:2], 8)
    assert bm.lookup(hashes, 13) == (a, 12)
    assert bm.lookup(hashes, 8) == (a[:1], 4)
    assert bm.lookup(hashes_of([99] + tokens[1:]), 12) == ([], 0)
    assert bm.lookup(hashes_of(tokens[:4] + [99] + tokens[5:]), 12) == (a[:1], 4)


def test_chained_hash_depends_on_the_whole_prefix():
    assert hashes_of([1, 2, 3, 4, 5, 6, 7, 8])[1] != hashes_of([0, 2, 3, 4, 5, 6, 7, 8])[1]
    assert hashes_of([1, 2, 3, 4, 5, 6, 7])[:1] == hashes_of([1, 2, 3, 4, 5, 6, 7, 8])[:1]
    assert len(hashes_of(list(range(7)))) == 1


def test_duplicate_content_keeps_the_first_registration():
    bm = BlockManager(5, 4, True)
    tokens = list(range(5))
    a = computed(bm, tokens)
    b = computed(bm, tokens)
    assert bm.lookup(hashes_of(tokens), len(tokens))[0] == a[:1]
    bm.free(b)
    bm.allocate(4 - 2)
    assert bm.lookup(hashes_of(tokens), len(tokens))[0] == a[:1]


def test_disabled_prefix_caching_never_hits():
    bm = BlockManager(5, 4, False)
    tokens = list(range(9))
    a = computed(bm, tokens)
    assert bm.lookup(hashes_of(tokens), len(tokens)) == ([], 0)
    assert all(bm.blocks[i].hash is None for i in a)


def test_each_block_hash_is_the_sha256_of_its_parent_and_its_ids():
    """A hit reuses a block without comparing tokens: the key must be a hash no one can collide."""
    tokens = [5, 2**31 - 1, 0, 7, 9, 9, 9, 9]
    first, second = hashes_of(tokens)
    assert second == hashlib.sha256(first + array("i", tokens[4:]).tobytes()).digest()
    # Appending to a chain gives what hashing the whole sequence at once gives.
    chain = hashes_of(tokens[:6])
    hash_blocks(chain, tokens + [1, 2, 3, 4], 4)
    assert chain == hashes_of(tokens + [1, 2, 3, 4])


def test_the_chain_starts_from_a_seed_of_this_process():
    code = ("from pagedserve.scheduler_svc.block_manager import hash_blocks; h = []; "
            "hash_blocks(h, [1, 2, 3, 4], 4); print(h[0].hex())")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert len(other) == 64 and other != hashes_of([1, 2, 3, 4])[0].hex()


def test_a_cache_salt_changes_every_block_hash_and_the_same_salt_matches():
    tokens = list(range(12))
    plain, a, b = hashes_of(tokens), hashes_of(tokens, cache_salt="a"), hashes_of(tokens, cache_salt="b")
    assert not set(plain) & set(a) and not set(a) & set(b)
    assert hashes_of(tokens, cache_salt="a") == a
