"""common.launcher: torchrun's variables read in one place, with one fallback (a single node)."""

import pytest

from megatron_tawpipe.common import launcher


def test_unset_reads_as_one_node():
    assert (launcher.rank({}), launcher.local_rank({}), launcher.world_size({})) == (0, 0, 1)
    assert launcher.local_world_size(environ={}) == 1
    assert launcher.local_world_size(environ={"WORLD_SIZE": "4"}) == 4     # ranks started by hand share the host
    assert launcher.local_world_size(6, environ={"LOCAL_WORLD_SIZE": ""}) == 6


def test_torchrun_values():
    env = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}
    assert (launcher.rank(env), launcher.local_rank(env), launcher.world_size(env)) == (5, 1, 8)
    assert launcher.local_world_size(environ=env) == launcher.local_world_size(8, env) == 4


def test_bad_value_names_the_variable():
    with pytest.raises(ValueError, match=r"LOCAL_WORLD_SIZE='four': must be a whole number"):
        launcher.local_world_size(environ={"LOCAL_WORLD_SIZE": "four"})
