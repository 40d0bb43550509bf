"""Whether this thread's products are decoding: ``with decoding():`` around a decoding step or a speculative
verification - one or a few tokens of each of many rows - as against a prompt's prefill.

``models.quant``'s int8 products read it: inside, they take fbgemm's kernel at any number of rows,
``quant.DECODE_ROWS`` rows per call (a row's activations share a scale with at most 15 others, as in a 16-row
step), never a float copy of the matrix - fbgemm was 3-70x faster than the dequantised product at 16-2,048 rows
(benchmarks/RESULTS.md, "int8 at any batch"); prompts outside it keep the exact product (float activations),
except on a CPU with AMX tiles, where every int8 product of 3 rows or more takes them, inside or out.
``LanguageModel.step`` and ``speculative.verify`` enter it. A module of its own, importing nothing of subquad's:
the model, speculation and quantisation all read it.
"""

from __future__ import annotations

import contextlib
import threading

MODE = threading.local()


@contextlib.contextmanager
def decoding():
    """This thread's products are decoding inside (module doc); nests."""
    was = getattr(MODE, "decoding", False)
    MODE.decoding = True
    try:
        yield
    finally:
        MODE.decoding = was
