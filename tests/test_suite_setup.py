"""What `./dev test` relies on to stay within CI's time."""

from __future__ import annotations

import pytest


@pytest.mark.xdist_group("suite-setup")
def test_tests_marked_with_a_group_share_a_worker(request):
    """`--dist loadgroup` sends the tests of one xdist_group to one worker, so that the demo's lab,
    an agent runtime's session or the adversarial rig is made once, not once per worker. pytest-xdist
    does it by suffixing each grouped test's node id with its group; a pytest that no longer reads
    that suffix (9.2, with xdist 3.8) spreads every group over the workers without a word."""
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("run without --dist loadgroup (./dev test passes it)")
    assert request.node.nodeid.endswith("@suite-setup"), request.node.nodeid
