"""Print one closing line for both lanes: 'flowlane: N passed, N failed, N skipped'."""

import sys
import xml.etree.ElementTree as ET

passed = failed = skipped = 0
for path in sys.argv[1:]:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as e:
        print(f"test report {path} is missing or unreadable: {e}", file=sys.stderr)
        failed += 1
        continue
    for suite in root.iter("testsuite"):
        t, f, e, s = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
        passed += t - f - e - s
        failed += f + e
        skipped += s
print(f"flowlane: {passed} passed, {failed} failed, {skipped} skipped")
sys.exit(1 if failed or passed == 0 else 0)
