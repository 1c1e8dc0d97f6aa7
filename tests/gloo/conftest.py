import pytest

from gloo_harness import spawn_ranks

WORLD = 2
TIMEOUT_S = 110  # a hang fails the module's tests instead of hanging CI


@pytest.fixture(scope="module")
def gloo_outcomes(request, tmp_path_factory):
    """Run the requesting module's checks once on WORLD gloo ranks (a module may set its own
    GLOO_WORLD), see gloo_harness.py."""
    world = getattr(request.module, "GLOO_WORLD", WORLD)
    return spawn_ranks(request.module.__file__, world, tmp_path_factory.mktemp("gloo"), TIMEOUT_S)
