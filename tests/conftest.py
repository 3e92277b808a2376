"""Shared fixtures. ``distributed`` runs a function on every rank of a pool of gloo workers."""
import pytest

from dist_pool import Pools


@pytest.fixture(scope="session")
def distributed():
    """``distributed.run(world, fn, *args, **kwargs)`` → the results of ``fn`` on ranks 0..world-1."""
    pools = Pools()
    yield pools
    pools.close()
