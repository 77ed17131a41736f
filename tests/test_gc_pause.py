import gc
import weakref

import pytest

from fedray.gc_pause import imports_without_gc


@pytest.fixture(autouse=True)
def _collector_as_found():
    was_enabled = gc.isenabled()
    yield
    gc.unfreeze()  # what a test froze goes back to the collector, so no later test runs with a frozen heap
    (gc.enable if was_enabled else gc.disable)()


class _Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the cyclic collector reclaims it


def test_the_block_runs_without_collections_and_what_it_made_is_frozen_after():
    gc.enable()
    gc.unfreeze()
    runs = []

    def count(phase, info):
        if phase == "start":
            runs.append(info["generation"])

    gc.callbacks.append(count)
    try:
        with imports_without_gc():
            assert not gc.isenabled()
            made = [_Node() for _ in range(50_000)]  # 70 times the young generation's threshold
            assert runs == []
            assert gc.get_freeze_count() == 0
        assert gc.isenabled()
        assert gc.get_freeze_count() >= len(made)
        one = weakref.ref(made[0])
        del made
        # Frozen cycles are never traversed, so a full collection does not reclaim them: the cost the module
        # names (what the block makes must be long-lived). Unfrozen, they are garbage again.
        gc.collect()
        assert one() is not None
        gc.unfreeze()
        gc.collect()
        assert one() is None
    finally:
        gc.callbacks.remove(count)


def test_the_collector_is_restored_as_it_was_also_when_the_block_raises():
    gc.disable()
    with imports_without_gc():
        pass
    assert not gc.isenabled()  # a caller that had turned it off keeps it off
    gc.enable()
    with pytest.raises(ImportError):
        with imports_without_gc():
            import fedray.no_such_module  # noqa: F401
    assert gc.isenabled()


def test_without_freezing_the_block_only_pauses_the_collector():
    # For a caller's process (MLflow's import in fedray.record.tracking): its cycles stay collectable.
    gc.enable()
    gc.unfreeze()
    with imports_without_gc(freeze=False):
        assert not gc.isenabled()
        one = weakref.ref(_Node())
        assert one() is not None  # the cycle outlives its last reference while the collector is paused
    assert gc.isenabled() and gc.get_freeze_count() == 0
    gc.collect()
    assert one() is None
