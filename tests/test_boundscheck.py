"""NSA_NUMBA_BOUNDSCHECK=1: the debugging build really checks every index.

CI also runs a reduced test set in this mode (see .ci/run); this test shows the mode
is live: a tile table pointing past the end of the input, which the planner never
produces, must raise instead of reading out of bounds.
"""

import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import sys
import numpy as np
from nsa_numba._ops import dispatch as _dispatch
from nsa_numba._core import jit as _jit, launch as _launch
from nsa_numba._kernels import compress as _kernels, tiles as _tiles
from nsa_numba._ops.checks import Rules
from nsa_numba._ops.compress import plan_forward

assert _jit.BOUNDSCHECK
D = int(sys.argv[2])
x = np.ones((64, 2, D), np.float32)
w = np.ones((32, 2), np.float32)
plan = plan_forward(Rules("test"), x, w, 32, 16, None, 0, "TND", None)
plan.allocate()
tiles = plan.tiles.copy()
tiles[:, _tiles.NW] += 5          # five windows beyond the input's last token
tiles[:, _tiles.I1] += 5
_, scratch = _dispatch.carve(plan, _dispatch.new_workspace(plan))
try:
    x, out = plan.storage("input"), plan.storage("out")
    _launch.run(getattr(_kernels, sys.argv[1]), 1, 1, x, plan.storage("weight"), out, scratch,
                np.array([x.shape, out.shape]), tiles, 16, D, False)
except Exception as err:
    chain = [err, err.__cause__, err.__context__]
    assert any(isinstance(e, IndexError) for e in chain), repr(chain)
    print("raised")
"""


@pytest.mark.slow
@pytest.mark.parametrize("kernel,D", [("compress_forward_rows", 16),
                                      ("compress_forward_simd", 128)])
def test_boundscheck_mode_catches_an_out_of_bounds_tile(kernel, D):
    # the vector kernel's loads and stores bypass Numba's indexing: _simd.check_row
    # must catch the same tile
    env = dict(os.environ, NSA_NUMBA_BOUNDSCHECK="1")
    child = subprocess.run([sys.executable, "-c", SCRIPT, kernel, str(D)], env=env,
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    assert child.stdout.strip() == "raised"


BACKWARD_SCRIPT = r"""
import numpy as np
from nsa_numba._ops import dispatch as _dispatch
from nsa_numba._core import jit as _jit, launch as _launch
from nsa_numba._kernels import compress as _kernels, tiles as _tiles
from nsa_numba._ops.checks import Rules
from nsa_numba._ops.compress import plan_grad

assert _jit.BOUNDSCHECK
x = np.ones((96, 2, 64), np.float32)
w = np.ones((32, 2), np.float32)
g = np.ones((5, 2, 64), np.float32)
plan = plan_grad(Rules("test"), g, x, w, 32, 16, None, 0, "TND", None, None)
plan.allocate()
workspace = _dispatch.new_workspace(plan)
partials, scratch = _dispatch.carve(plan, workspace)
# one tile of tokens 32-63 only (windows 1-3): the pairs of tokens 32-47 with 48-63,
# which go through the vectors, and an input cut at token 40, so that the first and
# only reads out of bounds are the vector loads of tokens 48-63
tiles = plan.tiles[:1].copy()
tiles[0, _tiles.TOK_LO] = 32
tiles[0, _tiles.TOK_HI] = 64
tiles[0, _tiles.G0] = 1
tiles[0, _tiles.G1] = 4
short = plan.storage("input")[:, :40]
try:
    g, ig = plan.storage("grad"), plan.storage("input_grad")
    _launch.run(_kernels.compress_backward_simd, 1, 1, g, short, plan.storage("weight"), ig,
                plan.storage("weight_grad"), partials, scratch,
                np.array([g.shape, short.shape, ig.shape]), tiles, 16, 64, False)
except Exception as err:
    chain = [err, err.__cause__, err.__context__]
    assert any(isinstance(e, IndexError) for e in chain), repr(chain)
    print("raised")
"""


@pytest.mark.slow
def test_boundscheck_mode_covers_the_backward_vectors():
    env = dict(os.environ, NSA_NUMBA_BOUNDSCHECK="1")
    child = subprocess.run([sys.executable, "-c", BACKWARD_SCRIPT], env=env,
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    assert child.stdout.strip() == "raised"
