"""The sequence backend stack is per thread and per asyncio task: two threads generating at once each run
under their own backend (a module-global stack made both see whichever was pushed last)."""

import threading

from subquad.layers import sequence


def test_two_threads_each_see_their_own_backend_while_both_are_inside():
    barrier = threading.Barrier(2, timeout=30)
    mine = [sequence.SingleDevice(), sequence.SingleDevice()]
    seen, errors = [None, None], []

    def run(i):
        try:
            with sequence.use(mine[i]):
                barrier.wait()                  # both pushed before either looks
                seen[i] = sequence.backend()
                barrier.wait()                  # neither leaves before both have looked
            assert sequence.backend() is sequence.SINGLE_DEVICE
        except Exception as e:                  # an assertion in a thread must fail the test
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen[0] is mine[0] and seen[1] is mine[1]
    assert not errors, errors
    assert sequence.backend() is sequence.SINGLE_DEVICE
