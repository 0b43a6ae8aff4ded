"""The dashboards draw XIDs by the class the rules give them: both read the same vendored catalogue."""

from gpuhealth.dashboards.settings import Settings
from gpuhealth.rules import catalogue


def test_dashboard_xid_classes_are_the_rules_classes():
    rules = {name: sorted(xids) for name, xids in catalogue.load().xid_classes().items() if name != "none"}
    drawn = {c.name: sorted(c.xids) for c in Settings().xid_classes}
    assert drawn == rules
