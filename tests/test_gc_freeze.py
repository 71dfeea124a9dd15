"""The step loops run with the heap alive at their start frozen (out of the garbage collector's walks), and hand it
back when they end, so engines dropped afterwards are freed."""

from __future__ import annotations

import gc
import weakref

from nvllm import SamplingParams
from nvllm.engine.gc_freeze import frozen_heap
from tests.conftest import make_llm


def test_generate_steps_with_the_heap_frozen(demo_dir):
    llm = make_llm(demo_dir)
    seen = []
    step = llm.engine.step

    def counting_step(*a, **kw):
        seen.append(gc.get_freeze_count())
        return step(*a, **kw)

    llm.engine.step = counting_step
    before = gc.get_freeze_count()
    llm.generate(["Once upon a time"], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert seen and min(seen) > before          # the engine's objects were frozen while it stepped
    assert gc.get_freeze_count() == before      # and handed back afterwards


def test_nested_freezes_release_once_and_cycles_are_freed_after():
    class Node:
        pass

    before = gc.get_freeze_count()
    a = Node()
    a.self = a                                  # a cycle: only the collector frees it
    ref = weakref.ref(a)
    with frozen_heap():
        with frozen_heap():
            del a
            gc.collect()
            assert ref() is not None            # frozen: the collector does not see it
        assert gc.get_freeze_count() > before   # the outer loop still holds the freeze
    gc.collect()
    assert ref() is None and gc.get_freeze_count() == before
