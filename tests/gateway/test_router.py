"""The pick of a scheduler: least loaded, prefix affinity, spill when overloaded, rotation."""
from pagedserve.gateway.router import AFFINITY_BLOCKS, OVERLOAD_FACTOR, OVERLOAD_SLACK, pick, prefix_key

BLOCK = 16


def test_least_loaded_without_a_key():
    assert pick([3, 1, 2], None) == 1
    assert pick([0, 0], None) == 0


def test_schedulers_out_of_rotation_are_skipped():
    assert pick([None, 7, None], None) == 1
    assert {pick([None, 7, 9], key) for key in range(100)} <= {1, 2}
    assert {pick([0, None], key) for key in range(100)} == {0}


def test_a_key_sticks_to_one_scheduler_and_keys_spread_over_all():
    loads = [4, 4, 4]
    assert len({pick(loads, 1234) for _ in range(10)}) == 1
    assert {pick(loads, key) for key in range(100)} == {0, 1, 2}


def test_an_overloaded_preferred_scheduler_spills_to_the_least_loaded():
    key = 42
    preferred = pick([0, 0], key)
    other = 1 - preferred
    limit = int(OVERLOAD_FACTOR * 10 + OVERLOAD_SLACK)
    loads = [0, 0]
    loads[other], loads[preferred] = 10, limit
    assert pick(loads, key) == preferred
    loads[preferred] = limit + 1
    assert pick(loads, key) == other


def test_a_scheduler_leaving_moves_only_its_own_keys():
    before = {key: pick([0, 0, 0], key) for key in range(300)}
    after = {key: pick([0, None, 0], key) for key in range(300)}
    assert all(after[key] == before[key] for key in before if before[key] != 1)


def test_prefix_key_covers_the_first_whole_blocks():
    prefix = list(range(100, 100 + AFFINITY_BLOCKS * BLOCK))
    assert prefix_key(prefix[:BLOCK - 1], BLOCK) is None
    assert prefix_key(prefix + [1, 2, 3], BLOCK) == prefix_key(prefix + [9] * 40, BLOCK)
    assert prefix_key([7] + prefix[1:], BLOCK) != prefix_key(prefix, BLOCK)
    # Below the cap, the key is the whole blocks, whatever follows in the last partial one.
    assert prefix_key(prefix[:BLOCK + 3], BLOCK) == prefix_key(prefix[:BLOCK] + [5], BLOCK)
