"""Weighted fair share between tenants (``workers.batching.fairshare``) and the batcher's use
of it, as pure logic: explicit ``now``, no clock, no I/O."""

from __future__ import annotations

from shared.schema import Priority
from workers.batching.batcher import Batcher, Pending, Policy
from workers.batching.fairshare import FairShare

HIGH, BULK = Priority.HIGH, Priority.BULK

QUIET = {
    "max_batch_size": 8,
    "max_queue_delay_ms": 0.0,  # every decision releases what the head's bucket holds
    "max_batch_bytes": 1 << 30,
    "max_high_waiting": 100,
    "window_size": 0,
}


def req(rid: str, tenant: str | None, priority: Priority = BULK, at: float = 0.0) -> Pending:
    return Pending(
        id=rid, priority=priority, arrival_s=at, deadline_s=None, bucket="b", tenant=tenant
    )


def batcher(fair: bool = True, **weights: float) -> Batcher:
    policy = Policy(
        **QUIET,  # type: ignore[arg-type]
        fair_share=fair,
        tenant_weights=tuple(weights.items()),
    )
    return Batcher(policy)


def drain(b: Batcher, now: float = 1.0) -> list[list[str]]:
    out = []
    while len(b):
        d = b.next_batch(now)
        assert d.batch, "a batch is due at every decision"
        out.append([p.id for p in d.batch])
    return out


def test_a_late_tenant_is_served_beside_a_backlog_not_behind_it() -> None:
    b = batcher()
    for i in range(100):
        b.add(req(f"a{i}", "a"))
    assert b.next_batch(1.0).batch[0].id == "a0"  # a alone: arrival order
    for i in range(10):
        b.add(req(f"b{i}", "b"))
    batches = drain(b)
    # b starts at the virtual time of the last batch's head: its ten requests go first
    assert [sum(x.startswith("b") for x in batch) for batch in batches[:3]] == [8, 2, 0]
    assert sorted(batches[1]) == sorted(["b8", "b9", *(f"a{i}" for i in range(8, 14))])
    # fifo would run them after all 92 of a's left: the 13th batch


def test_fifo_keeps_arrival_order() -> None:
    b = batcher(fair=False)
    for i in range(20):
        b.add(req(f"a{i}", "a"))
    b.add(req("b0", "b"))
    batches = drain(b)
    assert "b0" in batches[-1] and len(batches) == 3


def test_with_both_backlogged_the_shares_follow_the_weights() -> None:
    b = batcher()
    for i in range(40):
        b.add(req(f"a{i}", "a"))
    for i in range(40):
        b.add(req(f"b{i}", "b"))
    first = drain(b)[:5]
    assert [sum(x[0] == "b" for x in batch) for batch in first] == [4, 4, 4, 4, 4]


def test_weights_set_the_shares() -> None:
    b = batcher(a=1.0, b=3.0)
    for i in range(40):
        b.add(req(f"a{i}", "a"))
        b.add(req(f"b{i}", "b"))
    first = b.next_batch(1.0).batch
    assert sum(p.tenant == "b" for p in first) == 6  # 3:1 of 8
    assert sum(p.tenant == "a" for p in first) == 2


def test_a_tenant_keeps_its_own_arrival_order() -> None:
    b = batcher()
    for i in range(12):
        b.add(req(f"a{i}", "a"))
        b.add(req(f"b{i}", "b"))
    order = [x for batch in drain(b) for x in batch]
    assert [x for x in order if x[0] == "a"] == [f"a{i}" for i in range(12)]
    assert [x for x in order if x[0] == "b"] == [f"b{i}" for i in range(12)]


def test_priority_classes_keep_their_order_across_tenants() -> None:
    b = batcher()
    for i in range(30):
        b.add(req(f"b{i}", "b"))
    b.add(req("a-high", "a", HIGH))
    first = b.next_batch(1.0).batch
    assert first[0].id == "a-high"  # a HIGH request beats every BULK one, whoever's


def test_requests_without_a_tenant_are_the_default_tenants_and_batch_as_before() -> None:
    plain, fair = batcher(fair=False), batcher()
    for b in (plain, fair):
        for i in range(20):
            b.add(req(f"x{i}", None, at=i * 0.001))
    assert drain(plain) == drain(fair)  # nothing named: the fair path never runs
    assert fair.fair is not None and not fair.fair_now()


def test_the_default_tenant_shares_with_a_named_one() -> None:
    b = batcher()
    for i in range(40):
        b.add(req(f"x{i}", None))
    b.add(req("b0", "b"))  # the first named request: fair share starts
    assert b.fair_now()
    first = b.next_batch(1.0).batch
    assert "b0" in [p.id for p in first]


def test_expired_and_removed_requests_leave_the_count() -> None:
    b = batcher()
    b.add(Pending(id="e", priority=BULK, arrival_s=0.0, deadline_s=0.5, bucket="b", tenant="a"))
    b.add(req("r", "a"))
    assert b.fair_now()
    b.remove("r")
    d = b.next_batch(1.0)
    assert [p.id for p in d.expired] == ["e"]
    assert not b.fair_now()


def test_start_tags_follow_sfq() -> None:
    fs = FairShare({"a": 1.0, "b": 2.0})
    a = [req(f"a{i}", "a") for i in range(3)]
    for p in a:
        fs.tag(p)
    assert [p.vstart for p in a] == [0.0, 1.0, 2.0]
    fs.served(a[1:])  # V = the head's tag, 1 (a2 rode along)
    b = [req(f"b{i}", "b") for i in range(3)]
    for p in b:
        fs.tag(p)
    assert [p.vstart for p in b] == [1.0, 1.5, 2.0]  # from V, by 1/weight
