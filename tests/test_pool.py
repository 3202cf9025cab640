"""The pool of receive buffers (bluefog_lite/_pool.py): bounded, and the sizes given
back least recently make room for new ones."""
from bluefog_lite._pool import BufferPool


def given_back(pool, nbytes):
    buf, give = pool.take(nbytes)
    give()
    return buf


def test_a_size_used_now_is_pooled_after_sizes_no_longer_used_filled_the_pool():
    """Sizes that never come back (a neighbor_allgather's varying rows) filled the pool for
    good, and every later size was allocated afresh on each receive."""
    pool = BufferPool(10_000)
    for n in range(1000, 1100):             # 100 sizes, 10 of which fit
        given_back(pool, n)
    assert pool._held <= 10_000
    first = given_back(pool, 3000)
    for _ in range(5):                      # a steady size: the same buffer every time
        buf, give = pool.take(3000)
        assert buf is first
        give()
    assert pool._held <= 10_000 and pool.free_count(3000) == 1


def test_the_size_given_back_least_recently_goes_first():
    pool = BufferPool(1000)
    (x1, give1), (_, give2) = pool.take(400), pool.take(400)
    give1()
    give2()                                 # 800 held
    given_back(pool, 300)                   # one 400 makes room (the 400s are the older size)
    assert (pool.free_count(400), pool.free_count(300), pool._held) == (1, 1, 700)
    again = given_back(pool, 400)           # the 400 size is now the most recent
    assert again is x1
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
    assert pool._free == {} and pool._held == 0     # no empty lists left behind per size
    assert BufferPool(0).take(8)[0].nbytes == 8
