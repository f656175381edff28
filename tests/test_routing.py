from rollout.routing import StickyLeastLoaded


def test_sticky_until_overloaded():
    r = StickyLeastLoaded(2, overload_factor=1.5)
    a = r.acquire("s1")
    r.release(a)
    assert all(r.acquire("s1") == a for _ in range(1))  # sticky across turns
    r.release(a)
    r.load[a] = 1  # busy, but not overloaded: stay
    assert r.acquire("s1") == a
    r.release(a)
    r.load[a] = 6  # overloaded relative to the idle engine
    moved = r.acquire("s1")
    assert moved != a and r.moves == 1  # overloaded: moved to the least loaded engine
    r.release(moved)
    r.load[a] = 0
    assert r.acquire("s1") == moved  # and stays at its new home


def test_new_sessions_spread_by_load_not_hash():
    r = StickyLeastLoaded(3)
    homes = [r.acquire(f"s{i}") for i in range(6)]
    assert sorted(homes) == [0, 0, 1, 1, 2, 2]


def test_dead_engine_gets_nothing():
    r = StickyLeastLoaded(2)
    r.home["s"] = 0
    r.drop_engine(0)
    assert r.acquire("s") == 1 and r.acquire("t") == 1


def test_an_engine_dropped_with_requests_in_flight_stays_dropped():
    """Issue 31: the requests a dying engine held are released after it is dropped. Each release took one off
    its load, so it counted as alive again and a run whose every engine died retried against the dead one."""
    r = StickyLeastLoaded(1)
    held = [r.acquire(f"s{i}") for i in range(3)]
    r.drop_engine(0)
    for index in held:
        r.release(index)
    assert r.alive() == []
