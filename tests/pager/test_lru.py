import pytest

from kvmemory.pager import LRUTier


def test_evicts_least_recently_used_within_budget():
    t = LRUTier("host", budget_bytes=300)
    for k in "abc":
        t.put(k, k.upper(), 100)
    assert t.get("a") == "A"               # a is now most recent
    t.put("d", "D", 100)                    # evicts b
    assert "b" not in t and {"a", "c", "d"} <= set(t._items)
    assert t.used_bytes == 300 and t.stats.evictions == 1
    assert t.get("b") is None
    assert (t.stats.hits, t.stats.misses) == (1, 1) and t.stats.hit_rate == 0.5


def test_oversized_items_are_not_cached_and_discard_frees_bytes():
    t = LRUTier("host", budget_bytes=100)
    t.put("big", 1, 101)
    assert "big" not in t and t.used_bytes == 0
    t.put("x", 1, 60)
    t.discard(["x", "missing"])
    assert t.used_bytes == 0 and len(t) == 0
    with pytest.raises(ValueError):
        LRUTier("bad", -1)
