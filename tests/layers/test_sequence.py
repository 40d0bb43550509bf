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


def test_a_compiled_decoding_step_reads_the_backend_without_a_graph_break():
    # a ContextVar read is a graph break for dynamo: every layer's forward became frames of their own, and
    # compile_decode's one graph of the whole model a graph per layer
    import torch

    from subquad.layers import GatedLinearAttention

    torch.manual_seed(0)
    layer = GatedLinearAttention(16, n_heads=2).eval()
    x, state = torch.randn(2, 1, 16), layer.empty_state(2)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="eager")     # fullgraph: a break raises
    with torch.no_grad():
        want, got = layer(x, state), compiled(x, state)
        torch.testing.assert_close(got[0], want[0])
        torch.testing.assert_close(got[1]["S"], want[1]["S"])
        mine = sequence.SingleDevice()
        with sequence.use(mine):                   # another backend: the graph's guard sends it to a new one
            torch.testing.assert_close(compiled(x, state)[0], want[0])
    assert sequence.backend() is sequence.SINGLE_DEVICE
