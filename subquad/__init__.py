"""subquad: sequence mixers that escape attention's quadratic cost, in plain PyTorch.

Every mechanism is one function computed in three forms that agree -
``parallel`` (T x T), ``recurrent`` (token by token, fixed state) and ``chunk``
(chunkwise parallel, the fast path). See ``subquad.ops``.
"""

__version__ = "0.1.0"
