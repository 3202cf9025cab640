"""The pool of receive buffers (bluefog_lite/_pool.py): bounded; when full, sizes no
longer used make room for new ones, and sizes in use keep their buffers."""
from bluefog_lite._pool import BufferPool


def given_back(pool, nbytes):
    buf, give = pool.take(nbytes)
    give()
    return buf


def test_a_size_used_now_is_pooled_after_sizes_no_longer_used_filled_the_pool():
    """Sizes that never come back (a neighbor_allgather's varying rows) filled the pool for
    good, and every later size was allocated afresh on each receive."""
    pool = BufferPool(10_000, stale_takes=50)
    for n in range(1000, 1100):             # 100 sizes, 9 of which fit at once
        given_back(pool, n)
        assert pool._held <= 10_000
    bufs = [given_back(pool, 3000) for _ in range(100)]
    assert all(b is bufs[-1] for b in bufs[60:])    # once the old sizes are stale: the same buffer
    assert pool._held <= 10_000 and pool.free_count(3000) == 1


def test_sizes_a_step_cycles_through_keep_their_buffers_when_they_do_not_all_fit():
    """Thirty sizes received in turn, three times what the pool holds: evicting the least
    recently used size made every receive a miss; the sizes that fit are reused."""
    pool = BufferPool(10_000, stale_takes=100)
    sizes = range(1000, 1030)
    first = {n: given_back(pool, n) for n in sizes}
    for _ in range(3):
        hits = sum(given_back(pool, n) is first[n] for n in sizes)
        assert hits >= 9, hits
    assert pool._held <= 10_000


def test_the_stale_size_used_least_recently_goes_first():
    pool = BufferPool(1000, stale_takes=3)
    (x1, give1), (_, give2) = pool.take(400), pool.take(400)
    give1()
    give2()                                 # 800 held, taken 2 takes ago
    given_back(pool, 300)                   # 3 takes: the 400s are still in use: the 300 is dropped
    assert (pool.free_count(400), pool.free_count(300), pool._held) == (2, 0, 800)
    pool.take(50)
    given_back(pool, 300)                   # the 400s are stale now: one of them makes room
    assert (pool.free_count(400), pool.free_count(300), pool._held) == (1, 1, 700)
    assert given_back(pool, 400) is x1      # the 400 size is now the most recently used
    pool.take(50)
    pool.take(50)
    d = given_back(pool, 500)               # needs 500 of the 1000: the 300 goes, the 400 stays
    assert (pool.free_count(300), pool.free_count(400), pool.free_count(500), pool._held) == (0, 1, 1, 900)
    assert pool.take(500)[0] is d and pool.take(400)[0] is x1


def test_buffers_larger_than_the_pool_and_empty_sizes_are_not_kept():
    pool = BufferPool(1000)
    given_back(pool, 2000)
    assert pool.free_count(2000) == 0 and pool._held == 0
    for n in range(1, 50):
        pool.take(n)[1]()
        pool.take(n)                        # taken again, not given back
    assert pool._free == {} and pool._used == {} and pool._held == 0    # nothing left per size
    assert BufferPool(0).take(8)[0].nbytes == 8
