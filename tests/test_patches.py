"""Every patch of megatron-core's behaviour is tied to the versions it applies to and pinned to the source
of what it touches: an upgrade that changes a patched call site fails here until someone re-verifies."""

from __future__ import annotations

import pytest

from mcore_packing.compat import megatron_core_version
from mcore_packing.megatron._patches import PATCHES, Patch, source_hash


@pytest.mark.parametrize("patch", PATCHES, ids=[p.name for p in PATCHES])
def test_patched_call_sites_are_the_verified_ones(patch):
    version = megatron_core_version()
    if not patch.applies():
        pytest.skip(f"{patch.name} does not apply to megatron-core {version} (range {patch.versions})")
    assert version in patch.verified, (
        f"{patch.name} applies to megatron-core {version} but was verified only on {sorted(patch.verified)}: check "
        "that the bug is still there and the repair still fits, then record the call-site hashes."
    )
    changed = {site: source_hash(site) for site, want in patch.verified[version].items() if source_hash(site) != want}
    assert changed == {}, f"{patch.name}: these call sites changed; re-verify the patch and record {changed}"


def test_negative_control_another_source_or_version_is_flagged():
    site = next(iter(PATCHES[0].verified["0.16.1"]))
    assert source_hash(site) != source_hash("mcore_packing.megatron._patches:source_hash")
    assert Patch(name="x", what="", versions=((0, 16), (0, 17))).applies("0.16.1")
    assert not Patch(name="x", what="", versions=((0, 16), (0, 17))).applies("0.19.2")
