"""``python -m nsa_numba bench``: throughput against the machine's copy bandwidth.

Both operators move far more bytes than they compute, so the honest yardstick is
memory bandwidth, measured in the same run on the same threads: a parallel Numba
copy of a buffer larger than the caches, timed in turn with each case's forward and
backward calls, round after round, so that a machine shared with other work slows
all three alike. Each case reports medians over ``repeat`` rounds: the time, the
GB/s it implies, the copy's GB/s, and the percentage of copy (the median over
rounds of the kernel's rate against the same round's copy rate); and, when
PyTorch is installed, the time of the idiomatic PyTorch implementation (``unfold`` +
``einsum``, autograd for the backward) on the same thread count: its best of a third
as many calls, which can only favour it.

A copy counts its read and its write, which the memory system serves side by side;
``--read`` also times two read-only passes in the same rounds: one over a buffer
larger than the caches, the ceiling for the forward, which reads d bytes for every
byte it writes; and one over each case's own input (a parallel Numba pass in
tile-sized chunks), which reads the very memory the forward reads, where the copy
reads other memory. A forward that reads its input once matches that pass at best,
except where the pass, which leaves the prefetching to the hardware, runs slow on
that memory and the forward's software prefetch does not.

Bytes counted: forward = input read + output written; backward = input read + grad
read + input_grad written (the weights are negligible).
"""

from .. import api  # noqa: F401  (tests patch the calls bench makes through it)
from .cases import (
                    DEFAULT_SHAPES,
                    DTYPES,
                    INFER_CASES,
                    INFER_WINDOW,
                    NON_CONTIGUOUS,
                    OVERHEAD_SHAPE,
                    Case,
                    infer_problem,
                    make_data,
                    numpy_dtype,
                    parse_shape,
                    sequence_ends,
)
from .cli import add_arguments, main
from .harness import CacheFlush, best_time, copy_task, input_read_task, read_task, round_times
from .reports import format_table, markdown_table, plot_results
from .runs import (
                    TO_LAUNCH_ROUNDS,
                    call_memory,
                    overhead,
                    prepared_launches,
                    python_to_launch,
                    run_case,
                    run_infer_case,
                    torch_baseline,
)

__all__ = ["DEFAULT_SHAPES", "DTYPES", "INFER_CASES", "INFER_WINDOW", "NON_CONTIGUOUS",
           "OVERHEAD_SHAPE", "TO_LAUNCH_ROUNDS", "CacheFlush", "Case", "add_arguments",
           "best_time", "call_memory", "copy_task", "format_table", "infer_problem",
           "input_read_task", "main", "make_data", "markdown_table", "numpy_dtype",
           "overhead", "parse_shape", "plot_results", "prepared_launches", "python_to_launch",
           "read_task", "round_times", "run_case", "run_infer_case", "sequence_ends",
           "torch_baseline"]
