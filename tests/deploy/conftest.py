"""Fixtures of the deployment tests: real kdn processes on loopback, started
and stopped with launch/kdn-launch (docs/serving.md). Each deployment shape is
started once and shared by the tests that need it; teardown always runs
`kdn-launch down` and then SIGKILLs anything it left.

Environment: KDN_BIN_DIR (the binaries; ctest sets it), KDN_REPO (the source
tree; default: two folders up).
"""

import pytest

from deploy_util import Deployment, make_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return make_model("tiny", 1, tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session")
def small_model(tmp_path_factory):
    # The fault test needs a stream that lasts seconds: the tiny model
    # generates thousands of tokens per second, the small one about 40 per
    # second per CPU thread.
    return make_model("small", 0, tmp_path_factory.mktemp("models") / "small")


@pytest.fixture(scope="session")
def deployment(tiny_model, tmp_path_factory):
    """1 prefill and 1 decode worker serving the tiny model."""
    d = Deployment(tmp_path_factory.mktemp("run-1x1"), tiny_model)
    try:
        yield d
    finally:
        d.down()


@pytest.fixture(scope="module")
def store_deployment(tiny_model, tmp_path_factory):
    """1 prefill and 1 decode worker with a shared kdn-store, the tiny model;
    one per test module (each reads its own conversations' counters)."""
    d = Deployment(tmp_path_factory.mktemp("run-store"), tiny_model, "--store",
                   "--store-host-mib", 64)
    try:
        yield d
    finally:
        d.down()
