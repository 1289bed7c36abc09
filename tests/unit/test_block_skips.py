"""The executor's block skips (input skip_blocks, SkipLayerGuidanceDiT's skipped blocks): mapped through a plan's
comfy_blocks to its stages, kinds the family's ComfyUI model does not address ignored as ComfyUI ignores them,
refused by name for a family that declares none, and bad input refused."""
import pytest

from sp_runtime.families.ltx2 import PLAN as LTX2_PLAN
from sp_runtime.families.wan.plan import PLAN as WAN_PLAN
from sp_runtime.sp.executor import block_skips


def test_skips_map_to_the_plans_stages():
    assert block_skips(WAN_PLAN, None, "wan") == {}
    assert block_skips(WAN_PLAN, {"double_block": [7, 8], "single_block": [1]}, "wan") == {
        "blocks": frozenset({7, 8})}


def test_a_family_without_block_kinds_refuses_skips_by_name():
    with pytest.raises(ValueError, match="skip_blocks, e.g. SkipLayerGuidanceDiT.*not supported for ltx2"):
        block_skips(LTX2_PLAN, {"double_block": [0]}, "ltx2")


@pytest.mark.parametrize("given", [{"double_block": "7"}, {"double_block": [True]}, [7]])
def test_bad_skip_blocks_are_clear_errors(given):
    with pytest.raises(ValueError, match="skip_blocks must map a block kind to a list of block indices"):
        block_skips(WAN_PLAN, given, "wan")
