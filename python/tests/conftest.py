"""Shared fixtures of the binding's tests.

The seed of every random input is printed (and can be set with
MLA_TEST_SEED); CPU contexts use 2 threads (the CI machine has 2 cores).
"""

import os
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # reference.py
sys.path.insert(0, os.path.dirname(HERE))  # the libmla package (python/)

import libmla  # noqa: E402

SEED = int(os.environ.get("MLA_TEST_SEED", "20240611"))

# Lines the tests want in the run's output (the overhead measurement).
REPORT = []


def pytest_report_header(config):
    return ["libmla: %s (version %s), seed %d (MLA_TEST_SEED)" % (libmla.library_path,
                                                                  libmla.library_version, SEED)]


def pytest_terminal_summary(terminalreporter):
    if REPORT:
        terminalreporter.write_sep("-", "libmla measurements")
        for line in REPORT:
            terminalreporter.write_line(line)


@pytest.fixture
def rng(request):
    # One stream per test, derived from the seed and the test's name, so a
    # test's inputs do not depend on which other tests ran.
    h = sum(ord(ch) * (i + 1) for i, ch in enumerate(request.node.name)) % (2**31)
    return np.random.default_rng([SEED, h])


@pytest.fixture(scope="session")
def ctx():
    c = libmla.Context(num_threads=2)
    yield c
    c.close()



@pytest.fixture(scope="module")
def cctx():
    """A libmla CUDA context for the GPU tests (they skip when there is none),
    with TF32 off in torch so that torch references are plain fp32."""
    try:
        c = libmla.Context("cuda")
    except libmla.MLAError as e:
        pytest.skip("skipped: libmla has no CUDA context here (%s)" % e)
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield c
    torch.cuda.synchronize()
    c.close()
