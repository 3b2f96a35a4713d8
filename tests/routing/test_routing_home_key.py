"""The home key names a prompt's leading blocks: shared system prompts share it, different ones do not."""

from __future__ import annotations

from gateway.route_planner import home_key
from gateway.routing.homes import HOME_BLOCKS
from index.block_hash import chain


def test_prompts_sharing_their_first_blocks_share_a_home_key():
    system = list(range(1000, 1000 + 16 * HOME_BLOCKS + 5))
    one, two = chain(system + [1, 2, 3] * 20, 16, 7), chain(system + [4, 5] * 30, 16, 7)
    assert home_key(one) == home_key(two) != ""
    other = chain([9] + system[1:] + [1, 2, 3] * 20, 16, 7)
    assert home_key(other) != home_key(one)


def test_a_short_prompt_is_named_by_all_its_blocks_and_one_without_a_full_block_by_nothing():
    assert home_key(chain(list(range(40)), 16, 7)) == f"{chain(list(range(40)), 16, 7)[1]:016x}"
    assert home_key([]) == ""
